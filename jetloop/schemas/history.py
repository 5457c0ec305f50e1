"""Entries of a session's conversation, appended to ``JL_EVENTS`` (never rewritten)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from jetloop.schemas.codec import SCHEMA_VERSION
from jetloop.schemas.events import Event
from jetloop.schemas.records import BlobRef, PlannedCall


class HistoryRole(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"
    NOTE = "note"  # the engine tells the model something (a failed turn's calls, a reconcile)
    SUMMARY = "summary"  # CompactContext: replaces the entries before it for the model


class ToolStatus(StrEnum):
    OK = "ok"
    ERROR = "error"
    OUTCOME_UNKNOWN = "outcome_unknown"
    DENIED = "denied"
    CANCELLED = "cancelled"


class HistoryEntry(BaseModel):
    v: int = SCHEMA_VERSION
    key: str  # the event key; a reader keeps the first entry of each key
    role: HistoryRole
    turn_id: str
    text: str | None = None
    text_ref: BlobRef | None = None
    calls: list[PlannedCall] = Field(default_factory=list)
    call_id: str | None = None
    tool: str | None = None
    status: ToolStatus | None = None
    result: Any = None
    result_ref: BlobRef | None = None
    # The folded log (``jetloop.schemas.log``): the events that tell the same fact as this
    # entry, carried in it instead of published on their own subjects. Empty in the
    # separate log.
    events: list[Event] = Field(default_factory=list)
    # The results of several calls of one model step told together (the folded log, a
    # step's reads kept together): each part is a ``tool`` entry of its own, in call order,
    # and a reader reads the parts in place of this entry (``each``). This entry's own
    # ``key`` names the set; the ``call.outcome`` events of every part ride in ``events``.
    parts: list[HistoryEntry] | None = None

    def each(self) -> list[HistoryEntry]:
        """The entries this one stands for in the conversation: its parts, else itself."""
        return self.parts if self.parts is not None else [self]
