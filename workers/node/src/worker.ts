// A jetloop tool worker: serves the call steps of one agent's tools of a pool of their own
// (`served_elsewhere` on the Python side): `jl.step.<pool>.<agent>.call_tool.<sid>` and
// `.call_single_attempt_tool.<sid>`. The protocol: docs/serving-tools.md; the
// reference: jetloop/consumers/call_tool.py, calls.py, runtime.py,
// liveness.py, losses.py, dispatch.py.

import { randomBytes } from "node:crypto";
import { hostname } from "node:os";
import { decode, encode } from "@msgpack/msgpack";
import { connect, headers as natsHeaders } from "@nats-io/transport-node";
import type { Msg, MsgHdrs, NatsConnection, Subscription } from "@nats-io/transport-node";
import { AckPolicy, DeliverPolicy, jetstream, jetstreamManager } from "@nats-io/jetstream";
import type { Consumer, JetStreamClient, JetStreamManager, JsMsg } from "@nats-io/jetstream";
import { Kvm } from "@nats-io/kv";
import type { KV } from "@nats-io/kv";
import { Objm } from "@nats-io/obj";
import { keyBytes, Sealer, type Rec } from "./seal.js";
import { Conflict, SealBroken, StateStore, isTransient, sleep, type Versioned } from "./state.js";
import { Faults } from "./faults.js";
import { Holds } from "./holds.js";
import { Invocations } from "./invocations.js";
import { blake2b } from "@noble/hashes/blake2.js";
import { Effect, RetryableToolError, ToolError, needsApproval, type Tool, type ToolContext } from "./tools.js";

export const VERSION = "0.1.0";
const STEPS_STREAM = "JL_STEPS";
const EVENTS_STREAM = "JL_EVENTS";
const SCHEMA_VERSION = 1;
const KINDS = ["call_tool", "call_single_attempt_tool", "await_tool_approval"] as const;
const DONE_STATES = new Set(["succeeded", "failed", "outcome_unknown", "denied", "cancelled"]);
const LOSABLE = new Set(["in_doubt", "running"]);
const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const NOT_RUN = "the tool did not run, so it is safe to call again";
const NOT_SENT_AGAIN =
  "the outcome of this call is unknown: its worker stopped while it ran, and it was not sent again";
const BEAT_GRACE = 15;
const RECONNECT_GRACE = 3;
const POOL_NAME = /^[a-z][a-z0-9_-]{0,31}$/;
const TOKEN = /^[^.*>\s]+$/;

export interface ServeOptions {
  /** nats://[user:password@]host:port, comma-separated for several (JETLOOP_NATS_URL). */
  servers: string;
  /** The NATS user and password when the URL has none (JETLOOP_NATS_USER / _PASSWORD, or the
   * store's `worker` user: env.ts). */
  user?: string;
  pass?: string;
  agent: string;
  pool: string;
  tools: Tool[];
  /** JETLOOP_SEAL_KEY: hex if hex, else its UTF-8 bytes. */
  sealKey: string;
  /** JETLOOP_SEAL_OLD_KEYS: comma-separated keys that still verify. */
  sealOldKeys?: string;
  workerId?: string;
  /** Used when this worker creates the durable; bound to an existing one, its ack_wait wins. */
  leaseSeconds?: number;
  maxLosses?: number;
  blobThreshold?: number;
  drainSeconds?: number;
  /** Calls run at once (pulled one message per free slot). */
  slots?: number;
  namespace?: string;
  maxAckPending?: number;
  sealToleranceSeconds?: number;
  newerWriterSeconds?: number;
  log?: (event: string, fields?: Record<string, unknown>) => void;
}

class DeadLetter extends Error {}

/** nats.js's refusal of a message whose headers and body pass the server's `max_payload`. */
function tooLarge(err: unknown): boolean {
  return /max_payload size exceeded/.test(String((err as Error)?.message ?? ""));
}
class RetryLater extends Error {
  constructor(readonly delay: number, why: string) {
    super(why);
  }
}
class TakenOver extends Error {
  constructor(readonly key: string) {
    super(`taken over at ${key}`);
  }
}

type Takeover = "lost" | "abandoned";

/** ids.py approval_id_for: one approval per call, `a` + BLAKE2b (10 bytes) of `approval\0<call key>\0`. */
export function approvalIdFor(callKey: string): string {
  const digest = blake2b(new TextEncoder().encode(`approval\0${callKey}\0`), { dkLen: 10 });
  return "a" + Buffer.from(digest).toString("hex");
}

function callKeyOf(sid: string, tid: string, n: number, i: number): string {
  return `${sid}.${tid}.${n}.${i}`;
}

function str(v: unknown): v is string {
  return typeof v === "string";
}

function nat(v: unknown): v is number {
  return typeof v === "number" && Number.isInteger(v) && v >= 0;
}

interface Outgoing {
  subject: string;
  body: Uint8Array;
  headers: Record<string, string>;
}

/** A step's kind, its pool and its body, checked (serving-tools.md 2.1-2.3). */
interface Step {
  v: number;
  kind: string;
  agent: string;
  session_id: string;
  turn_id: string;
  model_step: number;
  call_index?: number;
  pool?: string;
}

class Mutex {
  private tail: Promise<void> = Promise.resolve();
  async run<T>(fn: () => Promise<T>): Promise<T> {
    const prev = this.tail;
    let release!: () => void;
    this.tail = new Promise<void>((r) => (release = r));
    await prev;
    try {
      return await fn();
    } finally {
      release();
    }
  }
}

/** One delivery of a step message: its fence (claim, commits), its heartbeat. */
class Delivery {
  fenceKey: string | null = null;
  fenceRev: number | null = null;
  fenceValue: Rec | null = null;
  fencedAt = 0;
  lost = false;
  /** `turn.<sid>.<tid>` while a tool of this delivery runs: each beat reads it (7.1 (3)). */
  watchTurn: string | null = null;
  /** The turn was found cancelled: `ctx.cancelled` is true and `ctx.signal` aborted. */
  cancelled = false;
  readonly cancelling = new AbortController();
  private lock = new Mutex();

  constructor(readonly w: Worker, readonly msg: JsMsg) {}

  /** The first write of the key by this delivery: a CAS from the revision read (null: a create). */
  async claim(key: string, value: Rec, revision: number | null): Promise<number> {
    return this.lock.run(async () => {
      const fresh = !this.w.holding.has(key);
      this.w.holding.add(key);
      try {
        const rev = await this.w.state.write(key, value, revision);
        this.fenceKey = key;
        this.fenceRev = rev;
        this.fenceValue = value;
        this.fencedAt = Date.now();
        return rev;
      } catch (err) {
        if (err instanceof Conflict) {
          if (fresh) this.w.holding.delete(key);
          this.lost = true;
          throw new TakenOver(key);
        }
        if (fresh && key !== this.fenceKey) this.w.holding.delete(key);
        throw err;
      }
    });
  }

  /** A later write of the fenced key: a CAS from the revision this delivery wrote last. */
  async commit(value: Rec): Promise<number> {
    return this.lock.run(async () => {
      const key = this.fenceKey!;
      if (this.lost) throw new TakenOver(key);
      try {
        const rev = await this.w.state.write(key, value, this.fenceRev);
        this.fenceRev = rev;
        this.fenceValue = value;
        this.fencedAt = Date.now();
        return rev;
      } catch (err) {
        if (err instanceof Conflict) {
          this.w.log("fence.lost_on_commit", { key, rev: this.fenceRev });
          this.lose();
          throw new TakenOver(key);
        }
        throw err;
      }
    });
  }

