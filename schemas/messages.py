"""Messages on the work streams: turn requests (``JL_TURNS``) and steps (``JL_STEPS``)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from schemas.codec import SCHEMA_VERSION


class TurnRequest(BaseModel):
    """A user message for a session; its ``Nats-Msg-Id`` is the client's request id."""

    v: int = SCHEMA_VERSION
    text: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class StepKind(StrEnum):
    RUN_MODEL = "run_model"
    CALL_TOOL = "call_tool"
    JOIN = "join"
    TURN_DONE = "turn_done"


class StepMessage(BaseModel):
    """One unit of durable work; the step key (``Nats-Msg-Id``) is derived from these fields."""

    v: int = SCHEMA_VERSION
    kind: StepKind
    session_id: str
    turn_id: str
    model_step: int = 0
    call_index: int | None = None

    def step_key(self) -> str:
        base = f"{self.session_id}.{self.turn_id}"
        match self.kind:
            case StepKind.RUN_MODEL:
                return f"{base}.m{self.model_step}"
            case StepKind.CALL_TOOL:
                return f"{base}.m{self.model_step}.c{self.call_index}"
            case StepKind.JOIN:
                return f"{base}.m{self.model_step}.c{self.call_index}.join"
            case StepKind.TURN_DONE:
                return f"{base}.done"
