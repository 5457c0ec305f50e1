"""CallTool and CallSingleAttemptTool: make one planned call, at most as often as it may be.

The call record ``call.<sid>.<tid>.<step>.<index>`` is the one key this step commits. The
claim of a write is its in-doubt mark, written just before the tool is made; a read is
never marked. An attempt that finds the mark of a lost attempt settles the call
(ARCHITECTURE.md): a read or an idempotent write is made again (same idempotency key), any
other write is recorded ``outcome_unknown`` and never sent again.
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog
from pydantic import BaseModel

from agents import Effect, RetryableToolError, ToolError
from consumers.errors import DeadLetter, RetryLater, TakenOver
from consumers.followers import call_done
from consumers.runtime import Delivery, Runtime
from schemas import (
    CallOutcome,
    CallRecord,
    CallState,
    PlannedCall,
    StepMessage,
    TurnPhase,
    TurnRecord,
    call_key,
)
from streams.state import call_state_key

log = structlog.get_logger("jetloop.call_tool")

TOOL_CALL_NOT_RUN_ERROR_PREFIX = "the tool did not run, so it is safe to call again"
NOT_SENT_AGAIN = (
    "the outcome of this call is unknown: its worker stopped while it ran, and it was not "
    "sent again"
)


class _Ctx:
    """The ``ToolContext`` a tool receives."""

    def __init__(self, d: Delivery, call: PlannedCall, attempt: int) -> None:
        self._d = d
        self._call = call
        self._attempt = attempt

    @property
    def call_id(self) -> str:
        return self._call.call_id

    @property
    def idempotency_key(self) -> str:
        return self._call.idempotency_key

    @property
    def attempt(self) -> int:
        return self._attempt

    async def heartbeat(self) -> None:
        await self._d.heartbeat()


async def on_call_tool(d: Delivery, step: StepMessage) -> None:
    rt = d.rt
    sid, tid, n = step.session_id, step.turn_id, step.model_step
    if step.call_index is None:
        raise DeadLetter("call_tool step without call_index")
    i = step.call_index
    ckey = call_key(sid, tid, n, i)
    skey = call_state_key(ckey)
    structlog.contextvars.bind_contextvars(call=ckey)

    turn_v = await rt.state.turn(sid, tid)
    if turn_v is None:
        raise DeadLetter(f"call_tool for turn {tid} of session {sid}, which has no record")
    turn = turn_v.value
    rec_v = await rt.state.call(ckey)
    rec = rec_v.value if rec_v else None
    current = turn.model_step == n and turn.phase == TurnPhase.CALLS
    if rec is not None and rec.done:
        if current:
            await call_done(turn, n, i, rec).publish(rt.bus)
        return
    if not current:
        # The turn moved on (or ended) without this call: nothing to make.
        log.info("call.stale_step", turn_step=turn.model_step, phase=turn.phase.value)
        return
    if i >= len(turn.calls):
        raise DeadLetter(f"call index {i} is out of range for step {n} of turn {tid}")
    call = turn.calls[i]
    revision = rec_v.revision if rec_v else None

    if call.invalid is not None:
        outcome = CallOutcome(
            state=CallState.FAILED, error=f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: {call.invalid}"
        )
        await _settle(d, turn, n, i, _record(ckey, call, rec), outcome, revision, "invalid")
        return

    agent = rt.app.agent(turn.agent)
    tool = agent.tool(call.tool) if agent else None
    if tool is None:
        raise RetryLater(5.0, f"tool {call.tool!r} of agent {turn.agent!r} is not served here")
    # A call once marked as a write stays a write: the checkpointed effect decides.
    effect = Effect(call.effect)

    if rec is not None and rec.state == CallState.IN_DOUBT and rec.attempt is not None:
        if effect == Effect.NON_IDEMPOTENT_WRITE:
            outcome = CallOutcome(state=CallState.OUTCOME_UNKNOWN, error=NOT_SENT_AGAIN)
            await _settle(d, turn, n, i, rec, outcome, revision, "outcome_unknown")
            return
        log.info("call.resume", settlement="made again with the same idempotency key")

    prior = rec.attempts if rec else 0
    first_at = rec.first_attempt_at if rec and rec.first_attempt_at else time.time()
    if prior >= tool.max_attempts or time.time() - first_at > tool.attempt_window_seconds:
        await _settle(
            d,
            turn,
            n,
            i,
            _record(ckey, call, rec),
            _exhausted(rec, effect),
            revision,
            "attempts_exhausted",
        )
        return

    await rt.faults.point("call_tool.before_mark")
    attempt = rt.new_attempt(prior + 1)
    base = _record(ckey, call, rec)
    marked = base.model_copy(
        update={
            "state": CallState.IN_DOUBT if effect.is_write else CallState.RUNNING,
            "attempt": attempt,
            "attempts": attempt.no,
            "marked": base.marked + (1 if effect.is_write else 0),
            "first_attempt_at": first_at,
        }
    )
    await d.claim(skey, marked, revision)
    structlog.contextvars.bind_contextvars(attempt=attempt.no)

    await rt.faults.point("call_tool.in_tool")
    if not await d.still_ours():
        # Stalled past the lease between the mark and the call: another attempt owns it.
        raise TakenOver(skey)
    try:
        args = tool.args_model.model_validate(call.args)
        result = await tool.fn(args, _Ctx(d, call, attempt.no))
    except ToolError as exc:
        outcome = CallOutcome(state=CallState.FAILED, error=str(exc))
    except Exception as exc:
        retryable = isinstance(exc, RetryableToolError) or effect != Effect.NON_IDEMPOTENT_WRITE
        if retryable and attempt.no < tool.max_attempts:
            # The attempt ended with a known failure (it was not lost): say so in state, so
            # the next attempt makes the call again instead of settling it.
            log.warning("tool.failed", error=str(exc), will_retry=True)
            await d.commit(marked.model_copy(update={"attempt": None}))
            raise RetryLater(min(30.0, 0.5 * 2 ** (attempt.no - 1)), str(exc)) from exc
        log.warning("tool.failed", error=str(exc), will_retry=False)
        if effect.is_write:
            outcome = CallOutcome(
                state=CallState.OUTCOME_UNKNOWN, error=f"{type(exc).__name__}: {exc}"
            )
        else:
            outcome = CallOutcome(state=CallState.FAILED, error=f"{type(exc).__name__}: {exc}")
    else:
        outcome = await _succeeded(rt, ckey, attempt.no, result)

    await rt.faults.point("call_tool.before_commit")
    done = marked.model_copy(update={"state": outcome.state, "outcome": outcome, "attempt": None})
    await d.commit(done)
    log.info("call.recorded", state=outcome.state.value)
    await rt.faults.point("call_tool.after_commit")
    await call_done(turn, n, i, done).publish(rt.bus)


def _record(ckey: str, call: PlannedCall, rec: CallRecord | None) -> CallRecord:
    if rec is not None:
        return rec
    return CallRecord(key=ckey, tool=call.tool, effect=call.effect, state=CallState.RUNNING)


def _exhausted(rec: CallRecord | None, effect: Effect) -> CallOutcome:
    attempts = rec.attempts if rec else 0
    if attempts == 0:
        # No attempt was ever claimed (the claim of a write is its in-doubt mark): the tool
        # provably did not run.
        err = f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: no attempt of {attempts} reached the tool"
        return CallOutcome(state=CallState.FAILED, error=err)
    if effect.is_write:
        return CallOutcome(
            state=CallState.OUTCOME_UNKNOWN,
            error=f"every attempt ({attempts}) failed or was lost; the write may have applied",
        )
    return CallOutcome(state=CallState.FAILED, error=f"every attempt ({attempts}) failed")


async def _settle(
    d: Delivery,
    turn: TurnRecord,
    n: int,
    i: int,
    rec: CallRecord,
    outcome: CallOutcome,
    revision: int | None,
    settlement: str,
) -> None:
    """Record an outcome without making the call (a settlement), fenced like any write."""
    done = rec.model_copy(
        update={
            "state": outcome.state,
            "outcome": outcome,
            "attempt": None,
            "settlement": settlement,
        }
    )
    await d.claim(call_state_key(rec.key), done, revision)
    log.info("call.settled", state=outcome.state.value, settlement=settlement)
    await call_done(turn, n, i, done).publish(d.rt.bus)


def to_jsonable(result: Any) -> Any:
    if isinstance(result, BaseModel):
        return result.model_dump(mode="json")
    return result


async def _succeeded(rt: Runtime, ckey: str, attempt: int, result: Any) -> CallOutcome:
    value = to_jsonable(result)
    raw = json.dumps(value).encode()
    if rt.blobs.too_big(raw):
        ref = await rt.blobs.put(f"call.{ckey}.a{attempt}", raw)
        return CallOutcome(state=CallState.SUCCEEDED, result_ref=ref)
    return CallOutcome(state=CallState.SUCCEEDED, result=value)
