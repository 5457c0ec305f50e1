"""What people and readers do to a session: decide approvals, answer questions, cancel a
turn, reconcile an ``outcome_unknown`` call, set approval policies, read a snapshot.

One implementation, used by the Python client directly and by the worker's NATS
request/reply service (``jetloop.services.control``). Every change is a CAS on the record and then
a publish of the step that moves the turn on, keyed by identity: repeating a request
(after a timeout, a crash) re-publishes the same step and returns the recorded result.
The first decision wins: another decision on a decided approval or answered question (a
reject after an approve, another answer) is refused with 409 and the recorded one in its
detail, never answered as if it had been applied.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import structlog
from pydantic import BaseModel

from jetloop.consumers.closing import cancel_turn
from jetloop.consumers.errors import RetryLater
from jetloop.consumers.followers import note
from jetloop.schemas import (
    ApprovalRecord,
    CallOutcome,
    CallRecord,
    CallState,
    Decision,
    Event,
    PolicyChange,
    QuestionRecord,
    SessionRecord,
    StepKind,
    StepMessage,
    TurnPhase,
    TurnRecord,
    TurnStatus,
    validate_name,
)
from jetloop.schemas.errors import ControlError
from jetloop.schemas.events import (
    ApprovalDecidedData,
    ApprovalPolicyChangedData,
    CallReconciledData,
    QuestionAnsweredData,
)
from jetloop.streams.bus import Bus, event_out, step_out
from jetloop.streams.seal import SealBroken
from jetloop.streams.state import (
    Conflict,
    StateStore,
    approval_key,
    call_state_key,
    question_key,
    session_key,
)

log = structlog.get_logger("jetloop.control")

CAS_TRIES = 20
# Between two tries of a decision's CAS: a key written by someone else meanwhile is read again
# at once, then less and less often (about 14 s over the 20 tries), so that a decision rides
# out a cluster still settling after a failure (seen: 20 conflicts in a row within
# milliseconds while a node recovered) instead of failing with "kept changing".
BACKOFF_FIRST, BACKOFF_CAP = 0.02, 1.0


async def backoff(attempt: int) -> None:
    await asyncio.sleep(min(BACKOFF_FIRST * 2**attempt, BACKOFF_CAP))


P = ParamSpec("P")
T = TypeVar("T")


def refuses_untrusted(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """A record whose seal does not verify is never acted on: the request is refused (409)
    with the reason, and nothing is written."""

    @functools.wraps(fn)
    async def run(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except SealBroken as exc:
            log.warning("control.untrusted_record", key=exc.key, reason=exc.reason)
            raise ControlError(409, "record not trusted", str(exc)) from None

    return run


class Control:
    def __init__(self, state: StateStore, bus: Bus) -> None:
        self.state = state
        self.bus = bus

    @refuses_untrusted
    async def decide(
        self,
        session_id: str,
        approval_id: str,
        approve: bool,
        by: str,
        reason: str | None = None,
    ) -> ApprovalRecord:
        """Approve or reject a held call; a repeat returns the decision already recorded,
        and the other decision on a decided call is refused (409)."""
        wanted = Decision.APPROVED if approve else Decision.REJECTED
        for attempt in range(CAS_TRIES):
            found = await self.state.approval(session_id, approval_id)
            if found is None:
                raise ControlError(404, "no such approval", f"{session_id}/{approval_id}")
            ap = found.value
            if ap.status == Decision.PENDING:
                ap = ap.model_copy(
                    update={
                        "status": wanted,
                        "decided_by": by,
                        "decided_at": time.time(),
                        "reason": reason,
                    }
                )
                try:
                    await self.state.write(
                        approval_key(session_id, approval_id), ap, found.revision
                    )
                except Conflict:
                    await backoff(attempt)
                    continue
                log.info("approval.decided", approval_id=approval_id, status=ap.status.value, by=by)
            await self._wake(
                ap.session_id,
                ap.turn_id,
                ap.model_step,
                ap.call_index,
                StepKind.AWAIT_TOOL_APPROVAL,
                Event.of(
                    ApprovalDecidedData(
                        approval_id=approval_id,
                        status=ap.status.value,
                        by=ap.decided_by,
                        reason=ap.reason,
                        call_key=ap.call_key,
                    ),
                    key=f"approval.{approval_id}.decided",
                    session_id=ap.session_id,
                    turn_id=ap.turn_id,
                ),
                pool=ap.pool,
            )
            # Woken first even for a refused decision: whoever asks about a decided call
            # makes sure its step is out, in case the decider stopped between the two.
            if ap.status != wanted:
                raise ControlError(
                    409,
                    f"already {ap.status.value}",
                    f"{session_id}/{approval_id} was {ap.status.value} by {ap.decided_by}: "
                    "the first decision wins",
                )
            return ap
        raise ControlError(409, "approval kept changing", approval_id)

    @refuses_untrusted
    async def answer(
        self, session_id: str, question_id: str, answer: str, by: str
    ) -> QuestionRecord:
        """Answer the model's question; the first answer wins, a repeat of it returns it,
        and another answer is refused (409)."""
        for attempt in range(CAS_TRIES):
            found = await self.state.question(session_id, question_id)
            if found is None:
                raise ControlError(404, "no such question", f"{session_id}/{question_id}")
            q = found.value
            if not q.answered:
                q = q.model_copy(
                    update={"answer": answer, "answered_by": by, "answered_at": time.time()}
                )
                try:
                    await self.state.write(question_key(session_id, question_id), q, found.revision)
                except Conflict:
                    await backoff(attempt)
                    continue
            await self._wake(
                q.session_id,
                q.turn_id,
                q.model_step,
                q.call_index,
                StepKind.AWAIT_QUESTION_ANSWER,
                Event.of(
                    QuestionAnsweredData(
                        question_id=question_id,
                        answer=q.answer,
                        by=q.answered_by,
                        call_key=q.call_key,
                    ),
                    key=f"question.{question_id}.answered",
                    session_id=q.session_id,
                    turn_id=q.turn_id,
                ),
            )
            if q.answer != answer:  # woken first, as for an approval
                raise ControlError(
                    409,
                    "already answered",
                    f"{session_id}/{question_id} was answered {_short(q.answer)} by "
                    f"{q.answered_by}: the first answer wins",
                )
            return q
        raise ControlError(409, "question kept changing", question_id)

    async def _wake(
        self,
        sid: str,
        tid: str,
        n: int,
        i: int,
        kind: StepKind,
        event: Event,
        pool: str | None = None,
    ) -> None:
        await self.bus.publish([event_out(event)])
        # The step goes to the workers of the session's agent: the subject names it.
        session = await self.state.session(sid)
        if session is None:
            raise ControlError(404, "no such session", sid)
        step = StepMessage(
            kind=kind,
            agent=session.value.agent,
            session_id=sid,
            turn_id=tid,
            model_step=n,
            call_index=i,
            pool=pool,  # a call of a tool served by a pool of its own wakes there
        )
        await self.bus.publish([step_out(step)])

    @refuses_untrusted
    async def cancel(self, session_id: str, turn_id: str | None, by: str) -> TurnRecord:
        """Cancel a turn (default: the session's running turn), and the child turns its
        delegations started."""
        if turn_id is None:
            sv = await self.state.session(session_id)
            if sv is None or sv.value.active is None:
                raise ControlError(409, "no running turn", f"session {session_id} is idle")
            turn_id = sv.value.active
        try:
            turn = await cancel_turn(self.state, self.bus, session_id, turn_id, by)
        except RetryLater:
            raise ControlError(409, "turn kept changing", session_id) from None
        if turn is None:
            raise ControlError(404, "no such turn", f"{session_id}/{turn_id}")
        if turn.status != TurnStatus.CANCELLED:
            raise ControlError(409, f"the turn already {turn.status.value}", turn_id)
        return turn

    @refuses_untrusted
    async def reconcile(
        self,
        call_key: str,
        succeeded: bool,
        by: str,
        result: Any = None,
        error: str | None = None,
    ) -> CallRecord:
        """Settle an ``outcome_unknown`` call as succeeded or failed; audited, and the
        session's next turn sees it."""
        for attempt in range(CAS_TRIES):
            found = await self.state.call(call_key)
            if found is None:
                raise ControlError(404, "no such call", call_key)
            rec = found.value
            if rec.state != CallState.OUTCOME_UNKNOWN:
                if rec.reconciled_by is not None:
                    return rec
                raise ControlError(
                    409,
                    "only an outcome_unknown call can be reconciled",
                    f"{call_key} is {rec.state.value}",
                )
            state = CallState.SUCCEEDED if succeeded else CallState.FAILED
            done = rec.model_copy(
                update={
                    "state": state,
                    "outcome": CallOutcome(
                        state=state, result=result, error=None if succeeded else (error or "failed")
                    ),
                    "reconciled_by": by,
                    "reconciled_at": time.time(),
                    "settlement": "reconciled",
                }
            )
            try:
                await self.state.write(call_state_key(call_key), done, found.revision)
            except Conflict:
                await backoff(attempt)
                continue
            sid, tid = call_key.split(".")[:2]
            what = f"succeeded with result {result!r}" if succeeded else f"failed: {error}"
            await self.bus.publish(
                [
                    event_out(
                        Event.of(
                            CallReconciledData(
                                call_key=call_key,
                                state=state.value,
                                by=by,
                                result=result,
                                error=error,
                            ),
                            key=f"call.{call_key}.reconciled",
                            session_id=sid,
                            turn_id=tid,
                        )
                    ),
                    note(
                        sid,
                        tid,
                        f"call.{call_key}.reconciled.note",
                        f"The call of {rec.tool} ({call_key}) whose outcome was unknown was "
                        f"reconciled by {by}: it {what}.",
                    ),
                ]
            )
            await self._join_after_reconcile(call_key)
            return done
        raise ControlError(409, "call kept changing", call_key)

    async def _join_after_reconcile(self, call_key: str) -> None:
        """A reconciled record is written after its step's join elected the call committed
        last (``consumers.join``): while the turn still waits at that step (other calls
        open), a join message of this call makes sure the last outcome in moves it on."""
        sid, tid, n, i = call_key.split(".")[:4]
        found = await self.state.turn(sid, tid)
        if found is None:
            return
        turn = found.value
        if turn.status.terminal or turn.phase != TurnPhase.CALLS or str(turn.model_step) != n:
            return
        join = StepMessage(
            kind=StepKind.JOIN,
            agent=turn.agent,
            session_id=sid,
            turn_id=tid,
            model_step=turn.model_step,
            call_index=int(i),
        )
        await self.bus.publish([step_out(join)])

    @refuses_untrusted
    async def set_approval(
        self,
        session_id: str,
        tool: str,
        required: bool | None,
        agent: str | None = None,
        by: str = "nats",
    ) -> SessionRecord:
        """Override a tool's approval policy in one session (None removes the override).
        Audited like every decision: the record keeps who changed it, when and from what
        (``approval_changes``), and an ``approval.policy_changed`` event tells it. Setting what
        is already set changes nothing (and writes no second event)."""
        validate_name("session id", session_id)
        for attempt in range(CAS_TRIES):
            found = await self.state.session(session_id)
            if found is None:
                if agent is None:
                    raise ControlError(404, "no such session", session_id)
                session = SessionRecord(session_id=session_id, agent=agent)
            else:
                session = found.value
            previous = session.approval_overrides.get(tool)
            if found is not None and previous == required:
                last = session.approval_changes.get(tool)
                if last is not None and last.required == required:
                    # A repeat: the event again, in case the changer stopped before it
                    # (the same key, so the stream keeps one).
                    await self._policy_changed(session_id, tool, last)
                return session
            overrides = dict(session.approval_overrides)
            if required is None:
                overrides.pop(tool, None)
            else:
                overrides[tool] = required
            changes = dict(session.approval_changes)
            change = None
            if previous != required:
                change = PolicyChange(required=required, previous=previous, by=by, at=time.time())
                changes[tool] = change
            session = session.model_copy(
                update={"approval_overrides": overrides, "approval_changes": changes}
            )
            try:
                await self.state.write(
                    session_key(session_id), session, found.revision if found else None
                )
            except Conflict:
                await backoff(attempt)
                continue
            if change is not None:
                log.info(
                    "approval_policy.changed",
                    session_id=session_id,
                    tool=tool,
                    required=required,
                    previous=previous,
                    by=by,
                )
                await self._policy_changed(session_id, tool, change)
            return session
        raise ControlError(409, "session kept changing", session_id)

    async def _policy_changed(self, session_id: str, tool: str, change: PolicyChange) -> None:
        data = ApprovalPolicyChangedData(
            tool=tool, required=change.required, previous=change.previous, by=change.by
        )
        # One key per change: the time it was made, to the microsecond, as the record holds it.
        key = f"approval_policy.{tool}.{round(change.at * 1_000_000)}"
        event = Event.of(data, key=key, session_id=session_id, turn_id=None)
        await self.bus.publish([event_out(event.model_copy(update={"at": change.at}))])


def _short(text: str | None, limit: int = 200) -> str:
    """An answer quoted in an error, cut so the error stays one readable line."""
    text = text or ""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)
