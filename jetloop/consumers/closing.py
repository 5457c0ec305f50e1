"""Ending a turn from outside its steps: cancelled, lost too often, or not trusted.

``close_turn`` runs after the turn record was marked ``cancelled`` or ``failed`` by a CAS
(so any RunModel or join still running loses its next CAS and stops). It settles the calls
still open — cancelled ones as ``cancelled`` (cancelling their tasks), those of a failed turn
as their row says (a write in doubt is ``outcome_unknown``, anything else ``failed``) — then
tells the log and moves the session on. Running tools see ``ctx.cancelled``.
"""

from __future__ import annotations

import structlog

from jetloop.agents.tools import DelegateArgs
from jetloop.consumers.calls import TOOL_CALL_NOT_RUN_ERROR_PREFIX, ToolCtx
from jetloop.consumers.delegation import child_request, child_session
from jetloop.consumers.errors import DeadLetter, RetryLater
from jetloop.consumers.followers import Followers
from jetloop.consumers.runtime import Delivery, Runtime
from jetloop.consumers.session import end_turn
from jetloop.schemas import (
    CallOutcome,
    CallRecord,
    CallState,
    Event,
    PlannedCall,
    StepKind,
    StepMessage,
    TurnPhase,
    TurnRecord,
    TurnStatus,
    call_key,
    turn_id_for,
)
from jetloop.schemas.events import CallOutcomeData, CheckpointRejectedData
from jetloop.streams.bus import Bus, event_out, step_out
from jetloop.streams.seal import SealBroken
from jetloop.streams.state import Conflict, StateStore, call_state_key, turn_key

log = structlog.get_logger("jetloop.closing")


def close_step(turn: TurnRecord) -> StepMessage:
    return StepMessage(
        kind=StepKind.CLOSE_TURN, agent=turn.agent, session_id=turn.session_id, turn_id=turn.turn_id
    )


def _closed(rec: CallRecord, turn: TurnRecord, unreadable: str | None = None) -> CallOutcome:
    if unreadable is not None:
        # Nothing the record said can be believed: a write may or may not have been made.
        why = (
            f"the turn was cancelled by {turn.cancelled_by}"
            if turn.status == TurnStatus.CANCELLED
            else f"the turn failed: {turn.error}"
        )
        state = CallState.FAILED if rec.effect == "read" else CallState.OUTCOME_UNKNOWN
        return CallOutcome(state=state, error=f"unreadable record: {unreadable}; {why}")
    if turn.status == TurnStatus.CANCELLED:
        return CallOutcome(
            state=CallState.CANCELLED, error=f"the turn was cancelled by {turn.cancelled_by}"
        )
    why = f"the turn failed: {turn.error}"
    if rec.attempts == 0 or rec.state in (CallState.AWAITING_APPROVAL, CallState.AWAITING_ANSWER):
        return CallOutcome(state=CallState.FAILED, error=f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}; {why}")
    if rec.state in (CallState.IN_DOUBT, CallState.TASK_RUNNING):
        return CallOutcome(state=CallState.OUTCOME_UNKNOWN, error=why)
    return CallOutcome(state=CallState.FAILED, error=why)


async def on_close_turn(d: Delivery, step: StepMessage) -> None:
    rt = d.rt
    sid, tid = step.session_id, step.turn_id
    cur = await rt.state.turn(sid, tid)
    if cur is None or cur.value.status not in (TurnStatus.CANCELLED, TurnStatus.FAILED):
        return
    turn = cur.value
    agent = rt.app.agent(turn.agent)
    events = []
    if turn.phase == TurnPhase.CALLS:
        for c in turn.calls:
            ckey = call_key(sid, tid, turn.model_step, c.index)
            unreadable: str | None = None
            try:
                rec_v = await rt.state.call(ckey)
            except SealBroken as exc:
                # Not trusted (edited, forged, garbage): closed from the plan, over whatever
                # is there, so the turn ends and the record says why.
                unreadable, rec_v = exc.reason, None
            if rec_v is not None and rec_v.value.done:
                continue
            rec = (
                rec_v.value
                if rec_v
                else CallRecord(key=ckey, tool=c.tool, effect=c.effect, state=CallState.RUNNING)
            )
            revision = rec_v.revision if rec_v else None
            if unreadable is not None:
                revision = await rt.state.revision(call_state_key(ckey))
            tool = agent.tool(c.tool) if agent else None
            if turn.status == TurnStatus.CANCELLED and rec.state == CallState.AWAITING_CHILD:
                await _cancel_child(rt, turn, ckey, c)
            if (
                turn.status == TurnStatus.CANCELLED
                and rec.state == CallState.TASK_RUNNING
                and tool is not None
                and tool.cancel
            ):
                await tool.cancel(
                    rec.task_handle, ToolCtx(d, turn, turn.model_step, c, rec.attempts)
                )
                log.info("task.cancelled", call=ckey)
            outcome = _closed(rec, turn, unreadable)
            done = rec.model_copy(
                update={
                    "state": outcome.state,
                    "outcome": outcome,
                    "attempt": None,
                    "settlement": "closed",
                }
            )
            try:
                await rt.state.write(call_state_key(ckey), done, revision)
            except Conflict:
                raise RetryLater(0.05, "a call changed while closing the turn") from None
            events.append(
                event_out(
                    Event.of(
                        CallOutcomeData(
                            call_key=ckey,
                            tool=c.tool,
                            state=outcome.state.value,
                            effect=c.effect,
                            attempts=rec.attempts,
                            settlement="closed",
                            error=outcome.error,
                        ),
                        key=f"call.{ckey}.outcome",
                        session_id=sid,
                        turn_id=tid,
                    )
                )
            )
    await rt.bus.publish(events)
    await end_turn(rt, turn)


