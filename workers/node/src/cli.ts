#!/usr/bin/env node
// node dist/src/cli.js --app ./my-tools.js [--id <worker id>]
//
// The app module exports `agent`, `pool` and `tools` (an array of `tool({...})`), or a default
// export with them. Settings come from the environment (JETLOOP_NATS_URL, JETLOOP_SEAL_KEY,
// JETLOOP_LEASE_SECONDS, ...: see env.ts).

import { resolve } from "node:path";
import { pathToFileURL } from "node:url";
import { optionsFromEnv, runUntilSignalled } from "./env.js";

function arg(name: string): string | undefined {
  const at = process.argv.indexOf(name);
  return at >= 0 ? process.argv[at + 1] : undefined;
}

const appPath = arg("--app");
if (!appPath) {
  process.stderr.write("usage: jetloop-node-worker --app <module.js> [--id <worker id>]\n");
  process.exit(2);
}
const mod = (await import(pathToFileURL(resolve(appPath)).href)) as Record<string, unknown>;
const app = (mod.default ?? mod) as { agent: string; pool: string; tools: never[] };
if (!app.agent || !app.pool || !Array.isArray(app.tools)) {
  process.stderr.write(`${appPath} exports no agent, pool and tools\n`);
  process.exit(2);
}
await runUntilSignalled(optionsFromEnv({ ...app, workerId: arg("--id") }));
