"""What follows a committed state, derived from the state alone (rules 1 and 4).

Every function here builds the messages that come after a checkpoint: history entries and
events first, then the next steps. A handler that finds its work already recorded calls the
same function again; identical ``Nats-Msg-Id`` keys make the re-emission a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jetloop.consumers.budgets import is_budget
from jetloop.schemas import (
    CallRecord,
    CallState,
    Carried,
    Event,
    HistoryEntry,
    HistoryRole,
    PlannedCall,
    StepKind,
    StepMessage,
    ToolStatus,
    TurnRecord,
    TurnStatus,
)
from jetloop.schemas.events import (
    AnsweredCall,
    CallOutcomeData,
    ModelAnsweredData,
    TurnAcceptedData,
    TurnCancelledData,
    TurnCompletedData,
    TurnFailedData,
    TurnStartedData,
)
from jetloop.schemas.ids import call_id, call_key_parts
from jetloop.schemas.kinds import CALLS_PER_MESSAGE
from jetloop.streams.bus import Bus, Outgoing, event_out, history_out, step_out


@dataclass
class Followers:
    """Records (history, events) go out and are confirmed before the steps that read them —
    unless the step checks for them itself (``restorable``): then all go out together, one
    round trip, and the step that reads them restores what it misses from state
    (``expected_history`` here, ``run_model._with_its_inputs``)."""

    records: list[Outgoing] = field(default_factory=list)
    steps: list[Outgoing] = field(default_factory=list)
    restorable: bool = False

    def __add__(self, other: Followers) -> Followers:
        # Together only if neither side has steps that need their records first.
        restorable = (self.restorable or not self.steps) and (other.restorable or not other.steps)
        return Followers(self.records + other.records, self.steps + other.steps, restorable)

    async def publish(self, bus: Bus) -> None:
        if self.restorable:
            await bus.publish(self.records + self.steps)
            return
        await bus.publish(self.records)
        await bus.publish(self.steps)


# A ``run_model`` message carries its turn's and session's records only while it stays this
# small: a step message is stored and delivered whole, and a large turn (long arguments, a
# long answer kept inline) is read once rather than copied into every message.
CARRY_MOST_BYTES = 8 * 1024


def model_step_out(step: StepMessage, carried: Carried | None) -> Outgoing:
    """A ``run_model`` step, carrying ``carried`` when it keeps the message small."""
    if carried is not None:
        out = step_out(step.model_copy(update={"carried": carried}))
        if len(out.body) <= CARRY_MOST_BYTES:
            return out
    return step_out(step)


def _base(turn: TurnRecord) -> str:
    return f"{turn.session_id}.{turn.turn_id}"


def _result_key(session_id: str, turn_id: str, model_step: int, index: int) -> str:
    """The key of a call's result entry."""
    return f"{session_id}.{turn_id}.m{model_step}.c{index}.result"


def accepted_event(turn: TurnRecord, queued: bool) -> Event:
    """``turn.accepted``: the turn's request is in its session, to run now or after others."""
    return Event.of(
        TurnAcceptedData(request_id=turn.request_id, queued=queued),
        key=f"{_base(turn)}.accepted",
        session_id=turn.session_id,
        turn_id=turn.turn_id,
    )


def turn_start(
    turn: TurnRecord,
    carried: Carried | None = None,
    *,
    folded: bool,
    accepted: Event | None = None,
) -> Followers:
    """The turn starts: the user's entry, ``turn.started`` (and ``accepted``, its request
    accepted just now, when given) and the first model step. ``folded``: the events ride in
    the user's entry (``jetloop.schemas.log``)."""
    base = _base(turn)
    started = Event.of(
        TurnStartedData(request_id=turn.request_id, agent=turn.agent),
        key=f"{base}.started",
        session_id=turn.session_id,
        turn_id=turn.turn_id,
    )
    told = [started] if accepted is None else [accepted, started]
    user = HistoryEntry(
        key=f"{base}.user",
        role=HistoryRole.USER,
        turn_id=turn.turn_id,
        text=turn.text if turn.text_ref is None else None,
        text_ref=turn.text_ref,
        events=told if folded else [],
    )
    first = StepMessage(
        kind=StepKind.RUN_MODEL,
        agent=turn.agent,
        session_id=turn.session_id,
        turn_id=turn.turn_id,
        model_step=0,
    )
    records = [history_out(turn.session_id, user)]
    if not folded:
        records = [*(event_out(e) for e in told if e is accepted), *records]
        records.append(event_out(started))
    # RunModel 0 restores the user's entry from the turn record if it is not in yet.
    return Followers(records, [model_step_out(first, carried)], True)


def _assistant_entry(turn: TurnRecord, told: Event | None = None) -> HistoryEntry:
    """The model's answer; ``told``: the event the entry carries (the folded log)."""
    return HistoryEntry(
        key=f"{_base(turn)}.m{turn.model_step}.assistant",
        role=HistoryRole.ASSISTANT,
        turn_id=turn.turn_id,
        text=turn.answer_text,
        text_ref=turn.answer_ref,
        calls=turn.calls if turn.phase == "calls" else [],
        events=[told] if told is not None else [],
    )


