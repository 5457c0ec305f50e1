"""CompactContext: when the model's input passes the agent's token budget, summarise once.

The summary covers the history before the current turn; the session stores one summary
(a CAS on ``session.<sid>``) and the model is given it in place of the entries it covers.
Durable history is never deleted. The summary call has the model step's attempt rules; if
every attempt fails the turn fails, and the next message compacts again.
"""

from __future__ import annotations

import time

import structlog

from jetloop.agents import Agent, Message, ModelRequest, rough_tokens
from jetloop.consumers.conversation import conversation
from jetloop.consumers.errors import RetryLater, TakenOver
from jetloop.consumers.followers import Followers
from jetloop.consumers.liveness import holder_lost, own_unstarted
from jetloop.consumers.losses import record_loss, tell_resumed
from jetloop.consumers.runtime import Delivery, Runtime
from jetloop.consumers.session import end_turn
from jetloop.consumers.tracing import answered, model_span
from jetloop.consumers.usage import record_usage, usage_event
from jetloop.schemas import (
    CompactionRecord,
    Event,
    HistoryEntry,
    HistoryRole,
    SessionRecord,
    StepKind,
    StepMessage,
    Summary,
    TurnPhase,
    TurnRecord,
    TurnStatus,
)
from jetloop.schemas.events import ContextCompactedData
from jetloop.streams.bus import event_out, history_out, step_out
from jetloop.streams.state import Conflict, Versioned, compaction_key, session_key, turn_key

log = structlog.get_logger("jetloop.compact")

SUMMARY_INSTRUCTIONS = (
    "Summarise the conversation so far for your own later use: the user's goals, what was "
    "decided, every tool call that changed something and its outcome, and open questions."
)


def turn_start(history: list[HistoryEntry], turn_id: str) -> int:
    for i, e in enumerate(history):
        if e.turn_id == turn_id:
            return i
    return len(history)


def estimate(agent: Agent, messages: list[Message]) -> int:
    fn = getattr(agent.model, "estimate_tokens", None)
    return int(fn(messages)) if callable(fn) else rough_tokens(messages)


async def compaction_needed(
    rt: Runtime,
    agent: Agent,
    turn: TurnRecord,
    messages: list[Message],
    session: Versioned[SessionRecord] | None,
) -> bool:
    """Whether ``messages`` (the conversation, read with ``session``) pass the budget and
    there is history before this turn that no summary covers yet."""
    budget = agent.limits.context_budget_tokens
    assert budget is not None
    if estimate(agent, messages) <= budget:
        return False
    history = await rt.history.read(turn.session_id)
    covered = session.value.summary.covers if session and session.value.summary else 0
    # Only history before this turn is summarised; nothing new to cover → go on as is.
    return turn_start(history, turn.turn_id) > covered


def _step(turn: TurnRecord, kind: StepKind, wake: str | None = None) -> StepMessage:
    return StepMessage(
        kind=kind,
        agent=turn.agent,
        session_id=turn.session_id,
        turn_id=turn.turn_id,
        model_step=turn.model_step,
        wake=wake,
    )


async def compact_first(rt: Runtime, turn: TurnRecord) -> None:
    log.info("context.over_budget")
    await rt.bus.publish([step_out(_step(turn, StepKind.COMPACT_CONTEXT))])


