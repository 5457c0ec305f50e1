"""The ids a step's log lines carry (docs/design.md, convention 5), bound once per step in
one context variable.

structlog's ``bind_contextvars`` keeps a context variable per key and ``clear_contextvars``
walks the whole context: for the six ids ``dispatch`` binds on every step that was about 3%
of a busy worker's CPU, paid whether or not the step logged a line (docs/performance.md,
issue 15). Here a step sets one mapping; ``merge_step`` (a structlog processor in the chain
of ``jetloop.services.logs``) adds it to a line only when one is written, so warnings and errors
carry the same ids as before and a step that logs nothing pays one ``set``.

Each step runs in its own task, whose context is a copy of its parent's: what a step binds
is seen by the tasks it starts and never by another step.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

from structlog.types import EventDict, WrappedLogger

_STEP: ContextVar[dict[str, Any] | None] = ContextVar("jetloop_step_log", default=None)


def start_step(**ids: Any) -> Token[dict[str, Any] | None]:
    """Bind a step's ids; ``end_step`` with the token unbinds them."""
    return _STEP.set(ids)


def bind_step(**ids: Any) -> None:
    """Add ids the step learns as it goes (its turn, its call, its attempt). A new mapping,
    not an update: a task the step started earlier keeps the ids it saw."""
    current = _STEP.get()
    _STEP.set({**current, **ids} if current else ids)


def end_step(token: Token[dict[str, Any] | None]) -> None:
    _STEP.reset(token)


def step_ids() -> dict[str, Any]:
    """The ids bound now (a copy)."""
    return dict(_STEP.get() or {})


def merge_step(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    """structlog processor: the step's ids first, then the line's own fields (which win)."""
    ids = _STEP.get()
    if not ids:
        return event
    merged = dict(ids)
    merged.update(event)
    return merged
