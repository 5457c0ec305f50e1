// Settings from the environment, named as the Python worker's (jetloop/services/settings.py).

import type { ServeOptions } from "./worker.js";
import { serve } from "./worker.js";
import type { Tool } from "./tools.js";

function num(name: string, fallback: number): number {
  const text = process.env[name];
  if (text === undefined || text.trim() === "") return fallback;
  const n = Number(text);
  if (!Number.isFinite(n)) throw new Error(`${name}=${text} is not a number`);
  return n;
}

/** JETLOOP_NATS_URL, JETLOOP_SEAL_KEY (+ JETLOOP_SEAL_OLD_KEYS), JETLOOP_LEASE_SECONDS,
 * JETLOOP_MAX_LOSSES, JETLOOP_BLOB_THRESHOLD, JETLOOP_DRAIN_SECONDS, JETLOOP_NAMESPACE,
 * JETLOOP_SEAL_TOLERANCE_SECONDS, JETLOOP_NEWER_WRITER_SECONDS; the rest from `app`. */
export function optionsFromEnv(app: {
  agent: string;
  pool: string;
  tools: Tool[];
  workerId?: string;
  slots?: number;
}): ServeOptions {
  const sealKey = process.env.JETLOOP_SEAL_KEY ?? "";
  if (!sealKey.trim()) throw new Error("JETLOOP_SEAL_KEY is not set: records cannot be sealed or verified");
  return {
    servers: process.env.JETLOOP_NATS_URL ?? "nats://127.0.0.1:4222",
    agent: app.agent,
    pool: app.pool,
    tools: app.tools,
    sealKey,
    sealOldKeys: process.env.JETLOOP_SEAL_OLD_KEYS,
    workerId: app.workerId ?? process.env.JETLOOP_WORKER_ID,
    leaseSeconds: num("JETLOOP_LEASE_SECONDS", 5),
    maxLosses: num("JETLOOP_MAX_LOSSES", 2),
    blobThreshold: num("JETLOOP_BLOB_THRESHOLD", 64 * 1024),
    drainSeconds: num("JETLOOP_DRAIN_SECONDS", 10),
    namespace: process.env.JETLOOP_NAMESPACE || "default",
    sealToleranceSeconds: num("JETLOOP_SEAL_TOLERANCE_SECONDS", 30),
    newerWriterSeconds: num("JETLOOP_NEWER_WRITER_SECONDS", 3600),
    slots: app.slots,
  };
}

/** Serve until SIGTERM or SIGINT, then stop gracefully (drain) and exit. */
export async function runUntilSignalled(opts: ServeOptions): Promise<void> {
  const w = await serve(opts);
  let stopping: Promise<void> | null = null;
  const stop = () => {
    stopping ??= w.stop().then(() => process.exit(0));
  };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
  await w.closed;
  if (stopping === null) {
    w.log("worker.connection_closed", {});
    process.exit(1);
  }
  await stopping;
}
