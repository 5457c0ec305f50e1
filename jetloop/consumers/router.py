"""From a delivered message to the handler of its kind.

``HANDLER_OF_KIND`` is the engine's half of the one description of a step kind
(``docs/design.md``, "Step kinds"); the wire's half, a kind's pool and key, is
``jetloop.schemas.kinds``. Like that one it is written as a ``match`` ending in
``assert_never``, so the type checker names a kind without a handler, and built over every
``StepKind`` when imported: no kind can fall through the router and be acked unhandled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Final, assert_never

from jetloop.consumers.call_tool import on_call, on_calls
from jetloop.consumers.closing import on_close_turn, reject_untrusted
from jetloop.consumers.compact import on_compact
from jetloop.consumers.errors import DeadLetter
from jetloop.consumers.join import on_join
from jetloop.consumers.run_model import on_run_model
from jetloop.consumers.runtime import Delivery
from jetloop.consumers.session import on_turn_done, on_turn_request
from jetloop.schemas import StepKind, StepMessage, decode
from jetloop.streams.bus import subject_of
from jetloop.streams.seal import SealBroken

StepHandler = Callable[[Delivery, StepMessage], Awaitable[None]]


def _handler(kind: StepKind) -> StepHandler:
    # A match, not a dict literal, so that mypy reports a kind without its handler.
    match kind:
        case StepKind.RUN_MODEL:
            return on_run_model
        case StepKind.COMPACT_CONTEXT:
            return on_compact
        case (
            StepKind.CALL_TOOL
            | StepKind.CALL_SINGLE_ATTEMPT_TOOL
            | StepKind.AWAIT_TOOL_APPROVAL
            | StepKind.AWAIT_QUESTION_ANSWER
            | StepKind.AWAIT_TIMER
            | StepKind.POLL_TOOL_TASK
            | StepKind.AWAIT_DELEGATION
        ):
            # Each wakes one call of a model step; the call handler reads the call's state
            # and does what the state says.
            return on_call
        case StepKind.CALL_TOOLS:
            return on_calls
        case StepKind.JOIN:
            return on_join
        case StepKind.TURN_DONE:
            return on_turn_done
        case StepKind.CLOSE_TURN:
            return on_close_turn
        case _:
            assert_never(kind)


HANDLER_OF_KIND: Final[Mapping[StepKind, StepHandler]] = MappingProxyType(
    {k: _handler(k) for k in StepKind}
)


async def route_turn(d: Delivery) -> None:
    await on_turn_request(d)


async def route_step(d: Delivery) -> None:
    # A kind this code does not know fails here (DecodeError, naming the kind): dead-lettered.
    step = decode(StepMessage, d.msg.data)
    if d.msg.subject != subject_of(step):
        raise DeadLetter(
            f"step subject {d.msg.subject!r} does not match its body "
            f"({step.kind.value} of session {step.session_id}, agent {step.agent}, "
            f"is sent on {subject_of(step)!r})"
        )
    try:
        await HANDLER_OF_KIND[step.kind](d, step)
    except SealBroken as exc:
        await reject_untrusted(d, step, exc)
