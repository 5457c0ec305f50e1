"""PollToolTask: a task tool's handle is recorded exactly once; polls hold no worker.

The start is made like any call of its effect class (claim, in-doubt mark, same key on
every attempt), and its handle is committed in the call record with a CAS, so a crash
never starts a second task. Polls run on their own step message, spaced by a delayed nak:
between two polls the message waits in JetStream and no worker holds anything.
"""

from __future__ import annotations

import copy
from typing import Any

import structlog

from jetloop.agents import TaskDone, TaskFailed
from jetloop.consumers.calls import CallEnv, ToolCtx, settle, succeeded, to_jsonable, write
from jetloop.consumers.errors import RetryLater
from jetloop.consumers.followers import Followers
from jetloop.schemas import CallOutcome, CallState, Event, StepKind, StepMessage
from jetloop.schemas.events import TaskStartedData
from jetloop.streams.bus import Outgoing, event_out, step_out
from jetloop.streams.topology import step_subject_parts

log = structlog.get_logger("jetloop.tasks")


def poll_step(env: CallEnv) -> StepMessage:
    return StepMessage(
        kind=StepKind.POLL_TOOL_TASK,
        agent=env.turn.agent,
        session_id=env.turn.session_id,
        turn_id=env.turn.turn_id,
        model_step=env.n,
        call_index=env.call.index,
    )


async def started(env: CallEnv, handle: Any) -> None:
    """Record the handle (once), then hand the task to its poll step."""
    running = env.rec.model_copy(
        update={
            "state": CallState.TASK_RUNNING,
            "task_handle": to_jsonable(handle),
            "attempt": None,
        }
    )
    env = await write(env, running)
    log.info("task.started", handle=running.task_handle)
    await Followers([_started_event(env, running.task_handle)], [step_out(poll_step(env))]).publish(
        env.rt.bus
    )


def _started_event(env: CallEnv, handle: Any) -> Outgoing:
    return event_out(
        Event.of(
            TaskStartedData(call_key=env.ckey, tool=env.call.tool, handle=handle),
            key=f"call.{env.ckey}.task.started",
            session_id=env.turn.session_id,
            turn_id=env.turn.turn_id,
        )
    )


async def poll(env: CallEnv) -> None:
    """One poll. Pending → try again after the tool's interval (a delayed nak)."""
    tool = env.tool
    assert tool.poll is not None
    if step_subject_parts(env.d.msg.subject)[1] != StepKind.POLL_TOOL_TASK.value:
        # The start step redelivered after the handle was recorded: the poll step carries on.
        await Followers(
            [_started_event(env, env.rec.task_handle)], [step_out(poll_step(env))]
        ).publish(env.rt.bus)
        return
    await env.rt.faults.point("poll_tool_task.in_poll")
    ctx = ToolCtx(env.d, env.turn, env.n, env.call, env.rec.attempts)
    try:
        # A copy: the handle read is shared with the next reader of the record (StateStore).
        result = await tool.poll(copy.deepcopy(env.rec.task_handle), ctx)
    except Exception as exc:
        log.warning("task.poll_failed", error=str(exc))
        raise RetryLater(max(tool.poll_interval, 1.0), f"poll failed: {exc}") from exc
    polls = env.d.num_delivered
    if isinstance(result, TaskDone):
        outcome = await succeeded(env.rt, env.ckey, env.rec.attempts, result.result)
        await settle(env, outcome, "task_done", polls=polls)
    elif isinstance(result, TaskFailed):
        await settle(
            env, CallOutcome(state=CallState.FAILED, error=result.error), "task_failed", polls=polls
        )
    else:
        log.info("task.pending", polls=polls)
        raise RetryLater(tool.poll_interval, "task pending")
