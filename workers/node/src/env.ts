// Settings from the environment, named as the Python worker's (jetloop/services/settings.py).

import { readFileSync } from "node:fs";
import { join } from "node:path";
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
/** The store directory `jetloop up` keeps its secrets in (JETLOOP_STORE_DIR, else .jetloop). */
function storeDir(): string {
  return process.env.JETLOOP_STORE_DIR || ".jetloop";
}

function readStore(name: string): string | null {
  try {
    return readFileSync(join(storeDir(), name), "utf8");
  } catch {
    return null;
  }
}

/** Where the store's running `jetloop up` listens (up.json, while its process lives). */
function upUrl(): string | null {
  const text = readStore("up.json");
  if (text === null) return null;
  try {
    const up = JSON.parse(text) as { pid?: number; nats_url?: string };
    if (typeof up.pid !== "number" || typeof up.nats_url !== "string") return null;
    process.kill(up.pid, 0); // throws when that process is gone
    return up.nats_url;
  } catch {
    return null;
  }
}

/** The store's `worker` user (nats-users.json, made by `jetloop up`). */
function storeWorkerPassword(): string | null {
  const text = readStore("nats-users.json");
  if (text === null) return null;
  try {
    const users = JSON.parse(text) as Record<string, unknown>;
    return typeof users.worker === "string" && users.worker !== "" ? users.worker : null;
  } catch {
    return null;
  }
}

export function optionsFromEnv(app: {
  agent: string;
  pool: string;
  tools: Tool[];
  workerId?: string;
  slots?: number;
}): ServeOptions {
  // As the Python worker finds them (jetloop/services/settings.py): the environment first,
  // else what the store of `jetloop up` keeps (seal.key, nats-users.json, up.json).
  const sealKey = (process.env.JETLOOP_SEAL_KEY || readStore("seal.key") || "").trim();
  if (!sealKey) {
    throw new Error(
      `JETLOOP_SEAL_KEY is not set and ${join(storeDir(), "seal.key")} is not there: records cannot be sealed or verified`,
    );
  }
  const storePassword = process.env.JETLOOP_NATS_USER ? null : storeWorkerPassword();
  return {
    servers: process.env.JETLOOP_NATS_URL || upUrl() || "nats://127.0.0.1:4222",
    user: process.env.JETLOOP_NATS_USER || (storePassword !== null ? "worker" : undefined),
    pass: process.env.JETLOOP_NATS_PASSWORD || (storePassword ?? undefined),
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
