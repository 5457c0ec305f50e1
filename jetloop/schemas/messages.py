"""Messages on the work streams: turn requests (``JL_TURNS``) and steps (``JL_STEPS``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from jetloop.schemas.codec import SCHEMA_VERSION, UNKNOWN_KIND
from jetloop.schemas.kinds import WIRE_OF_KIND, Scope, StepKind
from jetloop.schemas.records import BlobRef, ParentCall, SessionRecord, TurnRecord


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


class Carried(BaseModel):
    """A turn's and its session's records as the step that publishes a ``run_model`` step
    wrote or read them, with their revisions: what that step would read first.

    Only a hint: the step's first write is a CAS from ``turn_revision``, so a turn written
    since fails it, and the step then starts again from what it reads (``StaleCarry``).
    ``seal``: made by the worker that carried them, as a state record's, for the key
    ``carried.<session>.<turn>`` over ``turn_revision`` (``jetloop.consumers.carry``); a
    carry that does not verify is not used."""

    turn: TurnRecord
    turn_revision: int
    session: SessionRecord
    session_revision: int
    seal: str | None = None


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
    # ``call_tools``: how many calls the model step asked for (calls 0 … calls-1).
    calls: int | None = None
    # Tells apart two messages of one step that are both needed (e.g. RunModel after a
    # compaction); part of the step key, so it comes from identity too.
    wake: str | None = None
    # ``run_model``: the records the step would read first, when they are small
    # (``Carried``; not part of the step key).
    carried: Carried | None = None
    # A call of a tool served by a pool of its own (``PlannedCall.pool``): the subject's pool
    # instead of its kind's (not part of the step key).
    pool: str | None = Field(default=None, pattern=r"^[a-z][a-z0-9_-]{0,31}$")

    @field_validator("kind", mode="before")
    @classmethod
    def _known_kind(cls, kind: object) -> object:
        # Said in words with the kind in them: the reason a dead letter carries.
        if not isinstance(kind, str):
            return kind  # not a kind at all: the model's own message says so
        try:
            return StepKind(kind)
        except ValueError:
            known = ", ".join(StepKind)
            raise PydanticCustomError(
                UNKNOWN_KIND,
                "unknown step kind '{kind}' (this jetloop knows: {known})",
                {"kind": kind, "known": known},
            ) from None

    def step_key(self) -> str:
        """The step's identity, as ``WIRE_OF_KIND`` shapes it for its kind."""
        wire = WIRE_OF_KIND[self.kind]
        key = f"{self.session_id}.{self.turn_id}"
        if wire.scope is not Scope.TURN:
            key += f".m{self.model_step}"
        if wire.scope is Scope.CALL:
            key += f".c{self.call_index}"
        if wire.suffix:
            key += f".{wire.suffix}"
        return f"{key}.{self.wake}" if self.wake else key