def answer(turn: TurnRecord, in_one_message: bool, *, folded: bool) -> Followers:
    """A model step answered with calls: record the answer, then run every call, in one
    ``call_tools`` message when ``in_one_message`` (every live worker runs that kind) and the
    step asked for at most ``CALLS_PER_MESSAGE``, else a message per call. ``folded``:
    ``model.answered`` rides in the assistant's entry."""
    n = turn.model_step
    answered = Event.of(
        ModelAnsweredData(
            model_step=n,
            usage=turn.usage,
            text=turn.answer_text,
            calls=[
                AnsweredCall(call_id=c.call_id, tool=c.tool, args=c.args, effect=c.effect)
                for c in turn.calls
            ],
        ),
        key=f"{_base(turn)}.m{n}.answered",
        session_id=turn.session_id,
        turn_id=turn.turn_id,
    )

    def step(
        kind: StepKind,
        calls: int | None = None,
        call_index: int | None = None,
        pool: str | None = None,
    ) -> Outgoing:
        return step_out(
            StepMessage(
                kind=kind,
                agent=turn.agent,
                session_id=turn.session_id,
                turn_id=turn.turn_id,
                model_step=n,
                calls=calls,
                call_index=call_index,
                pool=pool,
            )
        )

    # A call of a tool that a pool of its own serves goes to that pool: then every call of
    # the step is a message of its own (``call_tools`` is the tool pool's, for all calls).
    apart = any(c.pool is not None for c in turn.calls)
    if in_one_message and not apart and len(turn.calls) <= CALLS_PER_MESSAGE:
        # One message for every call (``call_tools``): one publish, one delivery, one ack.
        steps = [step(StepKind.CALL_TOOLS, calls=len(turn.calls))]
    else:
        steps = [
            step(
                StepKind.CALL_SINGLE_ATTEMPT_TOOL
                if c.effect == "non_idempotent_write"
                else StepKind.CALL_TOOL,
                call_index=c.index,
                pool=c.pool,
            )
            for c in turn.calls
        ]
    if folded:
        return Followers([history_out(turn.session_id, _assistant_entry(turn, answered))], steps)
    return Followers(
        [history_out(turn.session_id, _assistant_entry(turn)), event_out(answered)], steps
    )


def finished(turn: TurnRecord, *, folded: bool) -> Followers:
    """A turn ended (completed or failed): its last words, its event, and the wake of a
    delegating parent. (The session moves on in the same step: ``session.end_turn``.)
    ``folded``: ``turn.completed`` rides in the last answer's entry."""
    base = _base(turn)
    records: list[Outgoing] = []
    ev: Event | None
    if turn.status == TurnStatus.COMPLETED:
        ev = Event.of(
            TurnCompletedData(
                request_id=turn.request_id,
                text=turn.answer_text if turn.answer_ref is None else None,
                text_ref=turn.answer_ref,
                model_steps=turn.model_step + 1,
                usage=turn.usage,
            ),
            key=f"{base}.completed",
            session_id=turn.session_id,
            turn_id=turn.turn_id,
        )
        records.append(history_out(turn.session_id, _assistant_entry(turn, ev if folded else None)))
        if folded:
            ev = None
    elif turn.status == TurnStatus.CANCELLED:
        ev = Event.of(
            TurnCancelledData(request_id=turn.request_id, by=turn.cancelled_by),
            key=f"{base}.cancelled",
            session_id=turn.session_id,
            turn_id=turn.turn_id,
        )
    else:
        ev = Event.of(
            TurnFailedData(request_id=turn.request_id, error=turn.error),
            key=f"{base}.failed",
            session_id=turn.session_id,
            turn_id=turn.turn_id,
        )
        if turn.tool_calls_made or is_budget(turn.error):
            records.append(history_out(turn.session_id, failed_turn_note(turn)))
    if ev is not None:
        records.append(event_out(ev))
    steps = []
    if turn.parent is not None:
        # A delegated child turn: its end wakes the parent's call, which reads the answer.
        p = turn.parent
        steps.append(
            step_out(
                StepMessage(
                    kind=StepKind.AWAIT_DELEGATION,
                    agent=p.agent,
                    session_id=p.session_id,
                    turn_id=p.turn_id,
                    model_step=p.model_step,
                    call_index=p.call_index,
                )
            )
        )
    return Followers(records, steps)


def call_done(turn: TurnRecord, rec: CallRecord, *, folded: bool) -> Followers:
    """A call has its outcome: tell the log (``folded``: the call's result entry, carrying
    ``call.outcome``; the separate log publishes the entries when the join moves the turn).
    The step that committed it then joins the turn itself
    (``jetloop.consumers.join.join_calls``: no message of its own)."""
    ev = outcome_event(turn, rec)
    if folded:
        return Followers([history_out(turn.session_id, result_entry(rec, ev))])
    return Followers([event_out(ev)])