async def cancel_turn(
    state: StateStore,
    bus: Bus,
    session_id: str,
    turn_id: str,
    by: str,
    if_absent: TurnRecord | None = None,
) -> TurnRecord | None:
    """Mark a turn cancelled (a CAS) and ask ``close_turn`` to settle what it left open.

    Returns the turn as it now stands: already ended otherwise, it is returned untouched;
    with no record, ``if_absent`` is created cancelled (so a request not accepted yet never
    starts), or None is returned. A repeat is harmless: the close step has a fixed key.
    """
    for _ in range(20):
        found = await state.turn(session_id, turn_id)
        if found is None and if_absent is None:
            return None
        turn = found.value if found is not None else if_absent
        assert turn is not None
        if turn.status.terminal and turn.status != TurnStatus.CANCELLED:
            return turn
        if turn.status != TurnStatus.CANCELLED:
            turn = turn.model_copy(
                update={
                    "status": TurnStatus.CANCELLED,
                    "cancelled_by": by,
                    "error": f"cancelled by {by}",
                    "attempt": None,
                }
            )
            try:
                await state.write(
                    turn_key(session_id, turn_id), turn, found.revision if found else None
                )
            except Conflict:
                continue
            log.info("turn.cancelled", session=session_id, turn=turn_id, by=by)
        await bus.publish([step_out(close_step(turn))])
        return turn
    raise RetryLater(0.05, f"turn {session_id}/{turn_id} kept changing while cancelling it")


async def _cancel_child(rt: Runtime, turn: TurnRecord, ckey: str, call: PlannedCall) -> None:
    """A cancelled turn cancels the child turn its delegation started (and so on down)."""
    args = DelegateArgs.model_validate(call.args)
    sid, rid = child_session(ckey), child_request(ckey)
    tid = turn_id_for(sid, rid)
    absent = TurnRecord(
        session_id=sid, turn_id=tid, agent=args.agent, request_id=rid, text=args.task
    )
    by = f"its parent turn {turn.session_id}/{turn.turn_id} ({turn.cancelled_by})"
    await cancel_turn(rt.state, rt.bus, sid, tid, by, if_absent=absent)
    log.info("delegation.cancelled", child_session=sid, call=ckey)


async def fail_turn(
    rt: Runtime, turn: TurnRecord, revision: int, reason: str, audit: Event
) -> TurnRecord:
    """Mark a turn failed (CAS), audit why, and let ``close_turn`` settle the rest."""
    failed = turn.model_copy(update={"status": TurnStatus.FAILED, "error": reason, "attempt": None})
    try:
        await rt.state.write(turn_key(turn.session_id, turn.turn_id), failed, revision)
    except Conflict:
        raise RetryLater(0.05, "turn changed while failing it") from None
    log.warning("turn.failed", reason=reason)
    await Followers([event_out(audit)], [step_out(close_step(failed))]).publish(rt.bus)
    return failed


async def reject_untrusted(d: Delivery, step: StepMessage, exc: SealBroken) -> None:
    """A checkpoint that does not verify is not run: its turn fails with the reason."""
    rt = d.rt
    raw = await rt.state.turn(step.session_id, step.turn_id, verify=False)
    if raw is None:
        raise DeadLetter(f"{exc}; and its turn has no record")
    if raw.value.status.terminal:
        try:
            await rt.state.turn(step.session_id, step.turn_id)
        except SealBroken:
            pass
        else:
            return  # the turn already ended, sealed: the untrusted record was a call's
    audit = Event.of(
        CheckpointRejectedData(key=exc.key, reason=exc.reason, step=step.step_key()),
        key=f"{step.session_id}.{step.turn_id}.rejected.{raw.revision}",
        session_id=step.session_id,
        turn_id=step.turn_id,
    )
    await fail_turn(rt, raw.value, raw.revision, f"checkpoint not trusted: {exc}", audit)
