// The TypeScript tool of the README's example ("Tools in TypeScript"): the `notes` agent's
// `save_note` (examples/ts_notes.py declares it with served_elsewhere, pool `ts`), made by
// this worker with a real write: one file per note in NOTES_DIR (default `.jetloop/notes`,
// beside the store of `jetloop up`).
//
//   node workers/node/dist/src/cli.js --app workers/node/dist/examples/notes.js
//
// An idempotent write: the file is named by the call's idempotency key, the same on every
// attempt, so a call made again after a crash finds its note and writes nothing twice.

import { mkdirSync, writeFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { Effect, ToolError, tool } from "../src/index.js";

const dir = resolve(process.env.NOTES_DIR ?? join(process.env.JETLOOP_STORE_DIR || ".jetloop", "notes"));

export const agent = "notes";
export const pool = "ts";
export const tools = [
  tool<{ text: string }>({
    name: "save_note",
    effect: Effect.IDEMPOTENT_WRITE,
    async run(args, ctx) {
      if (typeof args?.text !== "string" || args.text === "") throw new ToolError("text must be a non-empty string");
      mkdirSync(dir, { recursive: true });
      const file = join(dir, `${ctx.idempotency_key}.json`);
      try {
        writeFileSync(file, JSON.stringify({ text: args.text, call: ctx.call_id }) + "\n", { flag: "wx" });
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw err; // made before: kept
      }
      return { saved: file };
    },
  }),
];
