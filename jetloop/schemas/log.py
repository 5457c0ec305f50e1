"""The two layouts of a session's log, and reading events from either.

Where a fact is both an event and a history entry (a turn started with the user's words, a
model's answer, a call's result, a turn's last answer), the **separate** log publishes two
messages: the event on ``jl.event.<session>.<type>``, the entry on
``jl.event.<session>.history.<role>``. The **folded** log publishes the entry alone, carrying
the event in its ``events`` (and the event types in its ``Jl-Events`` header): one message
instead of two. Every other event is published on its own subject in both layouts.

Which events ride in which entries (``FOLDED_INTO``):

- ``turn.accepted`` (when the turn starts at once) and ``turn.started``: the user's entry;
- ``model.answered``: the assistant's entry of that model step;
- ``turn.completed``: the assistant's entry of the last answer;
- ``call.outcome``: the call's ``tool`` entry, published when the outcome is committed (the
  separate log publishes the entries of a step's calls when the last one ends).

A reader of events reads both layouts alike with ``events_in``: a message on a history
subject yields the events it carries (none in the separate log), any other message the event
it is. A reader that filters by event type also reads the entries that may carry those types
(``carrier_roles``).
"""

from __future__ import annotations

from enum import StrEnum

from jetloop.schemas.codec import decode
from jetloop.schemas.events import TURN_ENDS, Event, EventType, turn_end_of
from jetloop.schemas.history import HistoryEntry, HistoryRole


class LogLayout(StrEnum):
    SEPARATE = "separate"
    FOLDED = "folded"


# The header of a folded entry naming the event types it carries, space-separated.
H_EVENTS = "Jl-Events"

FOLDED_INTO: dict[EventType, HistoryRole] = {
    EventType.TURN_ACCEPTED: HistoryRole.USER,
    EventType.TURN_STARTED: HistoryRole.USER,
    EventType.MODEL_ANSWERED: HistoryRole.ASSISTANT,
    EventType.TURN_COMPLETED: HistoryRole.ASSISTANT,
    EventType.CALL_OUTCOME: HistoryRole.TOOL,
}


def is_history_subject(subject: str) -> bool:
    """Whether ``subject`` is a history entry's (``jl.event.<session>.history.<role>``)."""
    parts = subject.split(".", 4)
    return len(parts) == 5 and parts[3] == "history"


def events_in(subject: str, data: bytes) -> list[Event]:
    """The events a ``JL_EVENTS`` message tells: those a history entry carries (the folded
    log), else the event it is. Raises ``DecodeError`` for a body that does not read."""
    if is_history_subject(subject):
        return decode(HistoryEntry, data).events
    return [decode(Event, data)]


def carrier_roles(types: list[EventType]) -> list[HistoryRole]:
    """The history roles whose entries may carry an event of ``types``."""
    return sorted({FOLDED_INTO[t] for t in types if t in FOLDED_INTO})


def turn_end_heard(subject: str, headers: dict[str, str] | None) -> EventType | None:
    """The turn end a stored message tells, from its subject and headers alone (no decoding):
    an end event on its own subject, or a folded entry whose ``Jl-Events`` names one."""
    end = turn_end_of(subject)
    if end is not None or not is_history_subject(subject):
        return end
    told = (headers or {}).get(H_EVENTS, "").split()
    return next((e for e in TURN_ENDS if e.value in told), None)
