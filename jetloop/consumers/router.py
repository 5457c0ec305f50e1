"""From a delivered message to the handler of its kind."""

from __future__ import annotations

from jetloop.consumers.call_tool import on_call
from jetloop.consumers.closing import on_close_turn, reject_untrusted
from jetloop.consumers.compact import on_compact
from jetloop.consumers.errors import DeadLetter
from jetloop.consumers.join import on_join
from jetloop.consumers.run_model import on_run_model
from jetloop.consumers.runtime import Delivery
from jetloop.consumers.session import on_turn_done, on_turn_request
from jetloop.schemas import CALL_KINDS, StepKind, StepMessage, decode
from jetloop.streams.seal import SealBroken
from jetloop.streams.topology import step_subject_parts


async def route_turn(d: Delivery) -> None:
    await on_turn_request(d)


async def route_step(d: Delivery) -> None:
    step = decode(StepMessage, d.msg.data)
    if step_subject_parts(d.msg.subject) != [step.agent, step.kind.value, step.session_id]:
        raise DeadLetter(
            f"step subject {d.msg.subject!r} does not match its body "
            f"({step.kind.value} of session {step.session_id}, agent {step.agent})"
        )
    try:
        await _route(d, step)
    except SealBroken as exc:
        await reject_untrusted(d, step, exc)


async def _route(d: Delivery, step: StepMessage) -> None:
    if step.kind in CALL_KINDS:
        await on_call(d, step)
        return
    match step.kind:
        case StepKind.RUN_MODEL:
            await on_run_model(d, step)
        case StepKind.COMPACT_CONTEXT:
            await on_compact(d, step)
        case StepKind.JOIN:
            await on_join(d, step)
        case StepKind.TURN_DONE:
            await on_turn_done(d, step)
        case StepKind.CLOSE_TURN:
            await on_close_turn(d, step)
