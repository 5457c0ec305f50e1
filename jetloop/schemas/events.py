"""Events of a session's log (``JL_EVENTS``): what happened, for people and read models."""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from jetloop.schemas.codec import SCHEMA_VERSION, decode_map
from jetloop.schemas.records import BlobRef


class EventType(StrEnum):
    """The type of an event in a session's log (docs/protocol.md lists each one's data)."""

    TURN_ACCEPTED = "turn.accepted"
    TURN_STARTED = "turn.started"
    MODEL_ANSWERED = "model.answered"
    MODEL_USAGE = "model.usage"
    CALL_OUTCOME = "call.outcome"
    TURN_COMPLETED = "turn.completed"
    TURN_FAILED = "turn.failed"
    TURN_CANCELLED = "turn.cancelled"
    CRASH_RESUMED = "agent.run.crash_resumed"
    CHECKPOINT_REJECTED = "agent.run.checkpoint_rejected"
    TURN_LOST = "agent.run.lost"
    STEP_DEAD_LETTERED = "agent.run.step_dead_lettered"
    APPROVAL_REQUESTED = "approval.requested"
    APPROVAL_DECIDED = "approval.decided"
    APPROVAL_POLICY_CHANGED = "approval.policy_changed"
    QUESTION_ASKED = "question.asked"
    QUESTION_ANSWERED = "question.answered"
    TIMER_SET = "timer.set"
    TIMER_FIRED = "timer.fired"
    TASK_STARTED = "task.started"
    DELEGATION_STARTED = "delegation.started"
    TASK_POLLED = "task.polled"
    CONTEXT_COMPACTED = "context.compacted"
    CALL_RECONCILED = "call.reconciled"


# The event types that end a turn: exactly one of them is written for every turn.
TURN_ENDS = (EventType.TURN_COMPLETED, EventType.TURN_FAILED, EventType.TURN_CANCELLED)


def turn_end_of(subject: str) -> EventType | None:
    """The turn end an event subject (``jl.event.<session>.<type>``) names, else None."""
    for end in TURN_ENDS:
        if subject.endswith(f".{end.value}"):
            return end
    return None


class Event(BaseModel):
    """One fact in a session's log (``jl.event.<session>.<type>``): ``key`` is unique per
    fact, ``data`` depends on ``type``."""

    v: int = SCHEMA_VERSION
    key: str
    type: EventType
    session_id: str
    turn_id: str | None = None
    at: float = Field(default_factory=time.time)
    data: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, data: EventData, *, key: str, session_id: str, turn_id: str | None) -> Event:
        """The event that tells ``data``. Its type is the one ``EVENT_DATA`` gives the data's
        model, so a payload cannot be written under another type's name; its ``data`` is the
        model as the wire carries it: every field, a missing value as null."""
        try:
            etype = _TYPE_OF[type(data)]
        except KeyError:
            raise TypeError(f"{type(data).__name__} is not the data of an event type") from None
        return cls(
            key=key,
            type=etype,
            session_id=session_id,
            turn_id=turn_id,
            data=data.model_dump(mode="json"),
        )

    def payload(self) -> EventData | None:
        """``data`` read through its type's model (None for a type without one, the reserved
        ``task.polled``). Fields the model does not know are ignored, as a reader must;
        data that does not fit the model raises ``DecodeError``, as a bad body does."""
        model = EVENT_DATA.get(self.type)
        return None if model is None else decode_map(model, self.data)


# The ``data`` of each event type, as the engine writes it. A field shown ``| None`` may be
# null (present, nil); a reader ignores fields it does not know (docs/protocol.md).


class EventData(BaseModel):
    """The ``data`` of one event type (``EVENT_DATA`` says which): built with ``Event.of``,
    read with ``Event.payload``."""


class TurnAcceptedData(EventData):
    """The request was accepted: ``Event.turn_id`` is its turn (the same id for a resend)."""

    request_id: str
    queued: bool  # another turn of the session runs: this one waits its turn


class TurnStartedData(EventData):
    request_id: str
    agent: str


class AnsweredCall(BaseModel):
    call_id: str
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    effect: str


class ModelAnsweredData(EventData):
    """A model step answered with calls (a final answer is ``turn.completed`` instead)."""

    model_step: int
    usage: dict[str, int] = Field(default_factory=dict)
    text: str | None = None
    calls: list[AnsweredCall] = Field(default_factory=list)


class ModelUsageData(EventData):
    """What one model call used and cost, recorded as soon as its answer arrived (before the
    step commits it), so an attempt a crash made repeat is counted too: one event per
    attempt that got an answer, its key ``<session>.<turn>.m<step>.a<attempt>.usage`` (a
    summary call's ``….m<step>.summary.a<attempt>.usage``)."""

    agent: str
    model_step: int
    attempt: int
    purpose: str = "answer"  # "answer" (a model step) or "summary" (a compaction)
    model: str | None = None  # the model's name, as the price table knows it
    input_tokens: int = 0  # every prompt token, cached ones included
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cost_usd: float | None = None  # null: the model has no price (tokens still counted)


