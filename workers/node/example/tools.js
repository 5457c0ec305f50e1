// An example app for the Node worker, and the one tests/test_node_worker.py runs:
//
//   JETLOOP_NATS_URL=nats://127.0.0.1:4222 JETLOOP_SEAL_KEY=... NODE_TOOLS_DIR=/tmp/t \
//     node dist/src/cli.js --app example/tools.js --id node-1
//
// The tools of agent `sider` in pool `node` (tests/apps.py node_front_app declares them with
// served_elsewhere). Their "vendor" is a directory of files (NODE_TOOLS_DIR):
//   requests.log  every request a tool made: `<op> <idempotency key> <attempt> <pid>`
//   keyed.log     the keyed write's applied effects, one line per idempotency key (it dedupes)
//   append.log    the single-attempt write's applied effects (appended unconditionally)
//   guarded.log   the approved write's effects (node_guarded: a person approves each call)
//   checked.log   node_checked's effects (a single-attempt write with a read-back)
//   node_big returns a text of `size` bytes (a result too large for a message, unless it goes
//                 to the blob store)
//   patient.log   node_patient's effect, made only if it worked its `seconds` to the end;
//                 stopped.log when it stopped early because the turn was cancelled
// With TEST_LATCH set (a file path), the writes hold until that file exists: node_append
// before its effect, node_keyed after it (a kill then leaves an applied effect in doubt).

import { appendFileSync, existsSync, mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { Effect, ToolError, found, notFound, tool } from "../dist/src/index.js";

const dir = process.env.NODE_TOOLS_DIR ?? "/tmp/jetloop-node-tools";
mkdirSync(dir, { recursive: true });

function line(file, text) {
  appendFileSync(join(dir, file), `${text}\n`);
}

async function latch(op, ctx) {
  const path = process.env.TEST_LATCH;
  if (!path) return;
  line("opened.log", `${op} ${ctx.idempotency_key} ${ctx.attempt} ${process.pid}`);
  while (!existsSync(path)) await new Promise((r) => setTimeout(r, 20));
}

function named(args) {
  if (typeof args?.name !== "string") throw new ToolError("name must be a string");
  return args.name;
}

export const agent = "sider";
export const pool = "node";
export const tools = [
  tool({
    name: "node_lookup",
    effect: Effect.READ,
    async run(args, ctx) {
      const name = named(args);
      line("requests.log", `node_lookup ${ctx.idempotency_key} ${ctx.attempt} ${process.pid}`);
      return { name, value: name.length, pid: process.pid };
    },
  }),
  tool({
    name: "node_keyed",
    effect: Effect.IDEMPOTENT_WRITE,
    async run(args, ctx) {
      const name = named(args);
      line("requests.log", `node_keyed ${ctx.idempotency_key} ${ctx.attempt} ${process.pid}`);
      const file = join(dir, "keyed.log");
      const applied = existsSync(file) && readFileSync(file, "utf8").split("\n").some((l) => l.startsWith(`${ctx.idempotency_key} `));
      if (!applied) line("keyed.log", `${ctx.idempotency_key} ${name} ${process.pid}`);
      await latch("node_keyed", ctx);
      return { name, key: ctx.idempotency_key, pid: process.pid, applied: !applied };
    },
  }),
  tool({
    name: "node_append",
    effect: Effect.NON_IDEMPOTENT_WRITE,
    async run(args, ctx) {
      const name = named(args);
      await latch("node_append", ctx);
      line("requests.log", `node_append ${ctx.idempotency_key} ${ctx.attempt} ${process.pid}`);
      line("append.log", `${ctx.idempotency_key} ${name} ${process.pid}`);
      return { name, pid: process.pid };
    },
  }),
  tool({
    name: "node_guarded",
    effect: Effect.IDEMPOTENT_WRITE,
    approval: true, // a person approves each call first
    async run(args, ctx) {
      const name = named(args);
      line("requests.log", `node_guarded ${ctx.idempotency_key} ${ctx.attempt} ${process.pid}`);
      line("guarded.log", `${ctx.idempotency_key} ${name} ${process.pid}`);
      return { name, pid: process.pid };
    },
  }),
  tool({
    name: "node_checked",
    effect: Effect.NON_IDEMPOTENT_WRITE,
    async run(args, ctx) {
      const name = named(args);
      line("requests.log", `node_checked ${ctx.idempotency_key} ${ctx.attempt} ${process.pid}`);
      line("checked.log", `${ctx.idempotency_key} ${name} ${process.pid}`);
      return { name, made: true };
    },
    // A lost attempt is settled by asking the "vendor" whether its key was applied.
    async readBack(args, ctx) {
      line("requests.log", `node_checked.read_back ${ctx.idempotency_key} ${ctx.attempt} ${process.pid}`);
      const file = join(dir, "checked.log");
      const applied = existsSync(file) && readFileSync(file, "utf8").split("\n").some((l) => l.startsWith(`${ctx.idempotency_key} `));
      return applied ? found({ name: named(args), made: true, read_back: true }) : notFound();
    },
  }),
  tool({
    name: "node_big",
    effect: Effect.READ,
    async run(args, ctx) {
      line("requests.log", `node_big ${ctx.idempotency_key} ${ctx.attempt} ${process.pid}`);
      return { text: "x".repeat(Number(args.size ?? 0)) };
    },
  }),
  tool({
    name: "node_patient",
    effect: Effect.IDEMPOTENT_WRITE,
    async run(args, ctx) {
      const name = named(args);
      line("requests.log", `node_patient ${ctx.idempotency_key} ${ctx.attempt} ${process.pid}`);
      const until = Date.now() + Number(args.seconds ?? 0) * 1000;
      while (Date.now() < until) {
        if (ctx.cancelled) {
          line("stopped.log", `${ctx.idempotency_key} ${name} ${ctx.signal.aborted} ${process.pid}`);
          return { name, stopped: true };
        }
        await new Promise((r) => setTimeout(r, 50));
      }
      line("patient.log", `${ctx.idempotency_key} ${name} ${process.pid}`);
      return { name, stopped: false };
    },
  }),
];
