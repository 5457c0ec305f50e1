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
    CRASH_RESUMED = "agent.run.crash_resumed"


class Event(BaseModel):
    v: int = SCHEMA_VERSION
    key: str
    type: EventType
    session_id: str
    turn_id: str | None = None
    at: float = Field(default_factory=time.time)
    data: dict[str, Any] = Field(default_factory=dict)
