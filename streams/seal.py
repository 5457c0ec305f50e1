"""Seals on checkpoints: an HMAC-SHA256 over the record's canonical bytes.

A turn or call record written by jetloop carries ``seal``; a record that does not verify
(edited by hand, written by something else, sealed under a key no longer trusted) is not
run: its turn fails with the reason. The first key seals; every key verifies, so a key can
be rotated by moving the old one to ``JETLOOP_SEAL_OLD_KEYS``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import msgpack

SEAL_FIELD = "seal"


class SealBroken(Exception):
    """A record's seal is missing or does not verify under any trusted key."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"the checkpoint {key} is not trusted: {reason}")
        self.key = key
        self.reason = reason


def _canonical(data: dict[str, Any]) -> bytes:
    body = {k: v for k, v in data.items() if k != SEAL_FIELD}
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


class Sealer:
    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("a sealer needs at least one key")
        self.keys = list(keys)

    def seal(self, data: dict[str, Any]) -> str:
        return hmac.new(self.keys[0], _canonical(data), hashlib.sha256).hexdigest()

    def verify(self, data: dict[str, Any]) -> str | None:
        """None when the seal verifies, else why not."""
        seal = data.get(SEAL_FIELD)
        if not isinstance(seal, str):
            return "it carries no seal"
        body = _canonical(data)
        for key in self.keys:
            if hmac.compare_digest(hmac.new(key, body, hashlib.sha256).hexdigest(), seal):
                return None
        return "its seal does not verify under any trusted key"


def key_bytes(text: str) -> bytes:
    """A key from a setting: hex if it is hex, else its UTF-8 bytes."""
    text = text.strip()
    try:
        return bytes.fromhex(text)
    except ValueError:
        return text.encode()
