// What this process holds, listed where a Python worker finds it if the process dies
// (jetloop/streams/holds.py; serving-tools.md 7.2): `held.<incarnation>` in `jl_workers`, the JSON
// `{"worker": <id>, "held": [[<stream>, <sequence>], ...], "link": <server id>}` with header
// `Jl-Link`. A Python worker that hears this process's connection close (or finds it gone on
// its server) copies the listed messages with `Jl-Holder-Lost`, and the next worker of the
// pool takes them over in about a second instead of a lease.
//
// The list is a core publish (no round trip on the step's path), sent when a message is
// fetched — at once after a quiet spell, else at the end of 25 ms, one list for every fetch
// of that while — and with each presence refresh while anything is held. A settled message
// leaves the list at once; the next list leaves it out. A drain that ran out says
// `"drained": true`, sent through JetStream and confirmed: the step is then resumed without
// a loss of its turn.

import type { MsgHdrs, NatsConnection } from "@nats-io/transport-node";
import { headers as natsHeaders } from "@nats-io/transport-node";
import type { JetStreamClient, JsMsg } from "@nats-io/jetstream";

const SPACING_MS = 25;

export class Holds {
  private readonly held = new Map<string, string>();
  drained = false;
  private timer: NodeJS.Timeout | null = null;
  private lastSent = -Infinity;

  constructor(
    private readonly nc: NatsConnection,
    private readonly js: JetStreamClient,
    private readonly incarnation: string,
    private readonly workerId: string,
  ) {}

  get size(): number {
    return this.held.size;
  }

  /** A message fetched: listed now, or with the next list within 25 ms. */
  add(m: JsMsg): void {
    this.held.set(`${m.info.stream}\u0000${m.seq}`, `[${JSON.stringify(m.info.stream)}, ${m.seq}]`);
    if (this.timer !== null) return;
    const wait = this.lastSent + SPACING_MS - Date.now();
    if (wait <= 0) {
      this.publish();
      return;
    }
    this.timer = setTimeout(() => {
      this.timer = null;
      this.publish();
    }, wait);
  }

  /** A message settled (acked, nak'd, dead-lettered): left out of the next list. */
  drop(m: JsMsg): void {
    this.held.delete(`${m.info.stream}\u0000${m.seq}`);
  }

  /** The list as it is now, not confirmed (lost with the process, its steps wait a lease). */
  publish(): void {
    this.lastSent = Date.now();
    const [subject, body, hdrs] = this.list();
    try {
      this.nc.publish(subject, body, { headers: hdrs });
    } catch {
      // closed or reconnecting: the next list (or the lease) covers it
    }
  }

  /** The list stored by the bucket before this returns: a drain's last word. */
  async publishConfirmed(timeoutMs: number): Promise<void> {
    this.lastSent = Date.now();
    const [subject, body, hdrs] = this.list();
    await this.js.publish(subject, body, { headers: hdrs, timeout: timeoutMs });
  }

  stop(): void {
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = null;
  }

  private list(): [string, string, MsgHdrs | undefined] {
    const server = this.nc.info?.server_id;
    const link = typeof server === "string" && server !== "" ? server : null;
    let body = `{"worker": ${JSON.stringify(this.workerId)}, "held": [${[...this.held.values()].join(", ")}]`;
    if (this.drained) body += `, "drained": true`;
    if (link !== null) body += `, "link": ${JSON.stringify(link)}`;
    body += "}";
    let hdrs: MsgHdrs | undefined;
    if (link !== null) {
      hdrs = natsHeaders();
      hdrs.set("Jl-Link", link);
    }
    return [`$KV.jl_workers.held.${this.incarnation}`, body, hdrs];
  }
}
