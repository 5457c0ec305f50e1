// The jl_state bucket: reads with their revision, stored time and the revision their write
// replaced; every write a CAS publish (jetloop/streams/state.py).

import { decode } from "@msgpack/msgpack";
import { headers as natsHeaders } from "@nats-io/transport-node";
import type { NatsConnection } from "@nats-io/transport-node";
import { JetStreamApiError } from "@nats-io/jetstream";
import type { JetStreamClient, JetStreamManager } from "@nats-io/jetstream";
import { Sealer, type Rec } from "./seal.js";

export const STATE_BUCKET = "jl_state";
const STREAM = `KV_${STATE_BUCKET}`;
const PREFIX = `$KV.${STATE_BUCKET}.`;
const EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence";
const WRONG_LAST_SEQUENCE = new Set([10071, 10164]);

/** A CAS lost: the key exists (create) or its revision moved on (update). */
export class Conflict extends Error {
  constructor(readonly key: string, readonly expected: number | null) {
    super(`state key ${key} changed (expected revision ${expected})`);
  }
}

/** A record whose seal does not verify: never acted on (serving-tools.md 8.3). */
export class SealBroken extends Error {
  constructor(readonly key: string, readonly reason: string) {
    super(`record ${key} is not trusted: ${reason}`);
  }
}

export interface Stored {
  data: Uint8Array;
  revision: number;
  storedAt: number; // unix seconds, the server's clock
  replaced: number | null;
  marker: boolean; // a delete or purge marker, not a value
}

export interface Versioned<T = Rec> {
  value: T;
  revision: number;
  storedAt: number;
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

export function isTransient(err: unknown): boolean {
  const name = (err as Error)?.name ?? "";
  const msg = String((err as Error)?.message ?? err);
  return (
    name === "TimeoutError" ||
    name === "RequestError" ||
    name === "ConnectionError" ||
    name === "ClosedConnectionError" ||
    /timeout|no responders|disconnect|closed|503/i.test(msg)
  );
}

export const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

export class StateStore {
  writeTimeoutMs: number;
  constructor(
    readonly nc: NatsConnection,
    readonly js: JetStreamClient,
    readonly jsm: JetStreamManager,
    readonly sealer: Sealer,
    leaseSeconds: number,
    readonly retryForMs = 15_000,
  ) {
    this.writeTimeoutMs = Math.max(500, (leaseSeconds * 1000) / 4);
  }

  /** The last message stored at `key` (from the stream's leader), or null. */
  async last(key: string): Promise<Stored | null> {
    const m = await this.jsm.streams.getMessage(STREAM, { last_by_subj: PREFIX + key });
    if (m === null) return null;
    const h = m.header;
    const op = h.get("KV-Operation");
    const exp = h.get(EXPECTED_LAST);
    // The server's RFC 3339 time, nanoseconds: read to the microsecond.
    const ts = m.timestamp;
    const [head, frac = "0"] = ts.replace(/Z$/, "").split(".");
    const storedAt = Date.parse(`${head}Z`) / 1000 + Number(`0.${frac}`);
    return {
      data: m.data,
      revision: m.seq,
      storedAt,
      replaced: exp && /^\d+$/.test(exp) ? Number(exp) : null,
      marker: op === "DEL" || op === "PURGE",
    };
  }

  /** A key's current value, verified (SealBroken when it does not). */
  async get(key: string): Promise<Versioned | null> {
    const raw = await this.last(key);
    if (raw === null || raw.marker) return null;
    return this.typed(key, raw);
  }

  typed(key: string, raw: Stored): Versioned {
    let data: unknown;
    try {
      data = decode(raw.data);
    } catch (exc) {
      throw new SealBroken(key, `it is not msgpack (${String(exc)})`);
    }
    if (data === null || typeof data !== "object" || Array.isArray(data)) {
      throw new SealBroken(key, "it is not a record");
    }
    const why = this.sealer.verify(key, data as Rec, raw.data, raw.storedAt, raw.replaced);
    if (why !== null) throw new SealBroken(key, why);
    return { value: data as Rec, revision: raw.revision, storedAt: raw.storedAt };
  }

  async revision(key: string): Promise<number | null> {
    const raw = await this.last(key);
    return raw === null || raw.marker ? null : raw.revision;
  }

  private async cas(key: string, data: Uint8Array, revision: number): Promise<number> {
    const h = natsHeaders();
    h.set(EXPECTED_LAST, String(revision));
    try {
      const ack = await this.js.publish(PREFIX + key, data, { headers: h, timeout: this.writeTimeoutMs });
      return ack.seq;
    } catch (err) {
      if (err instanceof JetStreamApiError && WRONG_LAST_SEQUENCE.has(err.code)) {
        throw new Conflict(key, revision || null);
      }
      throw err;
    }
  }

  /** Create when `revision` is null, else CAS-update from it. A try that times out or meets
   * an outage is tried again for up to 15 s; a Conflict on a retry, or any failed try, first
   * reads the key back: if it holds bytes we sent, the write landed (serving-tools.md 3.3). */
  async write(key: string, value: Rec, revision: number | null): Promise<number> {
    const sent: Uint8Array[] = [];
    const deadline = Date.now() + this.retryForMs;
    let tried = false;
    const landed = async (): Promise<number | null> => {
      const raw = await this.last(key);
      if (raw === null || raw.marker) return null;
      return sent.some((s) => sameBytes(s, raw.data)) ? raw.revision : null;
    };
    for (;;) {
      const again = tried;
      tried = true;
      try {
        if (revision === null) {
          const data = this.sealer.encodeSealed(key, value, 0);
          sent.push(data);
          try {
            return await this.cas(key, data, 0);
          } catch (err) {
            if (!(err instanceof Conflict)) throw err;
            // Over the tombstone a deleted value left (sealed anew for that revision).
            const last = await this.last(key);
            if (last === null || !last.marker) throw new Conflict(key, null);
            const over = this.sealer.encodeSealed(key, value, last.revision);
            sent.push(over);
            return await this.cas(key, over, last.revision);
          }
        }
        const data = this.sealer.encodeSealed(key, value, revision);
        sent.push(data);
        return await this.cas(key, data, revision);
      } catch (err) {
        if (err instanceof Conflict) {
          if (again) {
            const rev = await landed().catch(() => null);
            if (rev !== null) return rev;
          }
          throw err;
        }
        if (!isTransient(err) || Date.now() > deadline) throw err;
        const rev = await landed().catch(() => null);
        if (rev !== null) return rev;
        await sleep(100);
      }
    }
  }
}
