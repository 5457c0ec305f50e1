"""The wire: pydantic models of every message, record and event, encoded as msgpack.

Nothing in this package talks to NATS; ``streams`` does. Every model carries a schema
version ``v`` so a reader can tell an old body from a new one.
"""

from schemas.codec import SCHEMA_VERSION, DecodeError, decode, encode
from schemas.events import Event, EventType
from schemas.history import HistoryEntry, HistoryRole, ToolStatus
from schemas.ids import (
    call_key,
    idempotency_key,
    turn_id_for,
    validate_name,
)
from schemas.messages import StepKind, StepMessage, TurnRequest
from schemas.records import (
    Attempt,
    BlobRef,
    CallOutcome,
    CallRecord,
    CallState,
    PlannedCall,
    SessionRecord,
    TurnPhase,
    TurnRecord,
    TurnStatus,
)

__all__ = [
    "SCHEMA_VERSION",
    "Attempt",
    "BlobRef",
    "CallOutcome",
    "CallRecord",
    "CallState",
    "DecodeError",
    "Event",
    "EventType",
    "HistoryEntry",
    "HistoryRole",
    "PlannedCall",
    "SessionRecord",
    "StepKind",
    "StepMessage",
    "ToolStatus",
    "TurnPhase",
    "TurnRecord",
    "TurnRequest",
    "TurnStatus",
    "call_key",
    "decode",
    "encode",
    "idempotency_key",
    "turn_id_for",
    "validate_name",
]
