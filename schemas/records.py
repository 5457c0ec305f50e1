"""Records kept in the ``jl_state`` KV bucket; every write is a CAS on the key's revision.

Keys (see ``streams.state``): ``session.<sid>``, ``turn.<sid>.<tid>``,
``call.<sid>.<tid>.<step>.<index>``. A step commits one key, so a checkpoint holds only
the current model step (rule 6): the conversation itself lives in ``JL_EVENTS``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from schemas.codec import SCHEMA_VERSION


class BlobRef(BaseModel):
    """A payload kept in the ``jl_blobs`` object store instead of inline."""

    blob: str
    size: int


class Attempt(BaseModel):
    """One claimed execution of a step: written by the claim CAS (rule 2)."""

    no: int
    worker: str
    started_at: float


class SessionRecord(BaseModel):
    v: int = SCHEMA_VERSION
    session_id: str
    agent: str
    active: str | None = None
    queue: list[str] = Field(default_factory=list)
    turns_done: int = 0
    last_turn: str | None = None


class TurnStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"


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


class TurnRecord(BaseModel):
    v: int = SCHEMA_VERSION
    session_id: str
    turn_id: str
    agent: str
    request_id: str
    text: str
    status: TurnStatus = TurnStatus.QUEUED
    model_step: int = 0
    phase: TurnPhase = TurnPhase.MODEL
    attempt: Attempt | None = None
    attempts: int = 0
    first_attempt_at: float | None = None
    answer_text: str | None = None
    answer_ref: BlobRef | None = None
    calls: list[PlannedCall] = Field(default_factory=list)
    error: str | None = None
    tool_calls_made: int = 0


class CallState(StrEnum):
    RUNNING = "running"  # a read was claimed; never "in doubt"
    IN_DOUBT = "in_doubt"  # a write is about to be made, or is being made
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    OUTCOME_UNKNOWN = "outcome_unknown"


DONE_STATES = frozenset({CallState.SUCCEEDED, CallState.FAILED, CallState.OUTCOME_UNKNOWN})


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

    @property
    def done(self) -> bool:
        return self.state in DONE_STATES