  async stillOurs(freshForMs: number): Promise<boolean> {
    return this.lock.run(async () => {
      if (this.lost) return false;
      if (this.fenceKey === null) return true;
      if (Date.now() - this.fencedAt < freshForMs) return true;
      const current = await this.w.state.revision(this.fenceKey);
      if (current !== this.fenceRev) {
        this.w.log("fence.lost_on_read", { key: this.fenceKey, rev: this.fenceRev, current });
        this.lose();
      }
      return !this.lost;
    });
  }

  /** Rewrite the claimed record (same value, new seal, CAS), then extend the lease. */
  async heartbeat(): Promise<void> {
    await this.lock.run(async () => {
      if (this.lost || this.fenceKey === null || this.fenceValue === null) return;
      if (DONE_STATES.has(String(this.fenceValue.state))) return;
      try {
        this.fenceRev = await this.w.state.write(this.fenceKey, this.fenceValue, this.fenceRev);
        this.fencedAt = Date.now();
      } catch (err) {
        if (err instanceof Conflict) {
          this.w.log("fence.lost_on_beat", { key: this.fenceKey, rev: this.fenceRev });
          this.lose();
          return;
        }
        throw err;
      }
    });
    if (!this.lost) this.msg.working();
    if (this.watchTurn !== null && !this.cancelled) {
      const turn = await this.w.state.get(this.watchTurn);
      if (turn !== null && turn.value.status === "cancelled") {
        this.cancelled = true;
        this.cancelling.abort(new Error(`the turn was cancelled by ${String(turn.value.cancelled_by ?? "someone")}`));
      }
    }
  }

  private lose(): void {
    this.lost = true;
    if (this.fenceKey !== null) this.w.holding.delete(this.fenceKey);
  }

  release(): void {
    if (this.fenceKey !== null) this.w.holding.delete(this.fenceKey);
  }

  /** The message's first delivery (serving-tools.md 2.5): count 1, no rescuer's header, and stored after
   * this process's link opened (on the server's clock, with the measured offset's error). */
  get firstSight(): boolean {
    if (this.msg.info.deliveryCount !== 1 || this.msg.headers?.get("Jl-Holder-Lost")) return false;
    const clock = this.w.clock;
    if (clock === null || this.w.linkOpenedAt === null) return false;
    const storedAt = Number(this.msg.info.timestampNanos) / 1e9; // server clock
    const linkOnServer = this.w.linkOpenedAt + clock.offset; // local → server
    return storedAt > linkOnServer + 0.02 + clock.error;
  }
}

/** What a call step works with once it has read state (calls.py CallEnv). */
interface CallEnv {
  d: Delivery;
  turn: Rec;
  n: number;
  i: number;
  call: Rec;
  ckey: string;
  skey: string;
  rec: Rec;
  rev: number | null;
  tool: Tool | undefined;
  takeover: Takeover;
}

export class Worker {
  readonly workerId: string;
  readonly incarnation = randomBytes(6).toString("hex");
  readonly holding = new Set<string>();
  state!: StateStore;
  clock: { offset: number; error: number } | null = null;
  linkOpenedAt: number | null = null;
  leaseSeconds: number;
  private nc!: NatsConnection;
  private js!: JetStreamClient;
  private jsm!: JetStreamManager;
  private workersKv!: KV;
  private consumer!: Consumer;
  private folded = true;
  private tools = new Map<string, Tool>();
  private running = new Set<Promise<void>>();
  private deliveries = new Set<Delivery>();
  private stopping = false;
  private slotFreed: (() => void) | null = null;
  private timers: NodeJS.Timeout[] = [];
  private since = Date.now() / 1000;
  private pulling: Promise<void> | null = null;
  private alive: Subscription | null = null;
  readonly log: (event: string, fields?: Record<string, unknown>) => void;
  private readonly maxLosses: number;
  private readonly blobThreshold: number;
  private readonly drainSeconds: number;
  private readonly slots: number;
  private readonly namespace: string;
  private readonly sealer: Sealer;
  // Points where a test holds a call (JETLOOP_FAULT_HOLD / _PLAN / _RELEASE, faults.ts).
  private readonly faults = new Faults((event, fields) => this.log(event, fields));
  // Attempts this process claimed whose tool has not been called (serving-tools.md 5.5, runtime.py
  // Unstarted): `<state key>#<attempt>`. Found again, held by no delivery here, such an
  // attempt is continued under its number: no loss, no attempt spent, nothing in doubt.
  private readonly unstarted = new Set<string>();
  // The crash test's ledger of tool invocations (JETLOOP_CRASHTEST_INVOCATIONS).
  private readonly invocations = new Invocations();
  // What this process holds, for a rescuer if it dies (serving-tools.md 7.2, holds.ts).
  private holds!: Holds;
  private readonly newerWriterSeconds: number;
  private readonly sealTolerance: number;
  /** Resolves once the worker stopped (after `stop()`, or a closed connection). */
  closed!: Promise<void>;

  constructor(readonly opts: ServeOptions) {
    if (!POOL_NAME.test(opts.pool) || ["session", "model", "tool"].includes(opts.pool)) {
      throw new Error(`pool ${JSON.stringify(opts.pool)} is not a pool of its own (lowercase, not session/model/tool)`);
    }
    if (!TOKEN.test(opts.agent)) throw new Error(`agent ${JSON.stringify(opts.agent)} is not a subject token`);
    this.workerId = opts.workerId ?? `${hostname()}-${process.pid}`;
    if (!TOKEN.test(this.workerId)) throw new Error(`worker id ${JSON.stringify(this.workerId)} is not a subject token`);
    for (const t of opts.tools) {
      if (this.tools.has(t.name)) throw new Error(`tool ${t.name} is given twice`);
      this.tools.set(t.name, t);
    }
    if (!opts.sealKey) throw new Error("a seal key is needed (JETLOOP_SEAL_KEY)");
    const keys = [keyBytes(opts.sealKey), ...(opts.sealOldKeys ?? "").split(",").filter((k) => k.trim()).map(keyBytes)];
    this.sealTolerance = opts.sealToleranceSeconds ?? 30;
    this.sealer = new Sealer(keys, this.sealTolerance);
    this.leaseSeconds = opts.leaseSeconds ?? 5;
    this.maxLosses = opts.maxLosses ?? 2;
    this.blobThreshold = opts.blobThreshold ?? 64 * 1024;
    this.drainSeconds = opts.drainSeconds ?? 10;
    this.slots = opts.slots ?? 16;
    this.namespace = opts.namespace ?? "default";
    this.newerWriterSeconds = opts.newerWriterSeconds ?? 3600;
    this.log =
      opts.log ??
      ((event, fields = {}) => {
        process.stdout.write(
          JSON.stringify({ event, worker: this.workerId, timestamp: new Date().toISOString(), ...fields }) + "\n",
        );
      });
  }

