"""Seals on state records: an HMAC-SHA256 bound to the record's key and to when it was written.

Every record jetloop writes to ``jl_state`` carries ``seal`` (see ``docs/security.md`` for the
exact bytes). A record that does not verify is not trusted: a checkpoint's turn fails with the
reason, a control request on it is refused. The seal covers

- the record's bytes, so an edit or a record written without the key fails;
- the record's **key**, so a sealed record copied to another key (another call, another
  session) fails;
- the **time it was sealed**, which must match, within ``tolerance`` seconds, the time the
  server stored it (a time no publisher can set), so an older sealed state put back later
  (a replay) fails.

The first key seals; every key verifies, so a key can be rotated by moving the old one to
``JETLOOP_SEAL_OLD_KEYS``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import msgpack

from jetloop.schemas.errors import RecordNotTrusted

SEAL_FIELD = "seal"
SEAL_VERSION = "v2"
DOMAIN = b"jetloop-seal-v2\n"
# How far the seal's time may be from the server's stored time: the write's own latency, and
# the clock difference between the writer and the server. A replay inside it is not caught.
DEFAULT_TOLERANCE = 30.0


class SealBroken(RecordNotTrusted):
    """A record's seal is missing or does not verify under any trusted key (the public
    ``jetloop.RecordNotTrusted``, under the name the engine has always used)."""


def canonical(data: dict[str, Any]) -> bytes:
    """The record's msgpack map without its seal (the writer puts ``seal`` last)."""
    body = {k: v for k, v in data.items() if k != SEAL_FIELD}
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def with_seal(body: bytes, entries: int, seal: str) -> bytes:
    """The packed map ``body`` (``entries`` keys, packed by msgpack without a seal) with
    ``seal`` added as its last key: the bytes ``packb`` makes of the sealed map, without
    packing the record a second time."""
    if entries < 15:  # fixmap: the count is in the first byte
        head, rest = bytes((0x80 | (entries + 1),)), body[1:]
    elif entries < 0xFFFF:  # map16 (a fixmap of 15 grows into one)
        skip = 1 if entries == 15 else 3
        head, rest = b"\xde" + (entries + 1).to_bytes(2, "big"), body[skip:]
    else:
        raise ValueError(f"a record of {entries} keys")
    tail: bytes = msgpack.packb(SEAL_FIELD) + msgpack.packb(seal)
    return head + rest + tail


def sealed_message(key: str, at_ms: int, body: bytes) -> bytes:
    """What the HMAC covers: a domain tag, the record's key, its seal time, its bytes."""
    return DOMAIN + key.encode() + b"\n" + str(at_ms).encode() + b"\n" + body


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")


class Sealer:
    def __init__(
        self,
        keys: Sequence[bytes],
        tolerance: float = DEFAULT_TOLERANCE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not keys:
            raise ValueError("a sealer needs at least one key")
        self.keys = list(keys)
        self.tolerance = tolerance
        self.clock = clock

    def seal(self, key: str, data: dict[str, Any]) -> str:
        """``v2.<unix ms>.<hex HMAC>`` for the record ``data`` stored at ``key``, sealed now."""
        return self.seal_packed(key, canonical(data))

    def seal_packed(self, key: str, body: bytes) -> str:
        """``seal`` of a record already packed without its seal (``canonical``'s bytes)."""
        at_ms = int(self.clock() * 1000)
        mac = hmac.new(self.keys[0], sealed_message(key, at_ms, body), hashlib.sha256)
        return f"{SEAL_VERSION}.{at_ms}.{mac.hexdigest()}"

    def verify(self, key: str, data: dict[str, Any], stored_at: float) -> str | None:
        """None when ``data``, read at ``key`` and stored by the server at ``stored_at`` (unix
        seconds), is what jetloop wrote there; else why not."""
        seal = data.get(SEAL_FIELD)
        if not isinstance(seal, str):
            return "it carries no seal"
        version, _, rest = seal.partition(".")
        at_text, _, mac = rest.partition(".")
        if version != SEAL_VERSION or not at_text.isdigit():
            return (
                "its seal is not a v2 seal (bound to the key and the time): written by hand "
                "or by an older jetloop"
            )
        message = sealed_message(key, int(at_text), canonical(data))
        if not any(
            hmac.compare_digest(hmac.new(k, message, hashlib.sha256).hexdigest(), mac)
            for k in self.keys
        ):
            return (
                "its seal does not verify for this key under any trusted key "
                "(edited, forged, or copied from another key)"
            )
        sealed_at = int(at_text) / 1000
        if abs(stored_at - sealed_at) > self.tolerance:
            return (
                f"it was sealed at {_when(sealed_at)} but stored at {_when(stored_at)}: "
                "an older state put back"
            )
        return None


def key_bytes(text: str) -> bytes:
    """A key from a setting: hex if it is hex, else its UTF-8 bytes."""
    text = text.strip()
    try:
        return bytes.fromhex(text)
    except ValueError:
        return text.encode()
