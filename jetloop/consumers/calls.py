"""What every call handler shares: the call in hand, its tool context, and settlement.

A ``CallEnv`` is read from state at the top of each call step (rule 1). ``settle`` records
an outcome without making the call, fenced like any write: a CAS from the revision read.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, replace
from typing import Any

import structlog
from pydantic import BaseModel

from jetloop.agents import Agent, Tool
from jetloop.consumers import metrics
from jetloop.consumers.join import outcome_told_and_joined
from jetloop.consumers.liveness import Takeover
from jetloop.consumers.runtime import Delivery, Runtime
from jetloop.schemas import (
    CallOutcome,
    CallRecord,
    CallState,
    PlannedCall,
    SessionRecord,
    TurnRecord,
)
from jetloop.streams.state import call_state_key

log = structlog.get_logger("jetloop.calls")

TOOL_CALL_NOT_RUN_ERROR_PREFIX = "the tool did not run, so it is safe to call again"
NOT_SENT_AGAIN = (
    "the outcome of this call is unknown: its worker stopped while it ran, and it was not "
    "sent again"
)


@dataclass(frozen=True)
class CallEnv:
    d: Delivery
    turn: TurnRecord
    n: int
    call: PlannedCall
    ckey: str
    rec: CallRecord
    rev: int | None
    agent: Agent
    tool: Tool
    # The session as read with the turn and the call (its approval overrides gate the call).
    session: SessionRecord | None = None
    # Why the attempt the record holds may be taken over (``liveness.holder_lost``), if any.
    takeover: Takeover = Takeover.LOST

    @property
    def rt(self) -> Runtime:
        return self.d.rt

    @property
    def skey(self) -> str:
        return call_state_key(self.ckey)

    def with_rec(self, rec: CallRecord, rev: int | None) -> CallEnv:
        return replace(self, rec=rec, rev=rev)

    def tool_args(self) -> BaseModel:
        """The call's arguments as the tool's model, built from a copy of the checkpointed
        ones: the state store remembers records decoded, and their nested values are shared
        with the next reader, so what a tool (or its approval predicate) changes in place
        must not be what a retry of the call is given."""
        return self.tool.args_model.model_validate(copy.deepcopy(self.call.args))


class ToolCtx:
    """The ``ToolContext`` a tool receives."""

    def __init__(
        self, d: Delivery, turn: TurnRecord, model_step: int, call: PlannedCall, attempt: int
    ) -> None:
        self._d = d
        self._turn = turn
        self._model_step = model_step
        self._call = call
        self._attempt = attempt

    @property
    def namespace(self) -> str:
        return self._d.rt.namespace

    @property
    def session_id(self) -> str:
        return self._turn.session_id

    @property
    def turn_id(self) -> str:
        return self._turn.turn_id

    @property
    def model_step(self) -> int:
        return self._model_step

    @property
    def call_id(self) -> str:
        return self._call.call_id

    @property
    def idempotency_key(self) -> str:
        return self._call.idempotency_key

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def cancelled(self) -> bool:
        return self._d.cancelled

    async def heartbeat(self) -> None:
        await self._d.heartbeat()


def new_record(ckey: str, call: PlannedCall) -> CallRecord:
    return CallRecord(key=ckey, tool=call.tool, effect=call.effect, state=CallState.RUNNING)


async def write(env: CallEnv, rec: CallRecord) -> CallEnv:
    """A fenced write of the call record: the first is a claim, later ones commits."""
    if env.d.fence_key == env.skey:
        rev = await env.d.commit(rec)
    else:
        rev = await env.d.claim(env.skey, rec, env.rev)
    return env.with_rec(rec, rev)


async def settle(env: CallEnv, outcome: CallOutcome, settlement: str, **extra: Any) -> None:
    """Record the call's outcome, tell the log, then join: move the turn on if this was
    the step's last open call."""
    done = _done(env.rec, outcome, settlement, extra)
    await write(env, done)
    if outcome.state == CallState.OUTCOME_UNKNOWN:
        metrics.OUTCOME_UNKNOWN.inc()
    log.info("call.recorded", state=outcome.state.value, settlement=settlement)
    await outcome_told_and_joined(env.d, env.turn, done, env.n, env.call.index)


async def settle_record(
    d: Delivery,
    turn: TurnRecord,
    n: int,
    index: int,
    rec: CallRecord,
    rev: int | None,
    outcome: CallOutcome,
    settlement: str,
) -> None:
    """``settle`` for a call that has no tool to run (invalid, or its turn was cancelled)."""
    done = _done(rec, outcome, settlement, {})
    await d.claim(call_state_key(rec.key), done, rev)
    log.info("call.recorded", state=outcome.state.value, settlement=settlement)
    await outcome_told_and_joined(d, turn, done, n, index)


def _done(
    rec: CallRecord, outcome: CallOutcome, settlement: str, extra: dict[str, Any]
) -> CallRecord:
    return rec.model_copy(
        update={
            "state": outcome.state,
            "outcome": outcome,
            "attempt": None,
            "settlement": settlement,
            **extra,
        }
    )


def to_jsonable(result: Any) -> Any:
    if isinstance(result, BaseModel):
        return result.model_dump(mode="json")
    return result


async def succeeded(rt: Runtime, ckey: str, attempt: int, result: Any) -> CallOutcome:
    """A success, with a large result moved to the blob store."""
    value = to_jsonable(result)
    raw = json.dumps(value).encode()
    if rt.blobs.too_big(raw):
        ref = await rt.blobs.put(f"call.{ckey}.a{attempt}", raw)
        return CallOutcome(state=CallState.SUCCEEDED, result_ref=ref)
    return CallOutcome(state=CallState.SUCCEEDED, result=value)


def exhausted(rec: CallRecord, is_write: bool) -> CallOutcome:
    """Every attempt failed or was lost: a read failed, a write's outcome is unknown."""
    if rec.attempts == 0:
        # No attempt was ever claimed (the claim of a write is its in-doubt mark): the tool
        # provably did not run.
        return CallOutcome(
            state=CallState.FAILED,
            error=f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: no attempt reached the tool",
        )
    if is_write:
        return CallOutcome(
            state=CallState.OUTCOME_UNKNOWN,
            error=f"every attempt ({rec.attempts}) failed or was lost; the write may have applied",
        )
    return CallOutcome(state=CallState.FAILED, error=f"every attempt ({rec.attempts}) failed")


def window_passed(rec: CallRecord, tool: Tool) -> bool:
    return (
        rec.first_attempt_at is not None
        and time.time() - rec.first_attempt_at > tool.attempt_window_seconds
    )