  async start(): Promise<void> {
    const urls = this.opts.servers
      .split(",")
      .map((u) => u.trim())
      .filter((u) => u !== "")
      .map((u) => new URL(u.includes("://") ? u : `nats://${u}`));
    if (urls.length === 0) throw new Error("no NATS server given (JETLOOP_NATS_URL)");
    const url = urls[0]!;
    this.nc = await connect({
      servers: urls.map((u) => `${u.hostname}:${u.port || 4222}`),
      user: url.username ? decodeURIComponent(url.username) : this.opts.user,
      pass: url.password ? decodeURIComponent(url.password) : this.opts.pass,
      name: `jetloop-worker-${this.workerId}#${this.incarnation}`,
      maxReconnectAttempts: -1,
      reconnectTimeWait: 250,
    });
    this.linkOpenedAt = Date.now() / 1000;
    void (async () => {
      for await (const s of this.nc.status()) {
        if (s.type === "reconnect") {
          this.linkOpenedAt = Date.now() / 1000;
          this.clock = null; // measured again before a delivery is called first
          void this.measureClock().catch(() => {});
        }
        if (s.type === "disconnect") this.linkOpenedAt = null;
      }
    })();
    this.closed = this.nc.closed().then(() => undefined);
    this.js = jetstream(this.nc);
    this.jsm = await jetstreamManager(this.nc);
    this.state = new StateStore(this.nc, this.js, this.jsm, this.sealer, this.leaseSeconds);
    this.holds = new Holds(this.nc, this.js, this.incarnation, this.workerId);
    // Liveness (serving-tools.md 1.2): subscribed before the first claim, never unsubscribed.
    this.alive = this.nc.subscribe(`jl.alive.${this.incarnation}`, {
      callback: (_err, m) => this.answerAlive(m),
    });
    await this.nc.flush();
    await this.bindConsumer();
    await this.readLayout();
    const kvm = new Kvm(this.nc);
    const agents = await kvm.open("jl_agents");
    try {
      await agents.create(
        `agent.${this.opts.agent}`,
        JSON.stringify({ declared_by: `worker ${this.workerId}`, at: Date.now() / 1000 }),
      );
    } catch {
      // declared before
    }
    this.workersKv = await kvm.open("jl_workers");
    await this.advertise();
    this.timers.push(
      setInterval(() => {
        if (this.stopping) return;
        void this.advertise().catch((e) => this.log("worker.presence_failed", { error: String(e) }));
        void this.readLayout().catch(() => {});
      }, 5000),
    );
    this.log("worker.started", {
      agent: this.opts.agent,
      pool: this.opts.pool,
      tools: [...this.tools.keys()],
      incarnation: this.incarnation,
      lease: this.leaseSeconds,
      layout: this.folded ? "folded" : "separate",
    });
    this.pulling = this.pull();
  }

  private answerAlive(m: Msg): void {
    try {
      if (m.data.length === 0) {
        m.respond(this.workerId);
        return;
      }
      const key = new TextDecoder().decode(m.data);
      m.respond(this.holding.has(key) ? "holding" : "done");
    } catch {
      // the asker is gone
    }
  }

  /** Create-or-bind `jl_<pool>_<agent>` with exactly the Python config (topology.consumer_configs). */
  private async bindConsumer(): Promise<void> {
    const name = `jl_${this.opts.pool}_${this.opts.agent}`;
    let info;
    try {
      info = await this.jsm.consumers.info(STEPS_STREAM, name);
    } catch {
      info = await this.jsm.consumers.add(STEPS_STREAM, {
        durable_name: name,
        name,
        description: `jetloop ${this.opts.pool} steps of agent ${this.opts.agent}`,
        filter_subject: `jl.step.${this.opts.pool}.${this.opts.agent}.>`,
        ack_policy: AckPolicy.Explicit,
        ack_wait: Math.round(this.leaseSeconds * 1e9),
        max_deliver: -1,
        max_ack_pending: this.opts.maxAckPending ?? 1000,
        deliver_policy: DeliverPolicy.All,
      });
    }
    // The lease is the durable's (a different one would change every worker's).
    this.leaseSeconds = (info.config.ack_wait ?? this.leaseSeconds * 1e9) / 1e9;
    this.state.writeTimeoutMs = Math.max(500, (this.leaseSeconds * 1000) / 4);
    this.consumer = await this.js.consumers.get(STEPS_STREAM, name);
  }

  private async readLayout(): Promise<void> {
    const info = await this.jsm.streams.info(EVENTS_STREAM);
    this.folded = info.config.metadata?.jetloop_log === "folded";
  }

  /** This clock against the server's (design.md, "Clocks"): the server's stored time of the
   * presence this worker puts, against the local times around the put. */
  private async measureClock(): Promise<void> {
    await this.advertise();
  }

  private clockOff(): boolean {
    return this.clock !== null && Math.abs(this.clock.offset) > this.sealTolerance / 2;
  }

  private async advertise(): Promise<void> {
    if (this.stopping || this.workersKv === undefined) return;
    const body = {
      agents: [this.opts.agent],
      pools: [this.opts.pool],
      since: this.since,
      release: `node-worker ${VERSION}`,
      reads: SCHEMA_VERSION,
      kinds: [...KINDS],
    };
    const before = Date.now() / 1000;
    if (this.holds.size > 0) this.holds.publish(); // kept fresh while anything is held
    const rev = await this.workersKv.put(`worker.${this.workerId}`, JSON.stringify(body));
    const after = Date.now() / 1000;
    const m = await this.jsm.streams.getMessage("KV_jl_workers", { seq: rev });
    if (m === null) return;
    const [head, frac = "0"] = m.timestamp.replace(/Z$/, "").split(".");
    const server = Date.parse(`${head}Z`) / 1000 + Number(`0.${frac}`);
    const offset = server - (before + after) / 2;
    this.clock = { offset, error: (after - before) / 2 + 0.002 };
    if (Math.abs(offset) > this.sealTolerance / 2) this.log("clock.off", { offset });
  }

  private async pull(): Promise<void> {
    while (!this.stopping) {
      if (this.running.size >= this.slots) {
        await new Promise<void>((r) => (this.slotFreed = r));
        continue;
      }
      let m: JsMsg | null;
      try {
        m = await this.consumer.next({ expires: 1000 });
      } catch (err) {
        if (this.stopping) break;
        this.log("worker.pull_failed", { error: String(err) });
        await sleep(500);
        continue;
      }
      if (m === null) continue;
      if (this.stopping) {
        m.nak();
        break;
      }
      this.holds.add(m);
      const job = this.deliver(m).finally(() => {
        this.running.delete(job);
        this.slotFreed?.();
        this.slotFreed = null;
      });
      this.running.add(job);
    }
  }

  /** Stop pulling; let running calls finish for the drain time; nak the rest; delete presence. */
  async stop(): Promise<void> {
    if (this.stopping) return;
    this.stopping = true;
    this.log("worker.stopping", { running: this.running.size });
    for (const t of this.timers) clearInterval(t);
    this.slotFreed?.();
    await this.workersKv?.delete(`worker.${this.workerId}`).catch(() => {});
    const drained = Promise.all([...this.running]);
    const timedOut = await Promise.race([
      drained.then(() => false),
      sleep(this.drainSeconds * 1000).then(() => true),
    ]);
    if (timedOut) {
      // Said before they are cancelled: the worker that takes them over counts no loss.
      this.holds.drained = true;
      await this.holds.publishConfirmed(2000).catch((e) => this.log("worker.drained_list_failed", { error: String(e) }));
      for (const d of this.deliveries) {
        if (!d.lost) d.msg.nak();
        d.lost = true; // nothing more is sent on it
      }
      this.log("worker.drain_ran_out", { left: this.deliveries.size });
    }
    await this.pulling?.catch(() => {});
    this.holds.stop();
    await this.nc.drain().catch(() => {});
    this.log("worker.stopped", {});
  }

