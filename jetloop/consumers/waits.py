"""AwaitQuestionAnswer and AwaitTimer: waits that live in state and schedules, not workers.

A question is a record ``question.<sid>.<question id>``; the answer resumes the call. A
timer is a NATS message schedule (``Nats-Schedule: @at …``) on a subject of its own whose
target is the call's ``await_timer`` step: the due time is recorded once, so a crash never
moves it, and a timer that came due while the server was down fires when it is back.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime

import structlog

from jetloop.agents.tools import AskUserArgs, WaitArgs
from jetloop.consumers.calls import CallEnv, settle, write
from jetloop.consumers.errors import RetryLater
from jetloop.consumers.tracing import wait_ended
from jetloop.schemas import (
    CallOutcome,
    CallState,
    Event,
    QuestionRecord,
    StepKind,
    StepMessage,
    encode,
    question_id_for,
)
from jetloop.schemas.events import QuestionAskedData, TimerFiredData, TimerSetData
from jetloop.streams.bus import Outgoing, event_out, headers, subject_of
from jetloop.streams.state import Conflict, question_key
from jetloop.streams.topology import timer_subject

log = structlog.get_logger("jetloop.waits")


async def ask(env: CallEnv) -> None:
    rt, sid = env.rt, env.turn.session_id
    args = AskUserArgs.model_validate(env.call.args)
    qid = question_id_for(env.ckey)
    if await rt.state.question(sid, qid) is None:
        record = QuestionRecord(
            question_id=qid,
            session_id=sid,
            turn_id=env.turn.turn_id,
            model_step=env.n,
            call_index=env.call.index,
            call_key=env.ckey,
            question=args.question,
            asked_at=time.time(),
        )
        try:
            await rt.state.write(question_key(sid, qid), record, None)
        except Conflict:
            pass  # asked already by another attempt: the same question
    env = await write(
        env, env.rec.model_copy(update={"state": CallState.AWAITING_ANSWER, "question_id": qid})
    )
    await rt.bus.publish([_asked(env, qid, args.question)])
    log.info("call.awaiting_answer", question_id=qid)


def _asked(env: CallEnv, qid: str, question: str) -> Outgoing:
    return event_out(
        Event.of(
            QuestionAskedData(question_id=qid, question=question, call_key=env.ckey),
            key=f"call.{env.ckey}.question.asked",
            session_id=env.turn.session_id,
            turn_id=env.turn.turn_id,
        )
    )


async def answer_ready(env: CallEnv) -> None:
    assert env.rec.question_id is not None
    q = await env.rt.state.question(env.turn.session_id, env.rec.question_id)
    if q is None or not q.value.answered:
        # Still waiting, holding nothing; make sure the question was told (a redelivery).
        args = AskUserArgs.model_validate(env.call.args)
        await env.rt.bus.publish([_asked(env, env.rec.question_id, args.question)])
        return
    await env.rt.faults.point("call_tool.wait_over")
    await settle(
        env,
        CallOutcome(state=CallState.SUCCEEDED, result={"answer": q.value.answer}),
        "answered",
    )
    wait_ended(env.rt.tracing, env.turn, env.n, env.call, "answer", q.value.asked_at)


def _at(due: float) -> str:
    return datetime.fromtimestamp(math.ceil(due), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _schedule_at(due: float) -> str:
    """The schedule's time, to the millisecond and never before ``due``: a schedule rounded
    up to the whole second fired 0.5 s late on average (measured: 0.55 s, against 0.02 s
    with milliseconds)."""
    ms = math.ceil(due * 1000)
    at = datetime.fromtimestamp(ms // 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{at}.{ms % 1000:03d}Z"


async def _arm(env: CallEnv, due: float) -> None:
    """Publish the timer's schedule; its key makes a repeat a no-op while it waits."""
    wake = StepMessage(
        kind=StepKind.AWAIT_TIMER,
        agent=env.turn.agent,
        session_id=env.turn.session_id,
        turn_id=env.turn.turn_id,
        model_step=env.n,
        call_index=env.call.index,
    )
    hdrs = headers(StepKind.AWAIT_TIMER.value, wake.session_id, wake.turn_id, wake.step_key())
    hdrs["Nats-Msg-Id"] = f"{wake.step_key()}.schedule"
    hdrs["Nats-Schedule"] = f"@at {_schedule_at(due)}"
    hdrs["Nats-Schedule-Target"] = subject_of(wake)
    await env.rt.js.publish(
        timer_subject(env.turn.session_id, env.ckey), encode(wake), headers=hdrs
    )


async def set_timer(env: CallEnv) -> None:
    args = WaitArgs.model_validate(env.call.args)
    due = time.time() + max(0.0, args.seconds)
    env = await write(
        env, env.rec.model_copy(update={"state": CallState.WAITING_TIMER, "timer_due": due})
    )
    await _arm(env, due)
    await env.rt.bus.publish([_timer_set(env, due)])
    log.info("timer.set", due=due)


def _timer_set(env: CallEnv, due: float) -> Outgoing:
    return event_out(
        Event.of(
            TimerSetData(call_key=env.ckey, due=due, at=_at(due)),
            key=f"call.{env.ckey}.timer.set",
            session_id=env.turn.session_id,
            turn_id=env.turn.turn_id,
        )
    )


async def timer_due(env: CallEnv) -> None:
    due = env.rec.timer_due
    assert due is not None
    early = due - time.time()
    if 0 < early <= env.rt.lease_seconds:
        # Nearly due (a server clock a little ahead of ours fired the schedule early): wait
        # here. Arming again would publish the schedule's message id once more, which the
        # stream may still remember as a duplicate, and then nothing would wake the call.
        raise RetryLater(early + 0.01, "the timer is not due yet")
    if early > 0:
        # Not due (a redelivery of the call step): make sure the schedule is there.
        await _arm(env, due)
        await env.rt.bus.publish([_timer_set(env, due)])
        return
    event = Event.of(
        TimerFiredData(call_key=env.ckey, due=due, late_seconds=round(time.time() - due, 3)),
        key=f"call.{env.ckey}.timer.fired",
        session_id=env.turn.session_id,
        turn_id=env.turn.turn_id,
    )
    args = WaitArgs.model_validate(env.call.args)
    # The firing is a fact once it is due, so it is told first: a crash after the settle
    # would not tell it again (the call is then done).
    await env.rt.bus.publish([event_out(event)])
    await env.rt.faults.point("call_tool.wait_over")
    await settle(
        env,
        CallOutcome(state=CallState.SUCCEEDED, result={"waited_seconds": args.seconds}),
        "timer_fired",
    )
    wait_ended(env.rt.tracing, env.turn, env.n, env.call, "timer", due - max(0.0, args.seconds))
    log.info("timer.fired")
