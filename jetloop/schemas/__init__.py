"""The wire: pydantic models of every message, record and event, encoded as msgpack.

Nothing in this package talks to NATS; ``streams`` does. Every model carries a schema
version ``v`` so a reader can tell an old body from a new one.
"""

from jetloop.schemas.codec import SCHEMA_VERSION, DecodeError, NewerWriter, decode, encode
from jetloop.schemas.events import EVENT_DATA, Event, EventType
from jetloop.schemas.history import HistoryEntry, HistoryRole, ToolStatus
from jetloop.schemas.ids import (
    approval_id_for,
    call_key,
    idempotency_key,
    question_id_for,
    scoped_msg_id,
    turn_id_for,
    validate_name,
)
from jetloop.schemas.kinds import WIRE_OF_KIND, KindWire, Pool, Scope, StepKind
from jetloop.schemas.messages import Carried, StepMessage, TurnRequest
from jetloop.schemas.records import (
    DONE_STATES,
    ApprovalRecord,
    Attempt,
    BlobRef,
    CallOutcome,
    CallRecord,
    CallState,
    CompactionRecord,
    Decision,
    ParentCall,
    PlannedCall,
    PolicyChange,
    QuestionRecord,
    SessionRecord,
    Spent,
    StepReads,
    Summary,
    TurnPhase,
    TurnRecord,
    TurnStatus,
)

__all__ = [
    "DONE_STATES",
    "EVENT_DATA",
    "SCHEMA_VERSION",
    "WIRE_OF_KIND",
    "ApprovalRecord",
    "Attempt",
    "BlobRef",
    "CallOutcome",
    "CallRecord",
    "CallState",
    "Carried",
    "CompactionRecord",
    "Decision",
    "DecodeError",
    "Event",
    "EventType",
    "HistoryEntry",
    "HistoryRole",
    "KindWire",
    "NewerWriter",
    "ParentCall",
    "PlannedCall",
    "PolicyChange",
    "Pool",
    "QuestionRecord",
    "Scope",
    "SessionRecord",
    "Spent",
    "StepKind",
    "StepMessage",
    "StepReads",
    "Summary",
    "ToolStatus",
    "TurnPhase",
    "TurnRecord",
    "TurnRequest",
    "TurnStatus",
    "approval_id_for",
    "call_key",
    "decode",
    "encode",
    "idempotency_key",
    "question_id_for",
    "scoped_msg_id",
    "turn_id_for",
    "validate_name",
]
