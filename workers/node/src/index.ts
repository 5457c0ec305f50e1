// @jetloop/worker: a jetloop tool worker in Node.js (see README.md).
export { serve, Worker, VERSION } from "./worker.js";
export type { ServeOptions } from "./worker.js";
export { tool, Effect, ToolError, RetryableToolError, found, notFound } from "./tools.js";
export type { Tool, ToolSpec, ToolContext, ReadBack } from "./tools.js";
export { Sealer, keyBytes, unsealed } from "./seal.js";
export { optionsFromEnv, runUntilSignalled } from "./env.js";