async def on_compact(d: Delivery, step: StepMessage) -> None:
    rt = d.rt
    sid, tid, n = step.session_id, step.turn_id, step.model_step
    cur = await rt.state.turn(sid, tid)
    if cur is None:
        return
    turn = cur.value
    if turn.status.terminal or turn.model_step != n or turn.phase != TurnPhase.MODEL:
        return
    agent = rt.app.agent(turn.agent)
    if agent is None:
        raise RetryLater(5.0, f"agent {turn.agent!r} is not served by this worker")

    history = await rt.history.read(sid)
    covers = turn_start(history, tid)
    session = await rt.state.session(sid)
    assert session is not None
    summary = session.value.summary
    resume = _step(turn, StepKind.RUN_MODEL, wake="compacted")
    if summary is not None and summary.covers >= covers:
        await rt.bus.publish([step_out(resume)])
        return

    comp_v = await rt.state.compaction(sid, tid, n)
    comp = comp_v.value if comp_v else CompactionRecord()
    ckey = compaction_key(sid, tid, n)
    if not comp.done:
        limits = agent.limits
        now = time.time()
        # A summary attempt of this process that never called the model: continued, not
        # counted (``Unstarted``).
        held = comp.attempt
        again = held is not None and await own_unstarted(d, ckey, held)
        used = comp.attempts - 1 if again else comp.attempts
        if used >= limits.model_attempts or (
            comp.first_attempt_at is not None
            and now - comp.first_attempt_at > limits.model_attempt_window_seconds
        ):
            reason = f"context compaction failed after {used} attempts"
            failed = turn.model_copy(update={"status": TurnStatus.FAILED, "error": reason})
            try:
                await rt.state.write(turn_key(sid, tid), failed, cur.revision)
            except Conflict:
                raise RetryLater(0.05, "turn changed") from None
            await end_turn(rt, failed)
            return
        if comp.attempt is not None and comp_v is not None and not again:
            # Another attempt claimed the summary: taken over only once that attempt is lost.
            why = await holder_lost(d, ckey, comp.attempt, comp_v.stored_at)
            step_key = step.step_key()
            resumed = await record_loss(rt, sid, tid, step_key, comp.attempt, why)
            if resumed is None:
                return
            await tell_resumed(rt, turn, step_key, comp.attempt, resumed, {})
        attempt = rt.new_attempt(used + 1)
        comp = comp.model_copy(
            update={
                "attempt": attempt,
                "attempts": attempt.no,
                "first_attempt_at": comp.first_attempt_at or now,
            }
        )
        rt.unstarted.claiming(ckey, attempt.no)
        await d.claim(ckey, comp, comp_v.revision if comp_v else None)
        await rt.faults.point("compact_context.in_call")
        request = ModelRequest(
            agent=agent.name,
            instructions=SUMMARY_INSTRUCTIONS,
            messages=await conversation(rt, sid, upto=covers),
            tools=[],
            attempt=attempt.no,
            purpose="summary",
            session_id=sid,
            turn_id=tid,
            model_step=n,
        )
        if not await d.still_ours(fresh_for=rt.lease_seconds / 4):
            raise TakenOver(ckey)  # stalled past the lease: the summary is another's to pay for
        log.debug("model.call", attempt=attempt.no, purpose="summary")
        rt.unstarted.began(ckey, attempt.no)
        try:
            with model_span(rt.tracing, turn, request, agent.model) as span:
                async with d.cancelled_when_lost():
                    response = await agent.model.complete(request)
                answered(span, response)
        except TakenOver:
            raise
        except Exception as exc:
            log.warning("compact.call_failed", error=str(exc))
            await d.commit(comp.model_copy(update={"attempt": None, "error": str(exc)}))
            raise RetryLater(min(30.0, 0.5 * 2 ** (attempt.no - 1)), str(exc)) from exc
        await record_usage(rt.bus, usage_event(rt.prices, agent.model, request, response))
        comp = comp.model_copy(update={"attempt": None, "done": True, "text": response.text})
        await d.commit(comp)

    assert comp.text is not None
    number = (summary.compaction + 1) if summary else 1
    stored = session.value.model_copy(
        update={"summary": Summary(text=comp.text, covers=covers, compaction=number)}
    )
    try:
        await rt.state.write(session_key(sid), stored, session.revision)
    except Conflict:
        raise RetryLater(0.05, "session changed while storing the summary") from None
    log.info("context.compacted", covers=covers, compaction=number)
    entry = HistoryEntry(
        key=f"{sid}.{tid}.m{n}.summary",
        role=HistoryRole.SUMMARY,
        turn_id=tid,
        text=comp.text,
    )
    event = Event.of(
        ContextCompactedData(covers=covers, compaction=number, attempts=comp.attempts),
        key=f"{sid}.{tid}.m{n}.compacted",
        session_id=sid,
        turn_id=tid,
    )
    await Followers([history_out(sid, entry), event_out(event)], [step_out(resume)]).publish(rt.bus)