  // --- One delivery ------------------------------------------------------------------------

  private async deliver(m: JsMsg): Promise<void> {
    const d = new Delivery(this, m);
    this.deliveries.add(d);
    const beat = setInterval(() => {
      void d.heartbeat().catch((e) => this.log("step.heartbeat_failed", { error: String(e) }));
    }, (this.leaseSeconds * 1000) / 3);
    let step: Step | null = null;
    try {
      step = this.parse(m);
      if (step === null) return;
      if (this.clockOff()) throw new RetryLater(2, "this worker's clock is off the server's: not sealing");
      await this.onCall(d, step);
      if (!d.lost) {
        m.ack();
        this.log("step.acked", { kind: step.kind, key: m.headers?.get("Nats-Msg-Id") });
      }
    } catch (err) {
      await this.fate(d, step, err);
    } finally {
      clearInterval(beat);
      d.release();
      this.deliveries.delete(d);
      if (!(d.lost && this.stopping)) this.holds.drop(m); // a drained step stays listed
    }
  }

  private async fate(d: Delivery, step: Step | null, err: unknown): Promise<void> {
    const m = d.msg;
    if (err instanceof TakenOver || d.lost) {
      this.log("step.taken_over", { key: (err as TakenOver).key });
      return; // JetStream does not fence late acks: send nothing
    }
    if (err instanceof RetryLater) {
      this.log("step.retry_later", { delay: err.delay, why: err.message });
      m.nak(Math.round(err.delay * 1000));
      return;
    }
    if (err instanceof DeadLetter) {
      await this.deadLetter(m, err.message);
      return;
    }
    if (err instanceof SealBroken && step !== null) {
      try {
        await this.rejectUntrusted(step, err);
        m.ack();
      } catch (e) {
        m.nak(200);
        this.log("step.reject_failed", { error: String(e) });
      }
      return;
    }
    const n = m.info.deliveryCount;
    const transient = isTransient(err);
    this.log("step.failed", { error: String((err as Error)?.stack ?? err), transient, delivery: n });
    const storedFor = Date.now() / 1000 - Number(m.info.timestampNanos) / 1e9;
    // 8.4: a publish past the server's max_payload (nats.js refuses it before sending, headers
    // counted) fails the same way at every delivery: dead-lettered at once, not made again.
    if (tooLarge(err) || (transient && storedFor > 900) || (!transient && n >= 5)) {
      const reason = `${(err as Error)?.name ?? "Error"}: ${(err as Error)?.message ?? String(err)}`;
      if (await this.deadLetter(m, reason)) {
        if (step !== null) await this.failItsTurn(step, m, reason).catch(() => {});
      }
      return;
    }
    const delay = Math.min(2, 0.2 * 2 ** (n - 1)) * (1 + Math.random() * 0.25);
    m.nak(Math.round(delay * 1000));
  }

  /** Draft 2.3/2.4: decode and check the message; null when it was handed back or dead-lettered. */
  private parse(m: JsMsg): Step | null {
    let body: unknown;
    try {
      body = decode(m.data);
    } catch (exc) {
      const start = Buffer.from(m.data.subarray(0, 16)).toString("latin1");
      void this.deadLetter(m, `body is not msgpack: ${String(exc)} (it starts ${JSON.stringify(start)})`);
      return null;
    }
    const b = body as Rec;
    if (body === null || typeof body !== "object" || Array.isArray(body)) {
      void this.deadLetter(m, "StepMessage invalid: the body is not a map");
      return null;
    }
    const storedFor = Date.now() / 1000 - Number(m.info.timestampNanos) / 1e9;
    const kind = b.kind;
    const v = b.v ?? 1;
    if (!nat(v) || !str(kind)) {
      void this.deadLetter(m, "StepMessage invalid at v or kind");
      return null;
    }
    if (v > SCHEMA_VERSION || !(KINDS as readonly string[]).includes(kind)) {
      if (storedFor > this.newerWriterSeconds) {
        void this.deadLetter(m, `step of kind ${kind} (v ${v}) is not run by this worker`);
      } else {
        this.log("step.handed_back", { kind, v });
        m.nak(2000);
      }
      return null;
    }
    for (const f of ["agent", "session_id", "turn_id"] as const) {
      if (!str(b[f]) || !TOKEN.test(b[f] as string)) {
        void this.deadLetter(m, `StepMessage invalid at ${f}`);
        return null;
      }
    }
    const n = b.model_step ?? 0;
    if (!nat(n)) {
      void this.deadLetter(m, "StepMessage invalid at model_step");
      return null;
    }
    if (b.call_index !== undefined && b.call_index !== null && !nat(b.call_index)) {
      void this.deadLetter(m, "StepMessage invalid at call_index");
      return null;
    }
    if (b.pool !== undefined && b.pool !== null && (!str(b.pool) || !POOL_NAME.test(b.pool))) {
      void this.deadLetter(m, "StepMessage invalid at pool");
      return null;
    }
    const step: Step = {
      v,
      kind,
      agent: b.agent as string,
      session_id: b.session_id as string,
      turn_id: b.turn_id as string,
      model_step: n,
      call_index: (b.call_index as number | null | undefined) ?? undefined,
      pool: (b.pool as string | null | undefined) ?? undefined,
    };
    const expected = `jl.step.${step.pool ?? "tool"}.${step.agent}.${kind}.${step.session_id}`;
    if (m.subject !== expected) {
      void this.deadLetter(
        m,
        `step subject ${JSON.stringify(m.subject)} does not match its body (${kind} of session ${step.session_id}, agent ${step.agent}, is sent on ${JSON.stringify(expected)})`,
      );
      return null;
    }
    if (step.call_index === undefined) {
      void this.deadLetter(m, `${kind} step without call_index`);
      return null;
    }
    if (step.agent !== this.opts.agent) {
      m.nak(5000);
      return null;
    }
    return step;
  }

  private async deadLetter(m: JsMsg, reason: string): Promise<boolean> {
    this.log("step.dead_letter", { reason });
    const h = natsHeaders();
    if (m.headers) {
      for (const [k, vs] of m.headers) for (const v of vs) h.append(k, v);
    }
    const original = m.headers?.get("Nats-Msg-Id");
    if (original) h.set("Jl-Dead-Msg-Id", original);
    const stream = m.info.stream;
    const seq = m.info.streamSequence;
    h.set("Nats-Msg-Id", `dead.${stream}.${seq}`);
    h.set("Jl-Dead-Reason", reason.slice(0, 1000));
    h.set("Jl-Dead-Stream", stream);
    h.set("Jl-Dead-Sequence", String(seq));
    h.set("Jl-Dead-Subject", m.subject);
    let body = m.data;
    let size = body.length;
    for (const [k, vs] of h) for (const v of vs) size += k.length + v.length + 4;
    if (size + 64 > this.nc.info!.max_payload) {
      h.set("Jl-Dead-Body-Dropped", String(body.length));
      body = new Uint8Array();
    }
    try {
      await this.js.publish(`jl.dead.${m.subject}`, body, { headers: h });
    } catch (err) {
      this.log("step.dead_letter_failed", { error: String(err) });
      m.nak(Math.round(Math.min(2, 0.2 * 2 ** (m.info.deliveryCount - 1)) * 1000));
      return false;
    }
    m.term(reason.slice(0, 200));
    return true;
  }