class CallOutcomeData(EventData):
    call_key: str
    tool: str
    effect: str
    state: str  # a done CallState: succeeded, failed, outcome_unknown, denied, cancelled
    attempts: int
    error: str | None = None
    settlement: str | None = None


class TurnCompletedData(EventData):
    request_id: str
    text: str | None = None  # the answer, or null when it is in the blob store
    text_ref: BlobRef | None = None
    model_steps: int
    usage: dict[str, int] = Field(default_factory=dict)


class TurnFailedData(EventData):
    request_id: str
    error: str | None = None


class TurnCancelledData(EventData):
    request_id: str
    by: str | None = None


class CrashResumedData(EventData):
    step: str  # the step key that was resumed
    losses: int
    lost_attempt: int
    lost_worker: str
    lost_incarnation: str
    settled: dict[str, Any] = Field(default_factory=dict)  # call key -> how it was settled
    # The holder stopped on purpose (its drain ran out in a deploy): not counted as a loss.
    drained: bool = False
    # The holder lives and had stopped working on the step (its delivery ended unfinished):
    # not counted as a loss.
    abandoned: bool = False


class CheckpointRejectedData(EventData):
    key: str  # the jl_state key whose seal did not verify
    reason: str
    step: str


class StepDeadLetteredData(EventData):
    """A step of the turn failed in a way no retry cures (past the server's size limit, a
    bug): it was moved to ``JL_DEAD`` whole, and the turn fails with the reason."""

    step: str  # the step's key
    reason: str
    dead_letter: str  # the subject it waits on in JL_DEAD


class TurnLostData(EventData):
    losses: int
    step: str


class ApprovalRequestedData(EventData):
    approval_id: str
    call_key: str
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)


class ApprovalDecidedData(EventData):
    approval_id: str
    status: str  # approved | rejected
    by: str | None = None
    reason: str | None = None
    call_key: str


class ApprovalPolicyChangedData(EventData):
    """A tool's approval override in the session was changed: ``required`` is the new one
    (null: removed, the tool's own policy applies), ``previous`` the one before, ``by`` who
    changed it (the event's ``at`` says when)."""

    tool: str
    required: bool | None = None
    previous: bool | None = None
    by: str


class QuestionAskedData(EventData):
    question_id: str
    question: str
    call_key: str


class QuestionAnsweredData(EventData):
    question_id: str
    answer: str | None = None
    by: str | None = None
    call_key: str


class TimerSetData(EventData):
    call_key: str
    due: float  # Unix time, seconds
    at: str  # the same instant, RFC 3339 UTC, whole seconds (rounded up)


class TimerFiredData(EventData):
    call_key: str
    due: float
    late_seconds: float


class TaskStartedData(EventData):
    call_key: str
    tool: str
    handle: Any = None  # what the task tool's start returned


class DelegationStartedData(EventData):
    call_key: str
    agent: str
    child_session: str


class ContextCompactedData(EventData):
    covers: int  # history entries, from the start, the summary replaces
    compaction: int
    attempts: int


class CallReconciledData(EventData):
    call_key: str
    state: str  # succeeded | failed
    by: str
    result: Any = None
    error: str | None = None


EVENT_DATA: dict[EventType, type[EventData]] = {
    EventType.TURN_ACCEPTED: TurnAcceptedData,
    EventType.TURN_STARTED: TurnStartedData,
    EventType.MODEL_ANSWERED: ModelAnsweredData,
    EventType.MODEL_USAGE: ModelUsageData,
    EventType.CALL_OUTCOME: CallOutcomeData,
    EventType.TURN_COMPLETED: TurnCompletedData,
    EventType.TURN_FAILED: TurnFailedData,
    EventType.TURN_CANCELLED: TurnCancelledData,
    EventType.CRASH_RESUMED: CrashResumedData,
    EventType.CHECKPOINT_REJECTED: CheckpointRejectedData,
    EventType.TURN_LOST: TurnLostData,
    EventType.STEP_DEAD_LETTERED: StepDeadLetteredData,
    EventType.APPROVAL_REQUESTED: ApprovalRequestedData,
    EventType.APPROVAL_DECIDED: ApprovalDecidedData,
    EventType.APPROVAL_POLICY_CHANGED: ApprovalPolicyChangedData,
    EventType.QUESTION_ASKED: QuestionAskedData,
    EventType.QUESTION_ANSWERED: QuestionAnsweredData,
    EventType.TIMER_SET: TimerSetData,
    EventType.TIMER_FIRED: TimerFiredData,
    EventType.TASK_STARTED: TaskStartedData,
    EventType.DELEGATION_STARTED: DelegationStartedData,
    EventType.CONTEXT_COMPACTED: ContextCompactedData,
    EventType.CALL_RECONCILED: CallReconciledData,
}
# ``task.polled`` is reserved: this version does not write it.
_TYPE_OF: dict[type[EventData], EventType] = {model: etype for etype, model in EVENT_DATA.items()}
