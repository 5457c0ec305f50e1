// Named points where a test stops a call on purpose, as the Python worker's
// (jetloop/consumers/faults.py): the same variables, the same points, the same log lines, so
// a crash test kills this worker at the boundaries it kills a Python one.
//
// JETLOOP_FAULT_HOLD: points (comma-separated); a delivery that reaches one logs
// `fault.hold` with the point and waits there (its heartbeats go on, so it keeps its lease)
// until the file JETLOOP_FAULT_RELEASE exists, or forever.
// JETLOOP_FAULT_FAIL: points too; the first time this process reaches one it raises an outage
// there (a timeout it outlives), so the delivery ends with its claim still recorded.
// JETLOOP_FAULT_PLAN: a file `{"holds": ["<point>@<session>#<k>", ...], "pass": false}` read
// again when it changes: hold the k-th time (from 1; every time without `#k`) this process
// reaches `point` for a call of `session`; with `"pass": true` log the point, do not hold.
//
// Points of a call: call_tool.before_mark, call_tool.in_tool, call_tool.before_commit,
// call_tool.after_commit.

import { readFileSync, statSync } from "node:fs";

type Log = (event: string, fields: Record<string, unknown>) => void;

interface Hold {
  point: string;
  session: string;
  nth: number | null;
  text: string;
}

function parse(entry: string): Hold {
  const [where, nth] = entry.split("#", 2) as [string, string | undefined];
  const at = where.indexOf("@");
  const point = at < 0 ? where : where.slice(0, at);
  const session = at < 0 ? "" : where.slice(at + 1);
  return { point, session, nth: nth ? Number(nth) : null, text: entry };
}

function points(text: string | undefined): Set<string> {
  return new Set((text ?? "").split(",").map((p) => p.trim()).filter((p) => p !== ""));
}

class Plan {
  private holds = new Map<string, Hold[]>();
  passing = false;
  private stamp: string | null = null;
  readonly reached = new Map<string, number>();

  constructor(private readonly path: string) {}

  private current(): void {
    let stamp: string;
    try {
      const st = statSync(this.path, { bigint: true });
      stamp = `${st.mtimeNs}/${st.size}`;
    } catch {
      this.holds = new Map();
      this.stamp = null;
      return;
    }
    if (stamp === this.stamp) return;
    this.stamp = stamp;
    this.holds = new Map();
    try {
      const body = JSON.parse(readFileSync(this.path, "utf8")) as { holds?: unknown[]; pass?: unknown };
      this.passing = body.pass === true;
      for (const e of body.holds ?? []) {
        const h = parse(String(e));
        const key = `${h.point}@${h.session}`;
        this.holds.set(key, [...(this.holds.get(key) ?? []), h]);
      }
    } catch {
      this.holds = new Map();
    }
  }

  match(point: string, session: string): { hold: Hold; nth: number } | null {
    this.current();
    const entries = this.holds.get(`${point}@${session}`);
    if (!entries) return null;
    const key = `${point}@${session}`;
    const n = (this.reached.get(key) ?? 0) + 1;
    this.reached.set(key, n);
    const hold = entries.find((e) => e.nth === null || e.nth === n);
    return hold ? { hold, nth: n } : null;
  }
}

/** Raised at a point of JETLOOP_FAULT_FAIL: an outage the process outlives (a timeout). */
export class InjectedOutage extends Error {
  override name = "TimeoutError";
  constructor(point: string) {
    super(`injected outage at ${point} (JETLOOP_FAULT_FAIL)`);
  }
}

export class Faults {
  private readonly fails: Set<string>;
  private readonly holds: Set<string>;
  private readonly release: string | null;
  private readonly plan: Plan | null;

  constructor(
    private readonly log: Log,
    env: NodeJS.ProcessEnv = process.env,
  ) {
    this.holds = points(env.JETLOOP_FAULT_HOLD);
    this.fails = points(env.JETLOOP_FAULT_FAIL); // each fails once
    this.release = env.JETLOOP_FAULT_RELEASE || null;
    this.plan = env.JETLOOP_FAULT_PLAN ? new Plan(env.JETLOOP_FAULT_PLAN) : null;
  }

  /** Reached `name` for a call of `session`: hold there if a test asked to. */
  async point(name: string, session: string, fields: Record<string, unknown> = {}): Promise<void> {
    if (this.fails.delete(name)) {
      this.log("fault.fail", { point: name, session, ...fields });
      throw new InjectedOutage(name);
    }
    if (this.plan !== null) {
      const planned = this.plan.match(name, session);
      if (planned !== null) {
        this.log("fault.hold", { point: name, planned: planned.hold.text, nth: planned.nth, session, ...fields });
        if (!this.plan.passing) await this.held(name);
        return;
      }
    }
    if (!this.holds.has(name)) return;
    this.log("fault.hold", { point: name, session, ...fields });
    await this.held(name);
  }

  private async held(name: string): Promise<void> {
    for (;;) {
      if (this.release !== null) {
        try {
          statSync(this.release);
          break;
        } catch {
          // not yet
        }
      }
      await new Promise((r) => setTimeout(r, 50));
    }
    this.log("fault.released", { point: name });
  }
}
