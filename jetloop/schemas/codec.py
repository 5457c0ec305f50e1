"""msgpack encoding of the pydantic models, and the one error a bad body raises."""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

# Defined with the rest of the public tree; importable from here too.
from jetloop.schemas.errors import DecodeError as DecodeError

SCHEMA_VERSION = 1
# The pydantic error type of a step kind this code does not know (a newer writer's).
UNKNOWN_KIND = "unknown_step_kind"

M = TypeVar("M", bound=BaseModel)


class NewerWriter(DecodeError):
    """A body a newer jetloop wrote: a schema version above ours, or a step kind we do not
    know. Never read as ours; a worker's step of this kind is handed back for a worker that
    reads it (a rolling upgrade), and dead-lettered only when none took it for long
    (``jetloop.consumers.dispatch``)."""


def encode(model: BaseModel) -> bytes:
    data = model.model_dump(mode="json", exclude_none=True)
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed


def readable(data: bytes) -> Any:
    """A stored body as data, for a person to read: msgpack decoded, else text."""
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception:  # not msgpack (msgpack raises several unrelated types): show the text
        return data.decode(errors="replace")


def decode(model: type[M], data: bytes) -> M:
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"body is not msgpack: {not_msgpack(data, exc)}") from exc
    return decode_map(model, raw)


def not_msgpack(data: bytes, exc: Exception) -> str:
    """Why ``data`` is not msgpack, for a person: msgpack's own words are often empty
    (``FormatError``) or say little ("received extra data" for plain text), so the error's
    type and the first bytes go with them."""
    why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if not data:
        return f"{why} (the body is empty)"
    head = data[:32]
    more = f", {len(data)} bytes in all" if len(data) > len(head) else ""
    return f"{why} (it starts {head!r}{more})"


def decode_map(model: type[M], raw: object) -> M:
    """Validate an already unpacked body (a reader that unpacked it to check it first)."""
    if not isinstance(raw, dict):
        raise DecodeError(f"body is not a map but {type(raw).__name__}")
    check_version(model, raw.get("v"))
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        error = NewerWriter if first["type"] == UNKNOWN_KIND else DecodeError
        raise error(f"{model.__name__} invalid at {where}: {first['msg']}") from exc


def check_version(model: type[BaseModel], v: object) -> None:
    """A body of a version this code does not know (a newer writer's) is not read as ours:
    its fields may mean something else. No ``v`` is the current version; a ``v`` that is
    not a number is left to the model to refuse."""
    if isinstance(v, int) and not isinstance(v, bool) and not 1 <= v <= SCHEMA_VERSION:
        raise (NewerWriter if v > SCHEMA_VERSION else DecodeError)(
            f"{model.__name__} has schema version {v}; this jetloop reads versions 1 to "
            f"{SCHEMA_VERSION}"
        )
