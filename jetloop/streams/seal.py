"""Seals on state records: an HMAC-SHA256 bound to the record's key, to when it was written
and to the revision it was written over.

Every record jetloop writes to ``jl_state`` carries ``seal`` (see ``docs/security.md`` for the
exact bytes). A record that does not verify is not trusted: a checkpoint's turn fails with the
reason, a control request on it is refused. The seal covers

- the record's bytes, so an edit or a record written without the key fails;
- the record's **key**, so a sealed record copied to another key (another call, another
  session) fails;
- the **time it was sealed**, which must match, within ``tolerance`` seconds, the time the
  server stored it (a time no publisher can set), so an older sealed state put back later
  fails. A record sealed by a writer whose clock is off fails the same way, so the rejection
  names both times and the likely cause; and a process whose measured clock is too far off
  refuses to seal at all (``guard``, ``jetloop.streams.clock``);
- the **revision it replaces**: every write is a CAS, whose expected revision
  (``Nats-Expected-Last-Subject-Sequence``) the server checks and keeps with the message. An
  older state put back is written over a later revision than the one it was sealed for (or
  without one), so it fails however soon after its sealing it is put back: the time alone
  would let a replay inside the tolerance through.

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
from jetloop.streams.clock import ClockGuard

SEAL_FIELD = "seal"
SEAL_VERSION = "v3"
DOMAIN = b"jetloop-seal-v3\n"
# Seals of the jetloop before the revision was bound: still read (records written before an
# upgrade), never written.
OLD_VERSION = "v2"
OLD_DOMAIN = b"jetloop-seal-v2\n"
# How far the seal's time may be from the server's stored time: the write's own latency, and
# the clock difference between the writer and the server. (A replay inside it is caught by
# the revision the seal names, not by the time.)
DEFAULT_TOLERANCE = 30.0


class SealBroken(RecordNotTrusted):
    """A record's seal is missing or does not verify under any trusted key (the public
    ``jetloop.RecordNotTrusted``, under the name the engine has always used)."""


def canonical(data: dict[str, Any]) -> bytes:
    """The record's msgpack map without its seal (the writer puts ``seal`` last)."""
    body = {k: v for k, v in data.items() if k != SEAL_FIELD}
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


_SEAL_KEY: bytes = msgpack.packb(SEAL_FIELD)


def _seal_entry(seal: str) -> bytes:
    """The bytes of a record's last entry, ``"seal": <seal>``, as msgpack packs it."""
    packed: bytes = msgpack.packb(seal)
    return _SEAL_KEY + packed


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
    return head + rest + _seal_entry(seal)


def _map_head(entries: int) -> bytes:
    """The shortest msgpack map header for ``entries`` keys (what every msgpack writer makes)."""
    if entries < 16:
        return bytes((0x80 | entries,))
    if entries <= 0xFFFF:
        return b"\xde" + entries.to_bytes(2, "big")
    return b"\xdf" + entries.to_bytes(4, "big")


def unsealed(stored: bytes, seal: str) -> bytes | None:
    """What the seal of ``stored`` covers, cut from the stored bytes themselves: the map
    without its last entry (``seal``), under the shortest header for one key fewer. None
    when ``seal`` is not the stored map's last entry (then the record is packed again:
    ``canonical``). A writer in another language that puts ``seal`` last seals these bytes,
    whatever its msgpack library makes of the values (docs/security.md)."""
    tail = _seal_entry(seal)
    if not stored or not stored.endswith(tail):
        return None
    first = stored[0]
    if 0x80 <= first <= 0x8F:
        entries, skip = first & 0x0F, 1
    elif first == 0xDE and len(stored) >= 3:
        entries, skip = int.from_bytes(stored[1:3], "big"), 3
    elif first == 0xDF and len(stored) >= 5:
        entries, skip = int.from_bytes(stored[1:5], "big"), 5
    else:
        return None
    if entries < 1:
        return None
    return _map_head(entries - 1) + stored[skip : len(stored) - len(tail)]


def sealed_message(key: str, at_ms: int, replaces: int, body: bytes) -> bytes:
    """What the HMAC covers: a domain tag, the record's key, its seal time, the revision of
    the key it is written over (0: none), its bytes."""
    return DOMAIN + key.encode() + b"\n" + str(at_ms).encode() + b"\n%d\n" % replaces + body