  // --- Publishing ------------------------------------------------------------------------

  private hdrs(kind: string, sid: string, tid: string | null, key: string, agent?: string): Record<string, string> {
    const h: Record<string, string> = {
      "Nats-Msg-Id": key,
      "Jl-Kind": kind,
      "Jl-Session": sid,
      "Jl-Step": key,
      "Jl-Schema": String(SCHEMA_VERSION),
    };
    if (tid) h["Jl-Turn"] = tid;
    if (agent) h["Jl-Agent"] = agent;
    return h;
  }

  /** Publish in order, each confirmed (PubAck); tried again for up to 10 s (ids dedupe). */
  private async publish(out: Outgoing[]): Promise<void> {
    for (const o of out) {
      const deadline = Date.now() + 10_000;
      for (;;) {
        const h = natsHeaders();
        for (const [k, v] of Object.entries(o.headers)) h.set(k, v);
        try {
          await this.js.publish(o.subject, o.body, { headers: h, timeout: 5000 });
          break;
        } catch (err) {
          if (!isTransient(err) || Date.now() > deadline) throw err;
          await sleep(200);
        }
      }
    }
  }

  private event(type: string, key: string, sid: string, tid: string, data: Rec): Rec {
    return { v: SCHEMA_VERSION, key, type, session_id: sid, turn_id: tid, at: Date.now() / 1000, data: clean(data) };
  }

  private eventOut(ev: Rec): Outgoing {
    const sid = ev.session_id as string;
    return {
      subject: `jl.event.${sid}.${ev.type as string}`,
      body: encode(ev),
      headers: this.hdrs(ev.type as string, sid, ev.turn_id as string, ev.key as string),
    };
  }

  private stepOut(step: Rec, key: string, pool: string): Outgoing {
    const sid = step.session_id as string;
    return {
      subject: `jl.step.${pool}.${step.agent as string}.${step.kind as string}.${sid}`,
      body: encode(step),
      headers: this.hdrs(step.kind as string, sid, step.turn_id as string, key, step.agent as string),
    };
  }

  /** Draft 6.1: the outcome to the log (folded: the call's result entry carrying the event). */
  private callDone(turn: Rec, rec: Rec): Outgoing[] {
    const outcome = (rec.outcome ?? {}) as Rec;
    const sid = turn.session_id as string;
    const tid = turn.turn_id as string;
    const key = rec.key as string;
    const ev = this.event("call.outcome", `call.${key}.outcome`, sid, tid, {
      call_key: key,
      tool: rec.tool,
      effect: rec.effect,
      state: rec.state,
      attempts: rec.attempts ?? 0,
      error: outcome.error,
      settlement: rec.settlement,
    });
    if (!this.folded) return [this.eventOut(ev)];
    const [, , n, i] = key.split(".");
    const status = rec.state === "succeeded" ? "ok" : rec.state === "failed" ? "error" : (rec.state as string);
    const entry = clean({
      v: SCHEMA_VERSION,
      key: `${sid}.${tid}.m${n}.c${i}.result`,
      role: "tool",
      turn_id: tid,
      call_id: `${tid}-${n}-${i}`,
      tool: rec.tool,
      status,
      result: outcome.result,
      result_ref: outcome.result_ref,
      text: outcome.error,
      events: [ev],
    });
    const h = this.hdrs("history.tool", sid, tid, entry.key as string);
    h["Jl-Events"] = "call.outcome";
    return [{ subject: `jl.event.${sid}.history.tool`, body: encode(entry), headers: h }];
  }

  /** The join, left to the session pool (jetloop/consumers/join.py on_join): a `join` step. */
  private joinStep(turn: Rec, n: number, i: number): Outgoing {
    const sid = turn.session_id as string;
    const tid = turn.turn_id as string;
    const step = {
      v: SCHEMA_VERSION,
      kind: "join",
      agent: turn.agent,
      session_id: sid,
      turn_id: tid,
      model_step: n,
      call_index: i,
    };
    return this.stepOut(step, `${sid}.${tid}.m${n}.c${i}.join`, "session");
  }

  /** Tell the outcome, then hand the join to the session pool (serving-tools.md 6). */
  private async toldAndJoined(turn: Rec, rec: Rec, n: number, i: number, join = true): Promise<void> {
    await this.publish(this.callDone(turn, rec));
    if (join) await this.publish([this.joinStep(turn, n, i)]);
  }

  // --- A call step (call_tool.py on_call) ---------------------------------------------------

  private async onCall(d: Delivery, step: Step): Promise<void> {
    const sid = step.session_id;
    const tid = step.turn_id;
    const n = step.model_step;
    const i = step.call_index!;
    const ckey = callKeyOf(sid, tid, n, i);
    const skey = `call.${ckey}`;
    const [turnV, recV, sessionV] = await Promise.all([
      this.state.get(`turn.${sid}.${tid}`),
      this.state.get(skey),
      this.state.get(`session.${sid}`),
    ]);
    if (turnV === null) throw new DeadLetter(`${step.kind} for turn ${tid} of session ${sid}, which has no record`);
    const turn = turnV.value;
    const current = turn.model_step === n && turn.phase === "calls" && !TERMINAL.has(String(turn.status));
    if (recV !== null && DONE_STATES.has(String(recV.value.state))) {
      // Committed; its worker may have died before what follows went out: again, same ids.
      await this.toldAndJoined(turn, recV.value, n, i, current || turn.model_step === n + 1);
      return;
    }
    if (!current) {
      this.log("call.stale_step", { turn_step: turn.model_step, status: turn.status });
      return;
    }
    const held = recV !== null ? (recV.value.attempt as Rec | undefined) : undefined;
    let takeover: Takeover = "lost";
    if (held && recV !== null && LOSABLE.has(String(recV.value.state))) {
      takeover = await this.holderLost(d, skey, held, recV.storedAt);
    }
    const calls = (turn.calls ?? []) as Rec[];
    if (i >= calls.length) throw new DeadLetter(`call index ${i} is out of range for step ${n} of turn ${tid}`);
    const call = calls[i]!;
    if ((call.pool ?? undefined) !== this.opts.pool) {
      throw new DeadLetter(`call ${ckey} is planned for pool ${String(call.pool ?? "tool")}, not ${this.opts.pool}`);
    }
    const rec: Rec = recV ? { ...recV.value } : { v: 1, key: ckey, tool: call.tool, effect: call.effect, state: "running", attempts: 0, marked: 0 };
    const tool = this.tools.get(String(call.tool));
    const env: CallEnv = { d, turn, n, i, call, ckey, skey, rec, rev: recV ? recV.revision : null, tool, takeover };

    if (tool === undefined || call.invalid) {
      const why =
        (call.invalid as string | undefined) ??
        `the agent no longer offers the tool ${JSON.stringify(call.tool)} (removed or renamed since the call was asked for)`;
      await this.settle(env, this.withoutTool(rec, why), "gate");
      return;
    }
    if (!["in_doubt", "running", "awaiting_approval"].includes(String(rec.state))) {
      // awaiting_approval, awaiting_answer, waiting_timer, task_running, awaiting_child:
      // begun by a worker that runs waits; this one does not.
      throw new RetryLater(5, `call ${ckey} is ${String(rec.state)}, a wait this worker does not run`);
    }
    const problem = tool.check?.(structuredClone(call.args ?? {}));
    if (problem) {
      await this.settle(env, this.withoutTool(rec, `its arguments no longer fit the tool ${JSON.stringify(call.tool)} (${problem})`), "gate");
      return;
    }
    const passed = await this.gate(env, (sessionV?.value.approval_overrides ?? {}) as Rec);
    if (passed === null) return; // held for a decision, or denied
    await this.run(passed);
  }

