"""Records kept in the ``jl_state`` KV bucket; every write is a CAS on the key's revision.

Keys (see ``jetloop.streams.state``): ``session.<sid>``, ``turn.<sid>.<tid>``,
``call.<sid>.<tid>.<step>.<index>``. A step commits one key, so a checkpoint holds only
the current model step (rule 6): the conversation itself lives in ``JL_EVENTS``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from jetloop.schemas.codec import SCHEMA_VERSION


class BlobRef(BaseModel):
    """A payload kept in the ``jl_blobs`` object store instead of inline."""

    blob: str
    size: int


class Attempt(BaseModel):
    """One claimed execution of a step: written by the claim CAS (rule 2)."""

    no: int
    worker: str
    started_at: float
    # One worker process's life: losses are counted per incarnation (jetloop/consumers/losses.py).
    incarnation: str = ""


class Summary(BaseModel):
    """The one stored summary of a session's history (CompactContext); history is kept."""

    text: str
    covers: int  # how many history entries, from the start, the summary replaces
    compaction: int  # the compaction number that wrote it


class Spent(BaseModel):
    """What model calls used: calls answered, tokens, the US dollars of the priced ones
    and how many had no price (every attempt, those a crash made repeat too; the usage
    ledger holds each call). ``cost_usd`` is the priced calls' sum (a budget's cap counts
    it): with ``unpriced_calls`` above 0 it is only part of the cost."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    # Added in 0.2 (a record without it was written before: read as 0).
    unpriced_calls: int = 0

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def plus(self, input_tokens: int, output_tokens: int, cost_usd: float | None) -> Spent:
        return Spent(
            calls=self.calls + 1,
            input_tokens=self.input_tokens + input_tokens,
            output_tokens=self.output_tokens + output_tokens,
            cost_usd=round(self.cost_usd + (cost_usd or 0.0), 9),
            unpriced_calls=self.unpriced_calls + (cost_usd is None),
        )

    def add(self, other: Spent) -> Spent:
        return Spent(
            calls=self.calls + other.calls,
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cost_usd=round(self.cost_usd + other.cost_usd, 9),
            unpriced_calls=self.unpriced_calls + other.unpriced_calls,
        )


class PolicyChange(BaseModel):
    """The last change of one tool's approval override in a session: who made it (a name the
    credential, the gateway token or the local user gives, never the request's word), when,
    and from what to what (``None``: no override, the tool's own policy)."""

    required: bool | None = None
    previous: bool | None = None
    by: str
    at: float


class SessionRecord(BaseModel):
    v: int = SCHEMA_VERSION
    session_id: str
    agent: str
    active: str | None = None
    queue: list[str] = Field(default_factory=list)
    turns_done: int = 0
    last_turn: str | None = None
    # tool name -> approval required, overriding the tool's own policy in this session
    approval_overrides: dict[str, bool] = Field(default_factory=dict)
    # tool name -> who last changed its override, and when (each change is also an
    # ``approval.policy_changed`` event in the session's log)
    approval_changes: dict[str, PolicyChange] = Field(default_factory=dict)
    summary: Summary | None = None
    # The model calls of the session's ended turns (a budget per session counts from it).
    spent: Spent = Field(default_factory=Spent)


class TurnStatus(StrEnum):
    """Where a turn is: ``queued``, ``running``, then one of ``completed``, ``failed``,
    ``cancelled``."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (TurnStatus.COMPLETED, TurnStatus.FAILED, TurnStatus.CANCELLED)


class TurnPhase(StrEnum):
    MODEL = "model"  # waiting for the model's answer of ``model_step``
    CALLS = "calls"  # the answer is committed; its calls run; the join moves on


class PlannedCall(BaseModel):
    """A call the model asked for, committed before it is made (write-ahead, rule 3)."""

    index: int
    call_id: str
    provider_id: str | None = None
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    effect: str
    idempotency_key: str
    invalid: str | None = None  # set when the call cannot run (unknown tool, bad args)
    # The pool of workers that make the call, when not the tool pool: the tool's own
    # (``jetloop.agents.tools.served_elsewhere``), decided with the plan and kept with it.
    pool: str | None = None


class ParentCall(BaseModel):
    """The call that delegated a child turn: where the child's answer goes."""

    agent: str
    session_id: str
    turn_id: str
    model_step: int
    call_index: int


class TurnRecord(BaseModel):
    """A turn as stored (``turn.<sid>.<tid>`` in ``jl_state``): its request, status, model
    step, planned calls, answer (``answer_text`` or ``answer_ref``) and error."""

    v: int = SCHEMA_VERSION
    session_id: str
    turn_id: str
    agent: str
    request_id: str
    text: str
    # The user's text when it is over the blob threshold (``text`` is then empty): durable
    # bytes per step stay small however large the message (rule 6).
    text_ref: BlobRef | None = None
    status: TurnStatus = TurnStatus.QUEUED
    model_step: int = 0
    phase: TurnPhase = TurnPhase.MODEL
    attempt: Attempt | None = None
    attempts: int = 0
    first_attempt_at: float | None = None
    # When a worker accepted the request and made this record (0.2: absent before), the
    # start of the turn's trace span.
    accepted_at: float | None = None
    answer_text: str | None = None
    answer_ref: BlobRef | None = None
    usage: dict[str, int] = Field(default_factory=dict)  # tokens of the current model step
    # The turn's model calls so far, every attempt (a budget per turn counts from it).
    spent: Spent = Field(default_factory=Spent)
    calls: list[PlannedCall] = Field(default_factory=list)
    error: str | None = None
    tool_calls_made: int = 0
    cancelled_by: str | None = None
    # Loss accounting: one id per attempt found lost (a takeover after a lapsed lease).
    lost: list[str] = Field(default_factory=list)
    parent: ParentCall | None = None  # set on a delegated child turn
    # The caller's W3C trace context (``traceparent``): the turn's trace is its child.
    traceparent: str | None = None
    seal: str | None = None


class CallState(StrEnum):
    RUNNING = "running"  # a read was claimed; never "in doubt"
    IN_DOUBT = "in_doubt"  # a write is about to be made, or is being made
    AWAITING_APPROVAL = "awaiting_approval"
    AWAITING_ANSWER = "awaiting_answer"
    WAITING_TIMER = "waiting_timer"
    TASK_RUNNING = "task_running"  # the task's handle is recorded; polls follow
    AWAITING_CHILD = "awaiting_child"  # a delegation: the child session's turn runs
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    OUTCOME_UNKNOWN = "outcome_unknown"
    DENIED = "denied"
    CANCELLED = "cancelled"


DONE_STATES = frozenset(
    {
        CallState.SUCCEEDED,
        CallState.FAILED,
        CallState.OUTCOME_UNKNOWN,
        CallState.DENIED,
        CallState.CANCELLED,
    }
)


class CallOutcome(BaseModel):
    state: CallState
    result: Any = None
    result_ref: BlobRef | None = None
    error: str | None = None


class CallRecord(BaseModel):
    v: int = SCHEMA_VERSION
    key: str
    tool: str
    effect: str
    state: CallState
    attempt: Attempt | None = None
    attempts: int = 0
    marked: int = 0  # attempts that reached the in-doubt mark
    first_attempt_at: float | None = None
    outcome: CallOutcome | None = None
    settlement: str | None = None
    approval_id: str | None = None
    question_id: str | None = None
    timer_due: float | None = None
    task_handle: Any = None
    polls: int = 0
    reconciled_by: str | None = None
    reconciled_at: float | None = None
    child_session: str | None = None  # a delegation's child session
    seal: str | None = None

    @property
    def done(self) -> bool:
        return self.state in DONE_STATES


class StepReads(BaseModel):
    """The outcomes of a model step's reads that ran together, on the first delivery of the
    message that carried every call of the step, kept in one record:
    ``reads.<sid>.<tid>.<step>``. One write instead of one per read (each a write the
    server syncs). Written once (a create), every outcome in it done; a read whose outcome is
    here has no record of its own, and readers of a call's record look here when there is
    none (``StateStore.call``, ``step_view``, ``join_view``)."""

    v: int = SCHEMA_VERSION
    calls: list[CallRecord]
    seal: str | None = None


class Decision(StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"


class ApprovalRecord(BaseModel):
    """A call held for a person's decision: ``approval.<sid>.<approval id>``."""

    v: int = SCHEMA_VERSION
    approval_id: str
    session_id: str
    turn_id: str
    model_step: int
    call_index: int
    call_key: str
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    status: Decision = Decision.PENDING
    requested_at: float
    decided_by: str | None = None
    decided_at: float | None = None
    reason: str | None = None
    # The call's pool when not the tool pool (``PlannedCall.pool``): where a decision wakes it.
    pool: str | None = None


class QuestionRecord(BaseModel):
    """A question the model asked the user: ``question.<sid>.<question id>``."""

    v: int = SCHEMA_VERSION
    question_id: str
    session_id: str
    turn_id: str
    model_step: int
    call_index: int
    call_key: str
    question: str
    asked_at: float
    answer: str | None = None
    answered_by: str | None = None
    answered_at: float | None = None

    @property
    def answered(self) -> bool:
        return self.answer is not None


class CompactionRecord(BaseModel):
    """The attempts of one CompactContext step: ``compact.<sid>.<tid>.<model step>``."""

    v: int = SCHEMA_VERSION
    attempt: Attempt | None = None
    attempts: int = 0
    first_attempt_at: float | None = None
    done: bool = False
    text: str | None = None
    error: str | None = None
