"""Messages on the work streams: turn requests (``JL_TURNS``) and steps (``JL_STEPS``)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator

from jetloop.schemas.codec import SCHEMA_VERSION
from jetloop.schemas.records import BlobRef, ParentCall


class TurnRequest(BaseModel):
    """A user message for a session, on ``jl.turn.<agent>.<session>``; its ``Nats-Msg-Id``
    is ``<session>.<request id>`` (``scoped_msg_id``, docs/protocol.md).

    ``metadata.parent`` (set by a delegating call) must be a ``ParentCall``: it is checked
    when the request is decoded, so a bad one is dead-lettered, never retried.
    """

    v: int = SCHEMA_VERSION
    text: str
    # A message too large to travel inline: its text is in ``jl_blobs`` (``text`` is empty).
    text_ref: BlobRef | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("metadata")
    @classmethod
    def _parent_is_a_call(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        parent = metadata.get("parent")
        if parent:
            try:
                ParentCall.model_validate(parent)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                at = f" at {where}" if where else ""
                raise ValueError(f"parent is not a parent call{at}: {first['msg']}") from None
        return metadata

    @property
    def parent(self) -> ParentCall | None:
        """The delegating call whose child turn this request starts, if any."""
        parent = self.metadata.get("parent")
        return ParentCall.model_validate(parent) if parent else None


class StepKind(StrEnum):
    RUN_MODEL = "run_model"
    CALL_TOOL = "call_tool"
    CALL_SINGLE_ATTEMPT_TOOL = "call_single_attempt_tool"
    AWAIT_TOOL_APPROVAL = "await_tool_approval"
    AWAIT_QUESTION_ANSWER = "await_question_answer"
    AWAIT_TIMER = "await_timer"
    POLL_TOOL_TASK = "poll_tool_task"
    AWAIT_DELEGATION = "await_delegation"
    COMPACT_CONTEXT = "compact_context"
    JOIN = "join"
    TURN_DONE = "turn_done"
    CLOSE_TURN = "close_turn"  # a cancelled or failed turn: settle its open calls


# Kinds whose handler is the call handler: each wakes one call of a model step.
CALL_KINDS = frozenset(
    {
        StepKind.CALL_TOOL,
        StepKind.CALL_SINGLE_ATTEMPT_TOOL,
        StepKind.AWAIT_TOOL_APPROVAL,
        StepKind.AWAIT_QUESTION_ANSWER,
        StepKind.AWAIT_TIMER,
        StepKind.POLL_TOOL_TASK,
        StepKind.AWAIT_DELEGATION,
    }
)


class StepMessage(BaseModel):
    """One unit of durable work; the step key (``Nats-Msg-Id``) is derived from these fields."""

    v: int = SCHEMA_VERSION
    kind: StepKind
    # The agent of the session: steps are routed to the workers that serve it (the subject
    # carries it), so a worker never receives a step of an agent it does not have.
    agent: str
    session_id: str
    turn_id: str
    model_step: int = 0
    call_index: int | None = None
    # Tells apart two messages of one step that are both needed (e.g. RunModel after a
    # compaction); part of the step key, so it comes from identity too.
    wake: str | None = None

    def step_key(self) -> str:
        base = f"{self.session_id}.{self.turn_id}"
        call = f"{base}.m{self.model_step}.c{self.call_index}"
        match self.kind:
            case StepKind.RUN_MODEL:
                key = f"{base}.m{self.model_step}"
            case StepKind.CALL_TOOL | StepKind.CALL_SINGLE_ATTEMPT_TOOL:
                key = call
            case StepKind.AWAIT_TOOL_APPROVAL:
                key = f"{call}.approval"
            case StepKind.AWAIT_QUESTION_ANSWER:
                key = f"{call}.answer"
            case StepKind.AWAIT_TIMER:
                key = f"{call}.timer"
            case StepKind.POLL_TOOL_TASK:
                key = f"{call}.poll"
            case StepKind.AWAIT_DELEGATION:
                key = f"{call}.child"
            case StepKind.COMPACT_CONTEXT:
                key = f"{base}.m{self.model_step}.compact"
            case StepKind.JOIN:
                key = f"{call}.join"
            case StepKind.TURN_DONE:
                key = f"{base}.done"
            case StepKind.CLOSE_TURN:
                key = f"{base}.close"
        return f"{key}.{self.wake}" if self.wake else key