  /** approvals.py gate (serving-tools.md 8.1): the call held for a person's decision, once per call
   * (its approval record is created only if absent), or passed on once approved. null: held
   * (state `awaiting_approval`, `approval.requested` told) or denied (settled). */
  private async gate(env: CallEnv, overrides: Rec): Promise<CallEnv | null> {
    const tool = env.tool!;
    const override = overrides[tool.name];
    const required =
      env.rec.approval_id !== undefined && env.rec.approval_id !== null
        ? true
        : typeof override === "boolean"
          ? override
          : needsApproval(tool, structuredClone(env.call.args ?? {}));
    if (!required) return env;
    const sid = String(env.turn.session_id);
    const tid = String(env.turn.turn_id);
    const aid = approvalIdFor(env.ckey);
    const akey = `approval.${sid}.${aid}`;
    let approval = (await this.state.get(akey))?.value ?? null;
    if (approval === null) {
      const record: Rec = {
        v: SCHEMA_VERSION,
        approval_id: aid,
        session_id: sid,
        turn_id: tid,
        model_step: env.n,
        call_index: env.i,
        call_key: env.ckey,
        tool: env.call.tool,
        args: env.call.args ?? {},
        status: "pending",
        requested_at: Date.now() / 1000,
        pool: this.opts.pool,
      };
      try {
        await this.state.write(akey, record, null);
        approval = record;
      } catch (err) {
        if (!(err instanceof Conflict)) throw err;
        approval = (await this.state.get(akey))?.value ?? null;
        if (approval === null) throw new RetryLater(0.2, `approval ${aid} was created and is gone`);
      }
    }
    if (approval.status === "pending") {
      if (env.rec.state !== "awaiting_approval") {
        const waiting: Rec = { ...env.rec, state: "awaiting_approval", approval_id: aid };
        env = await this.write(env, waiting);
      }
      await this.publish([
        this.eventOut(
          this.event("approval.requested", `call.${env.ckey}.approval.requested`, sid, tid, {
            approval_id: aid,
            call_key: env.ckey,
            tool: env.call.tool,
            args: env.call.args ?? {},
          }),
        ),
      ]);
      this.log("call.awaiting_approval", { approval_id: aid, call: env.ckey });
      return null;
    }
    if (approval.status === "rejected") {
      let why = `denied by ${String(approval.decided_by ?? "a person")}`;
      if (approval.reason) why += `: ${String(approval.reason)}`;
      await this.settle({ ...env, rec: { ...env.rec, approval_id: aid } }, { state: "denied", error: why }, "denied");
      return null;
    }
    if (!env.rec.approval_id) return { ...env, rec: { ...env.rec, approval_id: aid } };
    return env;
  }

  /** calls.py / call_tool.py without_tool. */
  private withoutTool(rec: Rec, why: string): Rec {
    if (rec.state === "in_doubt" && rec.attempt) {
      return { state: "outcome_unknown", error: `${NOT_SENT_AGAIN}; ${why}` };
    }
    return { state: "failed", error: `${NOT_RUN}: ${why}` };
  }

  /** A fenced write of the call record: the first is a claim, later ones commits. */
  private async write(env: CallEnv, rec: Rec): Promise<CallEnv> {
    const rev = env.d.fenceKey === env.skey ? await env.d.commit(rec) : await env.d.claim(env.skey, rec, env.rev);
    return { ...env, rec, rev };
  }

  /** Record an outcome without running (or after a read-back), tell, join. */
  private async settle(env: CallEnv, outcome: Rec, settlement: string): Promise<void> {
    const done = { ...env.rec, state: outcome.state, outcome: clean(outcome), settlement };
    delete (done as Rec).attempt;
    await this.write(env, done);
    this.log("call.recorded", { state: outcome.state, settlement, call: env.ckey });
    await this.toldAndJoined(env.turn, done, env.n, env.i);
  }

  /** liveness.py holder_lost (serving-tools.md 5.1). */
  private async holderLost(d: Delivery, key: string, held: Rec, storedAt: number): Promise<Takeover> {
    const lease = this.leaseSeconds;
    const no = held.no;
    if (held.incarnation === this.incarnation) {
      if (this.holding.has(key)) throw new RetryLater(lease / 2, `this worker still runs attempt ${no}`);
      this.log("step.holder_abandoned", { key, own: true });
      return "abandoned";
    }
    const linked = this.linkOpenedAt === null ? 0 : Date.now() / 1000 - this.linkOpenedAt;
    const now = Date.now() / 1000 + (this.clock?.offset ?? 0); // on the server's clock
    const silence = Math.min(now - storedAt, linked);
    if (silence > lease) {
      let said: boolean | null = null;
      if (silence < lease + BEAT_GRACE) {
        said = await this.stillHolds(String(held.incarnation), key);
        if (said) throw new RetryLater(lease / 3, `attempt ${no} of worker ${held.worker} still runs (its beats are late)`);
      }
      this.log("step.holder_stale", { holder: held.worker, incarnation: held.incarnation, key, silence, said });
      return said === false ? "abandoned" : "lost";
    }
    if (d.msg.headers?.get("Jl-Holder-Lost") === held.incarnation) {
      if (linked < RECONNECT_GRACE) {
        throw new RetryLater(RECONNECT_GRACE - linked + 0.05, `worker ${held.worker} may still be connecting again`);
      }
      if (await this.gone(String(held.incarnation))) {
        this.log("step.holder_gone", { holder: held.worker, incarnation: held.incarnation });
        return "lost";
      }
    }
    throw new RetryLater(Math.max(0.05, lease - silence + 0.05), `attempt ${no} of worker ${held.worker} is alive (silent ${silence.toFixed(1)}s)`);
  }

  private async stillHolds(incarnation: string, key: string): Promise<boolean | null> {
    try {
      const reply = await this.nc.request(`jl.alive.${incarnation}`, key, { timeout: 500 });
      return new TextDecoder().decode(reply.data) === "holding";
    } catch {
      return null;
    }
  }

  private async gone(incarnation: string): Promise<boolean> {
    try {
      await this.nc.request(`jl.alive.${incarnation}`, "", { timeout: 200 });
      return false;
    } catch {
      return true;
    }
  }

