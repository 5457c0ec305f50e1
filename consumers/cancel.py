"""Cancelling a turn: no new step starts, running tasks are cancelled, the turn ends.

``Control.cancel`` marks the turn ``cancelled`` with a CAS on its record — so a RunModel
or join still running loses its next CAS and stops — and publishes this step, which
settles the calls still open (cancelling their tasks) and moves the session on. Tools
that are running see ``ctx.cancelled`` at their next heartbeat.
"""

from __future__ import annotations

import structlog

from consumers.calls import ToolCtx
from consumers.errors import RetryLater
from consumers.followers import finished
from consumers.runtime import Delivery
from schemas import (
    CallOutcome,
    CallRecord,
    CallState,
    Event,
    EventType,
    StepMessage,
    TurnPhase,
    TurnStatus,
    call_key,
)
from streams.bus import event_out
from streams.state import Conflict, call_state_key

log = structlog.get_logger("jetloop.cancel")


async def on_cancel_turn(d: Delivery, step: StepMessage) -> None:
    rt = d.rt
    sid, tid = step.session_id, step.turn_id
    cur = await rt.state.turn(sid, tid)
    if cur is None or cur.value.status != TurnStatus.CANCELLED:
        return
    turn = cur.value
    agent = rt.app.agent(turn.agent)
    events = []
    if turn.phase == TurnPhase.CALLS:
        for c in turn.calls:
            ckey = call_key(sid, tid, turn.model_step, c.index)
            rec_v = await rt.state.call(ckey)
            if rec_v is not None and rec_v.value.done:
                continue
            rec = (
                rec_v.value
                if rec_v
                else CallRecord(key=ckey, tool=c.tool, effect=c.effect, state=CallState.RUNNING)
            )
            tool = agent.tool(c.tool) if agent else None
            if rec.state == CallState.TASK_RUNNING and tool is not None and tool.cancel:
                if agent is None:
                    raise RetryLater(5.0, f"agent {turn.agent!r} is not served here")
                await tool.cancel(rec.task_handle, ToolCtx(d, c, rec.attempts))
                log.info("task.cancelled", call=ckey)
            done = rec.model_copy(
                update={
                    "state": CallState.CANCELLED,
                    "outcome": CallOutcome(
                        state=CallState.CANCELLED,
                        error=f"the turn was cancelled by {turn.cancelled_by}",
                    ),
                    "attempt": None,
                    "settlement": "cancelled",
                }
            )
            try:
                await rt.state.write(call_state_key(ckey), done, rec_v.revision if rec_v else None)
            except Conflict:
                raise RetryLater(0.05, "a call changed while cancelling") from None
            events.append(
                event_out(
                    Event(
                        key=f"call.{ckey}.outcome",
                        type=EventType.CALL_OUTCOME,
                        session_id=sid,
                        turn_id=tid,
                        data={
                            "call_key": ckey,
                            "tool": c.tool,
                            "state": "cancelled",
                            "effect": c.effect,
                            "attempts": rec.attempts,
                            "settlement": "cancelled",
                        },
                    )
                )
            )
    await rt.bus.publish(events)
    await finished(turn).publish(rt.bus)
