// The crash test's ledger, from this side (jetloop/tooling/crashtest/ledger.py): with
// JETLOOP_CRASHTEST_INVOCATIONS set (a file), every invocation of a tool is a line
// `{"row", "tool", "effect", "session_id", "turn_id", "call_id", "idempotency_key",
// "attempt", "pid", "started"}` synced to disk before the tool's function starts, then
// `{"row", "ended", "outcome"}` when it ends ("ok", "error: …", or "not sent: …" for a call
// that never reached its vendor). A row without an end is a tool its process died inside.

import { closeSync, fsyncSync, openSync, writeSync } from "node:fs";

let rows = 0;

function append(path: string, line: Record<string, unknown>): void {
  const fd = openSync(path, "a");
  try {
    writeSync(fd, `${JSON.stringify(line)}\n`);
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

export class Invocations {
  constructor(private readonly path: string | null = process.env.JETLOOP_CRASHTEST_INVOCATIONS || null) {}

  get on(): boolean {
    return this.path !== null;
  }

  /** The row of an invocation about to start (null when no ledger is kept). */
  started(fields: {
    tool: string;
    effect: string;
    session_id: string;
    turn_id: string;
    call_id: string;
    idempotency_key: string;
    attempt: number;
  }): string | null {
    if (this.path === null) return null;
    rows += 1;
    const row = `${process.pid}-${rows}`;
    append(this.path, { row, ...fields, pid: process.pid, started: Date.now() / 1000 });
    return row;
  }

  ended(row: string | null, outcome: string): void {
    if (this.path === null || row === null) return;
    append(this.path, { row, ended: Date.now() / 1000, outcome: outcome.slice(0, 500) });
  }
}
