// Seals on jl_state records (docs/security.md, "The exact bytes"; jetloop/streams/seal.py).
//
// A record is a msgpack map whose LAST entry is `seal` =
// `v3.<unix ms>.<revision it replaces>.<hex HMAC-SHA256>`; the HMAC covers
//   "jetloop-seal-v3\n" + key + "\n" + ms + "\n" + replaces + "\n" + <the map without its seal>
// where "the map without its seal" is cut from the stored bytes (shortest map header for one
// entry fewer + the entries before the seal): no re-encoding, so any msgpack writer verifies.

import { createHmac, timingSafeEqual } from "node:crypto";
import { encode } from "@msgpack/msgpack";

export const SEAL_FIELD = "seal";
const DOMAIN = "jetloop-seal-v3\n";
const OLD_DOMAIN = "jetloop-seal-v2\n";
export const DEFAULT_TOLERANCE = 30;

const utf8 = new TextEncoder();

/** A key from a setting: hex if it is hex, else its UTF-8 bytes (jetloop.streams.seal.key_bytes). */
export function keyBytes(text: string): Buffer {
  const t = text.trim();
  const compact = t.replace(/\s+/g, "");
  if (compact.length % 2 === 0 && /^[0-9a-fA-F]*$/.test(compact)) {
    return Buffer.from(compact, "hex");
  }
  return Buffer.from(t, "utf8");
}

function mapHead(entries: number): Uint8Array {
  if (entries < 16) return Uint8Array.of(0x80 | entries);
  if (entries <= 0xffff) return Uint8Array.of(0xde, entries >> 8, entries & 0xff);
  return Uint8Array.of(0xdf, (entries >>> 24) & 0xff, (entries >> 16) & 0xff, (entries >> 8) & 0xff, entries & 0xff);
}

function concat(...parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

function endsWith(data: Uint8Array, tail: Uint8Array): boolean {
  if (tail.length > data.length) return false;
  const off = data.length - tail.length;
  for (let i = 0; i < tail.length; i++) if (data[off + i] !== tail[i]) return false;
  return true;
}

/** What the seal of `stored` covers, cut from the stored bytes; null when `seal` is not the
 * map's last entry. */
export function unsealed(stored: Uint8Array, seal: string): Uint8Array | null {
  const tail = concat(encode(SEAL_FIELD), encode(seal));
  if (stored.length === 0 || !endsWith(stored, tail)) return null;
  const first = stored[0]!;
  let entries: number;
  let skip: number;
  if (first >= 0x80 && first <= 0x8f) {
    entries = first & 0x0f;
    skip = 1;
  } else if (first === 0xde && stored.length >= 3) {
    entries = (stored[1]! << 8) | stored[2]!;
    skip = 3;
  } else if (first === 0xdf && stored.length >= 5) {
    entries = ((stored[1]! << 24) >>> 0) + (stored[2]! << 16) + (stored[3]! << 8) + stored[4]!;
    skip = 5;
  } else {
    return null;
  }
  if (entries < 1) return null;
  return concat(mapHead(entries - 1), stored.subarray(skip, stored.length - tail.length));
}

function sealedMessage(key: string, atMs: number, replaces: number, body: Uint8Array): Uint8Array {
  return concat(utf8.encode(`${DOMAIN}${key}\n${atMs}\n${replaces}\n`), body);
}

function oldSealedMessage(key: string, atMs: number, body: Uint8Array): Uint8Array {
  return concat(utf8.encode(`${OLD_DOMAIN}${key}\n${atMs}\n`), body);
}

function hmacHex(k: Buffer, message: Uint8Array): string {
  return createHmac("sha256", k).update(message).digest("hex");
}

export type Rec = Record<string, unknown>;

export class Sealer {
  constructor(
    readonly keys: Buffer[],
    readonly tolerance = DEFAULT_TOLERANCE,
  ) {
    if (keys.length === 0) throw new Error("a sealer needs at least one key");
  }

  /** The stored bytes of `record` (its `seal`, if any, dropped) sealed for `key` over
   * revision `replaces` (0: a key with no value), `seal` the map's last entry. */
  encodeSealed(key: string, record: Rec, replaces: number): Uint8Array {
    const body: Rec = {};
    for (const [k, v] of Object.entries(record)) {
      if (k !== SEAL_FIELD && v !== undefined && v !== null) body[k] = v;
    }
    const packed = encode(body, { ignoreUndefined: true });
    const atMs = Date.now();
    const mac = hmacHex(this.keys[0]!, sealedMessage(key, atMs, replaces, packed));
    const seal = `v3.${atMs}.${replaces}.${mac}`;
    return encode({ ...body, [SEAL_FIELD]: seal }, { ignoreUndefined: true });
  }

  /** null when `data` (decoded from `stored`), read at `key`, stored by the server at
   * `storedAt` (unix seconds) by a write over revision `replaced`, is what jetloop wrote
   * there; else why not. */
  verify(key: string, data: Rec, stored: Uint8Array, storedAt: number, replaced: number | null): string | null {
    const seal = data[SEAL_FIELD];
    if (typeof seal !== "string") return "it carries no seal";
    const parts = seal.split(".");
    const version = parts[0];
    let atText: string, replacesText: string, mac: string;
    if (version === "v3" && parts.length === 4) {
      [, atText, replacesText, mac] = parts as [string, string, string, string];
    } else if (version === "v2" && parts.length === 3) {
      [, atText, mac] = parts as [string, string, string];
      replacesText = "0";
    } else {
      return "its seal is not a v3 seal (bound to the key, the time and the revision it replaces)";
    }
    if (!/^\d+$/.test(atText) || !/^\d+$/.test(replacesText)) {
      return "its seal is not a v3 seal (bound to the key, the time and the revision it replaces)";
    }
    const body = unsealed(stored, seal);
    if (body === null) {
      return "its seal is not the record's last entry (this worker verifies over the stored bytes only)";
    }
    const message =
      version === "v3"
        ? sealedMessage(key, Number(atText), Number(replacesText), body)
        : oldSealedMessage(key, Number(atText), body);
    const want = Buffer.from(mac, "utf8");
    const ok = this.keys.some((k) => {
      const got = Buffer.from(hmacHex(k, message), "utf8");
      return got.length === want.length && timingSafeEqual(got, want);
    });
    if (!ok) {
      return "its seal does not verify for this key under any trusted key (edited, forged, or copied from another key)";
    }
    if (version === "v3" && replaced !== Number(replacesText)) {
      const over = replaced === null ? "without a revision check" : `over revision ${replaced}`;
      return `it was sealed to be written over revision ${replacesText} but was stored ${over}: an older state put back`;
    }
    const sealedAt = Number(atText) / 1000;
    if (Math.abs(storedAt - sealedAt) > this.tolerance) {
      return (
        `it was sealed at ${new Date(sealedAt * 1000).toISOString()} but stored at ` +
        `${new Date(storedAt * 1000).toISOString()} (more than the ${this.tolerance} s allowed): ` +
        "a writer's clock is off, or it is an older state put back"
      );
    }
    return null;
  }
}