def results_told(turn: TurnRecord, recs: list[CallRecord]) -> Followers:
    """The outcomes of several calls of ``turn``'s current step told in one history entry
    (the folded log): the calls' result entries as its ``parts``, in the order given, their
    ``call.outcome`` events in its ``events``. A reader reads the parts as entries of their
    own (``HistoryEntry.each``), so the conversation is the same as with an entry each,
    and one stored message (one sync) carries them all."""
    told = [outcome_event(turn, rec) for rec in recs]
    entry = HistoryEntry(
        key=f"{_base(turn)}.m{turn.model_step}.results",
        role=HistoryRole.TOOL,
        turn_id=turn.turn_id,
        parts=[result_entry(rec) for rec in recs],
        events=told,
    )
    return Followers([history_out(turn.session_id, entry)])


def outcome_event(turn: TurnRecord, rec: CallRecord) -> Event:
    """``call.outcome``: call ``rec`` of ``turn`` has its outcome."""
    assert rec.outcome is not None
    return Event.of(
        CallOutcomeData(
            call_key=rec.key,
            tool=rec.tool,
            effect=rec.effect,
            state=rec.state.value,
            attempts=rec.attempts,
            error=rec.outcome.error,
            settlement=rec.settlement,
        ),
        key=f"call.{rec.key}.outcome",
        session_id=turn.session_id,
        turn_id=turn.turn_id,
    )


def result_entry(
    rec: CallRecord, told: Event | None = None, call: PlannedCall | None = None
) -> HistoryEntry:
    """A call's result for the conversation: from the call as planned when given, else from
    its record alone (its key names the turn, the model step and the call, and the call id
    is derived from them). ``told``: the ``call.outcome`` it carries (the folded log)."""
    assert rec.outcome is not None
    sid, tid, n, i = call_key_parts(rec.key)
    return HistoryEntry(
        key=_result_key(sid, tid, n, i),
        role=HistoryRole.TOOL,
        turn_id=tid,
        call_id=call.call_id if call is not None else call_id(tid, n, i),
        tool=call.tool if call is not None else rec.tool,
        status=TOOL_STATUS[rec.state],
        result=rec.outcome.result,
        result_ref=rec.outcome.result_ref,
        text=rec.outcome.error,
        events=[told] if told is not None else [],
    )


TOOL_STATUS = {
    CallState.SUCCEEDED: ToolStatus.OK,
    CallState.FAILED: ToolStatus.ERROR,
    CallState.OUTCOME_UNKNOWN: ToolStatus.OUTCOME_UNKNOWN,
    CallState.DENIED: ToolStatus.DENIED,
    CallState.CANCELLED: ToolStatus.CANCELLED,
}


def failed_turn_note(turn: TurnRecord) -> HistoryEntry:
    """Tells the next turn's model that this failed turn's tool calls did run, and that a
    budget stopped it when one did."""
    text = f"The previous turn failed ({turn.error})"
    if is_budget(turn.error):
        text = f"The previous turn was stopped by its budget ({turn.error})"
    if turn.tool_calls_made:
        text += (
            f" after {turn.tool_calls_made} tool call(s) had already run; their results are "
            "above. Do not repeat those calls without checking what they did."
        )
    else:
        text += "."
    return HistoryEntry(
        key=f"{_base(turn)}.failed.note",
        role=HistoryRole.NOTE,
        turn_id=turn.turn_id,
        text=text,
    )


def note(session_id: str, turn_id: str, key: str, text: str) -> Outgoing:
    return history_out(
        session_id, HistoryEntry(key=key, role=HistoryRole.NOTE, turn_id=turn_id, text=text)
    )


def joined(
    turn: TurnRecord, results: list[CallRecord], carried: Carried | None = None, *, folded: bool
) -> Followers:
    """Every call of step n has its outcome and the turn is at step n+1: results, then model.
    (``folded``: each result went out with its outcome, ``call_done``: the model alone.)"""
    records = []
    if not folded:
        records = [
            history_out(turn.session_id, result_entry(rec, call=call))
            for call, rec in zip(turn.calls, results, strict=True)
        ]
    step = StepMessage(
        kind=StepKind.RUN_MODEL,
        agent=turn.agent,
        session_id=turn.session_id,
        turn_id=turn.turn_id,
        model_step=turn.model_step,
    )
    # RunModel n+1 restores the results from the call records if they are not in yet.
    return Followers(records, [model_step_out(step, carried)], True)


def results_again(turn: TurnRecord, results: list[CallRecord], *, folded: bool) -> list[Outgoing]:
    """The result entries of ``turn``'s previous step as the log has them (``folded``: each
    carrying its call's ``call.outcome``), to publish again when one is missing."""
    if not folded:
        return joined(turn, results, folded=False).records
    return [call_done(turn, r, folded=True).records[0] for r in results]


def expected_history(turn: TurnRecord) -> list[str]:
    """The history entries RunModel ``turn.model_step`` needs that the step before it
    published together with its message (``restorable``): the user's message for step 0,
    the previous step's tool results after that. (The previous step's answer went out, and
    was confirmed, before its calls.)"""
    n = turn.model_step
    if n == 0:
        return [f"{_base(turn)}.user"]
    return [_result_key(turn.session_id, turn.turn_id, n - 1, c.index) for c in turn.calls]
