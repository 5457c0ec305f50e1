"""Events of a session's log (``JL_EVENTS``): what happened, for people and read models."""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from schemas.codec import SCHEMA_VERSION


class EventType(StrEnum):
    TURN_ACCEPTED = "turn.accepted"
    TURN_STARTED = "turn.started"
    MODEL_ANSWERED = "model.answered"
    CALL_OUTCOME = "call.outcome"
    TURN_COMPLETED = "turn.completed"
    TURN_FAILED = "turn.failed"
    TURN_CANCELLED = "turn.cancelled"
    CRASH_RESUMED = "agent.run.crash_resumed"
    CHECKPOINT_REJECTED = "agent.run.checkpoint_rejected"
    TURN_LOST = "agent.run.lost"
    APPROVAL_REQUESTED = "approval.requested"
    APPROVAL_DECIDED = "approval.decided"
    QUESTION_ASKED = "question.asked"
    QUESTION_ANSWERED = "question.answered"
    TIMER_SET = "timer.set"
    TIMER_FIRED = "timer.fired"
    TASK_STARTED = "task.started"
    DELEGATION_STARTED = "delegation.started"
    TASK_POLLED = "task.polled"
    CONTEXT_COMPACTED = "context.compacted"
    CALL_RECONCILED = "call.reconciled"


class Event(BaseModel):
    v: int = SCHEMA_VERSION
    key: str
    type: EventType
    session_id: str
    turn_id: str | None = None
    at: float = Field(default_factory=time.time)
    data: dict[str, Any] = Field(default_factory=dict)
