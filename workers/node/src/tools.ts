// What an application declares: its tools, their effect class, how often they may be tried.

export enum Effect {
  READ = "read",
  IDEMPOTENT_WRITE = "idempotent_write",
  NON_IDEMPOTENT_WRITE = "non_idempotent_write",
}

/** A failure the model should see (`failed`, its message as the error); never tried again. */
export class ToolError extends Error {
  override name = "ToolError";
}

/** A failure that says the call did not apply: tried again (even a single-attempt write)
 * while attempts are left. */
export class RetryableToolError extends Error {
  override name = "RetryableToolError";
  /** The call never reached its vendor (nothing ran): a crash test does not count it. */
  readonly notSent: boolean;
  constructor(message: string, options?: { notSent?: boolean }) {
    super(message);
    this.notSent = options?.notSent ?? false;
  }
}

export interface ToolContext {
  /** The namespace the worker serves (`default` unless configured). */
  readonly namespace: string;
  readonly session_id: string;
  readonly turn_id: string;
  readonly model_step: number;
  /** `<turn>-<step>-<index>`, from the plan. */
  readonly call_id: string;
  /** From the plan, never recomputed: send it to the vendor with every attempt of a keyed write. */
  readonly idempotency_key: string;
  /** The attempt number (1 for the first). */
  readonly attempt: number;
  /** Beat at once (rewrite the claim, extend the lease); beats also run every lease/3. */
  heartbeat(): Promise<void>;
  /** True once the turn was cancelled (each beat reads it): stop early if you can. */
  readonly cancelled: boolean;
  /** Aborted when `cancelled` becomes true: hand it to `fetch` and the like. */
  readonly signal: AbortSignal;
}

export interface ToolSpec<A = any, R = unknown> {
  /** The tool's name, as the Python app declares it (`served_elsewhere(name=...)`). */
  name: string;
  /** Informative only: what a call may do is the effect recorded in the plan. */
  effect: Effect;
  run(args: A, ctx: ToolContext): Promise<R> | R;
  /** Attempts of one call, lost ones included (Python's default: 3). */
  maxAttempts?: number;
  /** Seconds from the first attempt after which no new attempt starts (default 1800). */
  attemptWindowSeconds?: number;
  /** An idempotent write's vendor dedupes its key only this long (seconds); null: always. */
  dedupeWindowSeconds?: number | null;
  /** Check the arguments: a reason when they do not fit (the call then fails unrun). */
  check?(args: unknown): string | null;
  /** A person approves each call first: true, or a predicate over the arguments (the
   * session's override, `jetloop approval-policy`, wins over it). Default false. */
  approval?: boolean | ((args: A) => boolean);
  /** A single-attempt write (or a keyed write past its dedupe window) whose attempt was lost
   * may have applied: this asks the vendor. `found(result)`: it applied, its result is
   * recorded (settlement `read_back`); `notFound()`: it did not, so it is made again.
   * Without it such a call is settled `outcome_unknown`. `ctx.attempt` is the lost one's. */
  readBack?(args: A, ctx: ToolContext): Promise<ReadBack<R>> | ReadBack<R>;
}

/** What a `readBack` found. */
export type ReadBack<R = unknown> = { found: true; result: R } | { found: false };

/** The write applied: `result` is what the call returns. */
export function found<R>(result: R): ReadBack<R> {
  return { found: true, result };
}

/** No trace of the write: it did not apply, and may be made. */
export function notFound(): ReadBack<never> {
  return { found: false };
}

export interface Tool<A = any, R = unknown>
  extends Required<Omit<ToolSpec<A, R>, "check" | "dedupeWindowSeconds" | "approval" | "readBack">> {
  dedupeWindowSeconds: number | null;
  check?: (args: unknown) => string | null;
  approval: boolean | ((args: A) => boolean);
  readBack?: (args: A, ctx: ToolContext) => Promise<ReadBack<R>> | ReadBack<R>;
}

const NAME = /^[A-Za-z0-9_-]{1,64}$/;

export function tool<A = any, R = unknown>(spec: ToolSpec<A, R>): Tool<A, R> {
  if (!NAME.test(spec.name)) throw new Error(`tool name ${JSON.stringify(spec.name)} is not a tool name`);
  if (!Object.values(Effect).includes(spec.effect)) throw new Error(`tool ${spec.name}: unknown effect ${spec.effect}`);
  const maxAttempts = spec.maxAttempts ?? 3;
  if (!Number.isInteger(maxAttempts) || maxAttempts < 1) throw new Error(`tool ${spec.name}: maxAttempts must be ≥ 1`);
  return {
    name: spec.name,
    effect: spec.effect,
    run: spec.run,
    maxAttempts,
    attemptWindowSeconds: spec.attemptWindowSeconds ?? 1800,
    dedupeWindowSeconds: spec.dedupeWindowSeconds ?? null,
    check: spec.check,
    approval: spec.approval ?? false,
    readBack: spec.readBack,
  };
}

/** Whether a call of `t` with `args` asks a person first, by the tool's own policy. */
export function needsApproval<A>(t: Tool<A>, args: A): boolean {
  return typeof t.approval === "function" ? Boolean(t.approval(args)) : t.approval;
}