  /** call_tool.py run: make the call at most as often as its effect class allows. */
  private async run(env0: CallEnv): Promise<void> {
    let env = env0;
    const tool = env.tool!;
    const effect = String(env.call.effect) as Effect;
    const isWrite = effect !== Effect.READ;
    let rec = env.rec;
    const stepKey = `${env.turn.session_id}.${env.turn.turn_id}.m${env.n}.c${env.i}`;
    const own = rec.attempt as Rec | undefined;
    const again =
      own !== undefined &&
      LOSABLE.has(String(rec.state)) &&
      env.takeover === "abandoned" &&
      own.incarnation === this.incarnation &&
      this.unstarted.delete(`${env.skey}#${String(own.no)}`);
    if (again) {
      this.log("call.attempt_continued", { attempt: rec.attempts, call: env.ckey });
    } else if (rec.attempt && LOSABLE.has(String(rec.state))) {
      const lost = rec.attempt as Rec;
      const resume = await this.recordLoss(env.turn, stepKey, lost, env.takeover);
      if (resume === null) return; // one loss too many: the turn failed, close_turn settles this call
      const how = await this.resumeSettlement(env, effect);
      await this.publish([
        this.eventOut(
          this.event("agent.run.crash_resumed", `${stepKey}.resumed.${String(lost.no)}`, String(env.turn.session_id), String(env.turn.turn_id), {
            step: stepKey,
            losses: resume.losses,
            drained: resume.drained,
            abandoned: resume.abandoned,
            lost_attempt: lost.no,
            lost_worker: lost.worker,
            lost_incarnation: lost.incarnation ?? "",
            settled: { [env.ckey]: how },
          }),
        ),
      ]);
      if (how !== "made again") return;
    }
    let unclaimed = effect === Effect.READ && env.rev === null;
    if (unclaimed && !env.d.firstSight) {
      // Delivered before with nothing in state: that delivery may have made the read
      // unclaimed and died. Counted as an attempt; this one claims. (A pool of its own never
      // keeps reads together, so no `reads.` fence is written: serving-tools.md 1.7.)
      unclaimed = false;
      rec = { ...rec, attempts: Math.max(Number(rec.attempts ?? 0), 1) };
      env = { ...env, rec };
      this.log("call.read_delivered_again", { delivery: env.d.msg.info.deliveryCount });
    }
    const used = Number(rec.attempts ?? 0) - (again ? 1 : 0);
    const firstAt = rec.first_attempt_at as number | undefined;
    if (used >= tool.maxAttempts || (firstAt !== undefined && Date.now() / 1000 - firstAt > tool.attemptWindowSeconds)) {
      await this.settle(env, this.exhausted(rec, isWrite), "attempts_exhausted");
      return;
    }
    const session = String(env.turn.session_id);
    // The step's kind as the plan sent it (followers.py answer), for the crash test's labels.
    const kind = effect === Effect.NON_IDEMPOTENT_WRITE ? "call_single_attempt_tool" : "call_tool";
    await this.faults.point("call_tool.before_mark", session, { call: env.ckey, kind });
    const attempt = { no: used + 1, worker: this.workerId, started_at: Date.now() / 1000, incarnation: this.incarnation };
    const marked: Rec = {
      ...rec,
      state: isWrite ? "in_doubt" : "running",
      attempt,
      attempts: attempt.no,
      marked: Number(rec.marked ?? 0) + (isWrite && !again ? 1 : 0),
      first_attempt_at: firstAt ?? attempt.started_at,
    };
    if (unclaimed) {
      env = { ...env, rec: marked, rev: null };
    } else {
      if (this.unstarted.size >= 4096) this.unstarted.clear(); // forgotten: counted, the safe side
      this.unstarted.add(`${env.skey}#${attempt.no}`);
      env = await this.write(env, marked); // the claim: for a write, its in-doubt mark
    }
    await this.faults.point("call_tool.in_tool", session, { call: env.ckey, kind, attempt: attempt.no });
    if (!(await env.d.stillOurs((this.leaseSeconds * 1000) / 4))) throw new TakenOver(env.skey);
    this.unstarted.delete(`${env.skey}#${attempt.no}`); // begun: from here it may have run
    const d = env.d;
    d.watchTurn = `turn.${String(env.turn.session_id)}.${String(env.turn.turn_id)}`;
    const ctx = this.toolContext(env, attempt.no);
    this.log("tool.call", { tool: tool.name, call: env.ckey, attempt: attempt.no, effect });
    let outcome: Rec;
    const row = this.invocations.started({
      tool: tool.name,
      effect,
      session_id: session,
      turn_id: String(env.turn.turn_id),
      call_id: String(env.call.call_id),
      idempotency_key: String(env.call.idempotency_key),
      attempt: attempt.no,
    });
    try {
      let result: unknown;
      try {
        if (row !== null) await this.faults.point("tool.running", session, { call: env.ckey, kind });
        result = await tool.run(structuredClone(env.call.args ?? {}), ctx);
      } catch (exc) {
        const said = exc instanceof RetryableToolError && exc.notSent ? "not sent" : "error";
        this.invocations.ended(row, `${said}: ${String((exc as Error)?.message ?? exc)}`);
        throw exc;
      }
      this.invocations.ended(row, "ok");
      outcome = await this.succeeded(env.ckey, attempt.no, result);
    } catch (exc) {
      if (d.lost) throw new TakenOver(env.skey);
      const e = exc as Error;
      if (exc instanceof ToolError) {
        outcome = { state: "failed", error: e.message };
      } else {
        const retryable = exc instanceof RetryableToolError || effect !== Effect.NON_IDEMPOTENT_WRITE;
        if (retryable && attempt.no < tool.maxAttempts) {
          this.log("tool.failed", { error: String(e?.message ?? exc), will_retry: true });
          const again = { ...marked };
          delete again.attempt;
          await this.write(env, again);
          throw new RetryLater(Math.min(30, 0.5 * 2 ** (attempt.no - 1)), String(e?.message ?? exc));
        }
        this.log("tool.failed", { error: String(e?.message ?? exc), will_retry: false });
        let error = `${e?.name ?? "Error"}: ${e?.message ?? String(exc)}`;
        if (retryable) error = `every attempt (${attempt.no}) failed; the last with ${error}`;
        outcome = { state: isWrite ? "outcome_unknown" : "failed", error };
      }
    }
    await this.faults.point("call_tool.before_commit", session, { call: env.ckey, kind, attempt: attempt.no });
    const done: Rec = { ...env.rec, state: outcome.state, outcome: clean(outcome) };
    delete done.attempt;
    env = await this.write(env, done);
    this.log("call.recorded", { state: outcome.state, attempts: attempt.no, call: env.ckey });
    await this.faults.point("call_tool.after_commit", session, { call: env.ckey, kind });
    await this.toldAndJoined(env.turn, done, env.n, env.i);
  }

  private async succeeded(ckey: string, attempt: number, result: unknown): Promise<Rec> {
    const value = result === undefined ? null : JSON.parse(JSON.stringify(result) ?? "null");
    const raw = Buffer.from(JSON.stringify(value));
    if (raw.length > this.blobThreshold) {
      const name = `call.${ckey}.a${attempt}`;
      const os = await new Objm(this.nc).open("jl_blobs");
      await os.putBlob({ name }, raw);
      return { state: "succeeded", result_ref: { blob: name, size: raw.length } };
    }
    return { state: "succeeded", result: value };
  }

  private exhausted(rec: Rec, isWrite: boolean): Rec {
    const k = Number(rec.attempts ?? 0);
    if (k === 0) return { state: "failed", error: `${NOT_RUN}: no attempt reached the tool` };
    if (isWrite) return { state: "outcome_unknown", error: `every attempt (${k}) failed or was lost; the write may have applied` };
    return { state: "failed", error: `every attempt (${k}) failed` };
  }

  /** The context a tool's `run` (or `readBack`) is given for attempt `no` of the call. */
  private toolContext(env: CallEnv, no: number): ToolContext {
    const d = env.d;
    return {
      namespace: this.namespace,
      session_id: String(env.turn.session_id),
      turn_id: String(env.turn.turn_id),
      model_step: env.n,
      call_id: String(env.call.call_id),
      idempotency_key: String(env.call.idempotency_key),
      attempt: no,
      heartbeat: () => d.heartbeat(),
      get cancelled() {
        return d.cancelled;
      },
      signal: d.cancelling.signal,
    };
  }

