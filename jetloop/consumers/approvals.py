"""AwaitToolApproval: a call held for a person's decision, waiting in state, holding nothing.

The approval record ``approval.<sid>.<approval id>`` is created only if absent, its id
derived from the call, so routing a call again (after a crash, a redelivery) coalesces
with the request already waiting, and a decision taken meanwhile is read, not asked twice.
The policy is read as it stands now (tool policy, then the session's override); a call
once routed for approval stays routed.
"""

from __future__ import annotations

import time
from enum import Enum

import structlog

from jetloop.consumers import metrics
from jetloop.consumers.calls import CallEnv, settle, write
from jetloop.consumers.tracing import wait_ended
from jetloop.schemas import (
    ApprovalRecord,
    CallOutcome,
    CallState,
    Decision,
    Event,
    approval_id_for,
)
from jetloop.schemas.events import ApprovalRequestedData
from jetloop.streams.bus import event_out
from jetloop.streams.state import Conflict, approval_key

log = structlog.get_logger("jetloop.approvals")


class Gate(Enum):
    WAIT = "wait"  # held for a decision: nothing more to do now
    DONE = "done"  # the call got its outcome (denied)


def denial(approval: ApprovalRecord) -> CallOutcome:
    """The outcome of a rejected call: who denied it, and why when they said."""
    why = f"denied by {approval.decided_by or 'a person'}"
    if approval.reason:
        why += f": {approval.reason}"
    return CallOutcome(state=CallState.DENIED, error=why)


async def required(env: CallEnv) -> bool:
    if env.rec.approval_id is not None:
        return True
    session = env.session
    override = session.approval_overrides.get(env.tool.name) if session else None
    if override is not None:
        return override
    return env.tool.needs_approval(env.tool_args())


async def gate(env: CallEnv) -> Gate | CallEnv:
    if not await required(env):
        return env
    rt, sid = env.rt, env.turn.session_id
    aid = approval_id_for(env.ckey)
    found = await rt.state.approval(sid, aid)
    if found is None:
        record = ApprovalRecord(
            approval_id=aid,
            session_id=sid,
            turn_id=env.turn.turn_id,
            model_step=env.n,
            call_index=env.call.index,
            call_key=env.ckey,
            tool=env.call.tool,
            args=env.call.args,
            requested_at=time.time(),
            pool=env.call.pool,
        )
        try:
            await rt.state.write(approval_key(sid, aid), record, None)
            approval = record
        except Conflict:
            again = await rt.state.approval(sid, aid)
            assert again is not None
            approval = again.value
    else:
        approval = found.value

    if approval.status == Decision.PENDING:
        if env.rec.state != CallState.AWAITING_APPROVAL:
            await write(
                env,
                env.rec.model_copy(
                    update={"state": CallState.AWAITING_APPROVAL, "approval_id": aid}
                ),
            )
        event = Event.of(
            ApprovalRequestedData(
                approval_id=aid, call_key=env.ckey, tool=env.call.tool, args=env.call.args
            ),
            key=f"call.{env.ckey}.approval.requested",
            session_id=sid,
            turn_id=env.turn.turn_id,
        )
        await rt.bus.publish([event_out(event)])
        if env.rec.state != CallState.AWAITING_APPROVAL:
            metrics.APPROVALS_ASKED.inc()
        log.info("call.awaiting_approval", approval_id=aid)
        return Gate.WAIT
    if env.rec.state == CallState.AWAITING_APPROVAL:
        # Counted where the held call resumes, whoever decided: a CLI or another short-lived
        # process that decides is gone before anything scrapes its counters.
        metrics.APPROVALS_DECIDED.inc()
        wait_ended(
            rt.tracing,
            env.turn,
            env.n,
            env.call,
            "approval",
            approval.requested_at,
            {
                "jetloop.decision": approval.status.value,
                "jetloop.decided_by": approval.decided_by or "",
            },
        )
    if approval.status == Decision.REJECTED:
        await settle(env, denial(approval), "denied", approval_id=aid)
        return Gate.DONE
    if env.rec.approval_id is None:
        return env.with_rec(env.rec.model_copy(update={"approval_id": aid}), env.rev)
    return env