def old_sealed_message(key: str, at_ms: int, body: bytes) -> bytes:
    """What a v2 seal's HMAC covers: the same without the revision."""
    return OLD_DOMAIN + key.encode() + b"\n" + str(at_ms).encode() + b"\n" + body


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
        # Set by a process that measures its clock against the server's: sealing refuses
        # (``ClockOff``) while it is off, so no record it writes is one every reader rejects.
        self.guard: ClockGuard | None = None

    def seal(self, key: str, data: dict[str, Any], replaces: int = 0) -> str:
        """``v3.<unix ms>.<revision>.<hex HMAC>`` for the record ``data``, sealed now to be
        written at ``key`` over its revision ``replaces`` (0: a key with no value)."""
        return self.seal_packed(key, canonical(data), replaces)

    def seal_packed(self, key: str, body: bytes, replaces: int = 0) -> str:
        """``seal`` of a record already packed without its seal (``canonical``'s bytes)."""
        if self.guard is not None:
            self.guard.check()
        at_ms = int(self.clock() * 1000)
        mac = hmac.new(self.keys[0], sealed_message(key, at_ms, replaces, body), hashlib.sha256)
        return f"{SEAL_VERSION}.{at_ms}.{replaces}.{mac.hexdigest()}"

    def verify(
        self,
        key: str,
        data: dict[str, Any],
        stored_at: float,
        replaced: int | None = 0,
        stored: bytes | None = None,
    ) -> str | None:
        """None when ``data``, read at ``key``, stored by the server at ``stored_at`` (unix
        seconds) by a write over revision ``replaced`` (the ``Nats-Expected-Last-Subject-
        Sequence`` the server kept with it; None: written without one), is what jetloop
        wrote there; else why not. ``stored``: the bytes ``data`` was decoded from, whose
        seal covers them without it (``unsealed``), else ``data`` packed again."""
        seal = data.get(SEAL_FIELD)
        if not isinstance(seal, str):
            return "it carries no seal"
        version, _, rest = seal.partition(".")
        at_text, _, rest = rest.partition(".")
        if version == SEAL_VERSION:
            replaces_text, _, mac = rest.partition(".")
        else:
            replaces_text, mac = "0", rest
        if (
            version not in (SEAL_VERSION, OLD_VERSION)
            or not at_text.isdigit()
            or not replaces_text.isdigit()
        ):
            return (
                "its seal is not a v3 seal (bound to the key, the time and the revision it "
                "replaces): written by hand or by an older jetloop"
            )
        cut = unsealed(stored, seal) if stored is not None else None
        body = cut if cut is not None else canonical(data)
        if version == SEAL_VERSION:
            message = sealed_message(key, int(at_text), int(replaces_text), body)
        else:
            message = old_sealed_message(key, int(at_text), body)
        if not any(
            hmac.compare_digest(hmac.new(k, message, hashlib.sha256).hexdigest(), mac)
            for k in self.keys
        ):
            return (
                "its seal does not verify for this key under any trusted key "
                "(edited, forged, or copied from another key)"
            )
        if version == SEAL_VERSION and replaced != int(replaces_text):
            over = "without a revision check" if replaced is None else f"over revision {replaced}"
            return (
                f"it was sealed to be written over revision {replaces_text} but was stored "
                f"{over}: an older state put back"
            )
        sealed_at = int(at_text) / 1000
        if abs(stored_at - sealed_at) > self.tolerance:
            return self.stale(sealed_at, stored_at)
        return None

    def stale(self, sealed_at: float, stored_at: float) -> str:
        """Why a record sealed at ``sealed_at`` and stored at ``stored_at`` is refused, with
        its likely cause: sealed after it was stored can only be a clock ahead; sealed long
        before is a replay or a clock behind."""
        apart = abs(stored_at - sealed_at)
        times = (
            f"it was sealed at {_when(sealed_at)} but stored at {_when(stored_at)} "
            f"({apart:.0f} s apart, more than the {self.tolerance:g} s allowed): "
        )
        if sealed_at > stored_at:
            return times + (
                f"the writer's clock is likely {apart:.0f} s ahead of the NATS server's "
                "(sealed after it was stored: not an older state put back)"
            )
        return times + (
            f"the writer's clock is likely {apart:.0f} s behind the NATS server's, "
            "or it is an older state put back"
        )


def key_bytes(text: str) -> bytes:
    """A key from a setting: hex if it is hex, else its UTF-8 bytes."""
    text = text.strip()
    try:
        return bytes.fromhex(text)
    except ValueError:
        return text.encode()