  /** call_tool.py _resume_settlement (serving-tools.md 5.3). */
  private async resumeSettlement(env: CallEnv, effect: Effect): Promise<string> {
    const rec = env.rec;
    const tool = env.tool!;
    if (rec.state === "running" || effect === Effect.READ) return "made again";
    const window = tool.dedupeWindowSeconds;
    const firstAt = rec.first_attempt_at as number | undefined;
    const pastWindow =
      effect === Effect.IDEMPOTENT_WRITE && window !== null && firstAt !== undefined && Date.now() / 1000 - firstAt > window;
    if (effect === Effect.IDEMPOTENT_WRITE && !pastWindow) {
      this.log("call.resume", { settlement: "made again with the same idempotency key" });
      return "made again";
    }
    // A single-attempt write, or a keyed write whose vendor has forgotten the key by now.
    if (tool.readBack !== undefined) {
      const back = await tool.readBack(structuredClone(env.call.args ?? {}), this.toolContext(env, Number(rec.attempts ?? 0)));
      if (back.found) {
        const outcome = await this.succeeded(env.ckey, Number(rec.attempts ?? 0), back.result);
        await this.settle(env, outcome, "read_back");
        return "read back";
      }
      this.log("call.resume", { settlement: "read back: not applied, made again" });
      return "made again";
    }
    let error = NOT_SENT_AGAIN;
    if (pastWindow) error += ` (its vendor dedupes the key only for ${window}s, which has passed)`;
    await this.settle(env, { state: "outcome_unknown", error }, "outcome_unknown");
    return "outcome_unknown";
  }

  /** losses.py record_loss (serving-tools.md 5.2); null when the turn failed of it. */
  private async recordLoss(
    turn0: Rec,
    stepKey: string,
    lost: Rec,
    why: Takeover,
  ): Promise<{ losses: number; drained: boolean; abandoned: boolean } | null> {
    const sid = String(turn0.session_id);
    const tid = String(turn0.turn_id);
    const lid = `${String(lost.worker)}/${String(lost.incarnation ?? "")}`;
    const abandoned = why === "abandoned";
    const drained = abandoned ? false : await this.drained(String(lost.incarnation ?? ""));
    for (let k = 0; k < 20; k++) {
      const cur = await this.state.get(`turn.${sid}.${tid}`);
      if (cur === null) throw new DeadLetter(`turn ${tid} of session ${sid} has no record`);
      const turn = cur.value;
      const had = (turn.lost ?? []) as string[];
      if (had.includes(lid) || drained || abandoned) return { losses: had.length, drained, abandoned };
      const losses = [...had, lid];
      if (losses.length > this.maxLosses) {
        const reason = `the turn was lost ${losses.length} times (its worker died or stalled past the lease); the last loss was at ${stepKey}`;
        await this.failTurn(
          { ...turn, lost: losses },
          cur.revision,
          reason,
          this.event("agent.run.lost", `${sid}.${tid}.lost`, sid, tid, { losses: losses.length, step: stepKey }),
        );
        return null;
      }
      try {
        await this.state.write(`turn.${sid}.${tid}`, { ...turn, lost: losses }, cur.revision);
      } catch (err) {
        if (err instanceof Conflict) continue;
        throw err;
      }
      this.log("turn.loss_counted", { losses: losses.length, lost: lid });
      return { losses: losses.length, drained, abandoned };
    }
    throw new RetryLater(0.05, "turn kept changing while counting a loss");
  }

  /** Whether `incarnation`'s last held list says its drain ran out (holds.py drained). */
  private async drained(incarnation: string): Promise<boolean> {
    try {
      const m = await this.jsm.streams.getMessage("KV_jl_workers", { last_by_subj: `$KV.jl_workers.held.${incarnation}` });
      if (m === null || m.data.length === 0) return false;
      const op = m.header.get("KV-Operation");
      if (op === "DEL" || op === "PURGE") return false;
      const body = JSON.parse(new TextDecoder().decode(m.data)) as Rec;
      return body.drained === true;
    } catch {
      return false;
    }
  }

  /** closing.py fail_turn: CAS the turn failed, audit, close_turn. */
  private async failTurn(turn: Rec, revision: number, reason: string, audit: Rec): Promise<void> {
    const failed: Rec = { ...turn, status: "failed", error: reason };
    delete failed.attempt;
    const sid = String(turn.session_id);
    const tid = String(turn.turn_id);
    try {
      await this.state.write(`turn.${sid}.${tid}`, failed, revision);
    } catch (err) {
      if (err instanceof Conflict) throw new RetryLater(0.05, "turn changed while failing it");
      throw err;
    }
    this.log("turn.failed", { reason });
    const close = { v: SCHEMA_VERSION, kind: "close_turn", agent: turn.agent, session_id: sid, turn_id: tid, model_step: 0 };
    await this.publish([this.eventOut(audit), this.stepOut(close, `${sid}.${tid}.close`, "session")]);
  }

  /** closing.py reject_untrusted (serving-tools.md 8.3). */
  private async rejectUntrusted(step: Step, exc: SealBroken): Promise<void> {
    const sid = step.session_id;
    const tid = step.turn_id;
    const raw = await this.state.last(`turn.${sid}.${tid}`);
    if (raw === null || raw.marker) throw new DeadLetter(`${exc.message}; and its turn has no record`);
    const turn = decode(raw.data) as Rec;
    if (TERMINAL.has(String(turn.status))) return;
    const stepKey = `${sid}.${tid}.m${step.model_step}.c${step.call_index}`;
    this.log("checkpoint.rejected", { key: exc.key, reason: exc.reason });
    await this.failTurn(
      turn,
      raw.revision,
      `checkpoint not trusted: ${exc.message}`,
      this.event("agent.run.checkpoint_rejected", `${sid}.${tid}.rejected.${raw.revision}`, sid, tid, {
        key: exc.key,
        reason: exc.reason,
        step: stepKey,
      }),
    );
  }

  /** dispatch.py _fail_its_turn (serving-tools.md 8.4): a step dead-lettered for a failure fails its turn. */
  private async failItsTurn(step: Step, m: JsMsg, reason: string): Promise<void> {
    const sid = step.session_id;
    const tid = step.turn_id;
    const cur = await this.state.get(`turn.${sid}.${tid}`);
    if (cur === null || TERMINAL.has(String(cur.value.status))) return;
    const stepKey = m.headers?.get("Jl-Step") || m.headers?.get("Nats-Msg-Id") || "?";
    await this.failTurn(
      cur.value,
      cur.revision,
      `step ${stepKey} failed: ${reason.slice(0, 500)}`,
      this.event("agent.run.step_dead_lettered", `${sid}.${tid}.dead.${stepKey}`, sid, tid, {
        step: stepKey,
        reason: reason.slice(0, 500),
        dead_letter: `jl.dead.${m.subject}`,
      }),
    );
  }
}

/** A map without its null/undefined entries (Python writes records with exclude_none). */
function clean(r: Rec): Rec {
  const out: Rec = {};
  for (const [k, v] of Object.entries(r)) if (v !== undefined && v !== null) out[k] = v;
  return out;
}

/** Start a worker: connected, its durable bound, its presence put, pulling. */
export async function serve(opts: ServeOptions): Promise<Worker> {
  const w = new Worker(opts);
  await w.start();
  return w;
}

export type { Versioned };
