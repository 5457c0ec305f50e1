"""A session's past turns, and one turn with its calls: what the snapshot (the latest turn
only) does not show.

Read from ``jl_state`` (``turn.<sid>.<tid>``, ``call.<sid>.<tid>.<step>.<index>``) in one
batched read each where the bucket allows direct gets. Records that do not verify are shown
(read without the check) and named in ``untrusted``, as the snapshot does. JSON-able: the
client returns these models and the gateway serves them.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from jetloop.schemas import DecodeError, ParentCall, TurnRecord, TurnStatus
from jetloop.schemas.ids import DEFAULT_NAMESPACE
from jetloop.sessions.snapshot import MOST_CALLS, CallView, turn_calls
from jetloop.streams.blobs import BlobStore
from jetloop.streams.seal import SealBroken
from jetloop.streams.state import StateStore, Stored, Versioned, session_key, turn_key

# How many turn records of one session are read to order them (newest first): the bound on
# what one listing costs. A session with more lists its most recently written ones.
MOST_TURNS = 10_000


class TurnSummary(BaseModel):
    """One turn of a session, in a listing (the full record: ``TurnDetail``)."""

    turn_id: str
    request_id: str
    agent: str
    status: TurnStatus
    # Its last model step (from 0): the one whose answer ended a completed turn.
    model_step: int
    tool_calls_made: int
    # When its first attempt started (unix seconds); None while it is queued.
    started_at: float | None = None
    error: str | None = None
    cancelled_by: str | None = None
    # Set on a delegated child turn: the call whose answer it is.
    parent: ParentCall | None = None


class TurnPage(BaseModel):
    """A page of a session's turns, newest first."""

    session_id: str
    total: int
    offset: int
    limit: int
    turns: list[TurnSummary] = Field(default_factory=list)
    # Records whose seal did not verify, as "<key>: <why>" (shown all the same).
    untrusted: list[str] = Field(default_factory=list)


class TurnDetail(BaseModel):
    """A turn's record and its calls (every model step's, in order) with their outcomes."""

    session_id: str
    turn: TurnRecord
    calls: list[CallView] = Field(default_factory=list)
    # Calls left out beyond the limit asked for.
    calls_more: int = 0
    untrusted: list[str] = Field(default_factory=list)


def summary(turn: TurnRecord) -> TurnSummary:
    return TurnSummary(
        turn_id=turn.turn_id,
        request_id=turn.request_id,
        agent=turn.agent,
        status=turn.status,
        model_step=turn.model_step,
        tool_calls_made=turn.tool_calls_made,
        started_at=turn.first_attempt_at,
        error=turn.error,
        cancelled_by=turn.cancelled_by,
        parent=turn.parent,
    )


def _trusted_or_noted(
    state: StateStore, key: str, raw: Stored, untrusted: list[str]
) -> Versioned[TurnRecord] | None:
    """The turn as stored; one whose seal does not verify is read without the check and
    noted in ``untrusted``; one that does not decode at all is left out (and noted)."""
    try:
        return state.typed(TurnRecord, key, raw)
    except SealBroken as exc:
        untrusted.append(f"{key}: {exc.reason}")
    try:
        return state.typed(TurnRecord, key, raw, verify=False)
    except DecodeError as exc:
        untrusted.append(f"{key}: {exc}")
        return None


async def list_turns(
    state: StateStore, session_id: str, limit: int = 50, offset: int = 0
) -> TurnPage | None:
    """The session's turns, newest first (queued ones, then by when they started; a session
    runs its turns one at a time, in order); None when the session has no state."""
    if await state.stored(session_key(session_id)) is None:
        return None
    found, _ = await state.matching(f"turn.{session_id}.*", MOST_TURNS)
    untrusted: list[str] = []
    turns: list[tuple[Versioned[TurnRecord], int]] = []
    for key, raw in found.items():
        tv = _trusted_or_noted(state, key, raw, untrusted)
        if tv is not None:
            turns.append((tv, raw.revision))

    def newest_first(item: tuple[Versioned[TurnRecord], int]) -> tuple[bool, float, int]:
        turn, revision = item[0].value, item[1]
        queued = turn.first_attempt_at is None
        return queued, turn.first_attempt_at or 0.0, revision

    turns.sort(key=newest_first, reverse=True)
    return TurnPage(
        session_id=session_id,
        total=len(turns),
        offset=offset,
        limit=limit,
        turns=[summary(t.value) for t, _ in turns[offset : offset + limit]],
        untrusted=untrusted,
    )


async def turn_detail(
    state: StateStore,
    blobs: BlobStore,
    session_id: str,
    turn_id: str,
    calls_limit: int = MOST_CALLS,
    namespace: str = DEFAULT_NAMESPACE,
) -> TurnDetail | None:
    """The turn's record and up to ``calls_limit`` of its calls; None when there is no such
    turn. ``namespace``: the one the turn lives in (its calls' keys are made of it)."""
    key = turn_key(session_id, turn_id)
    raw = await state.stored(key)
    if raw is None:
        return None
    untrusted: list[str] = []
    tv = _trusted_or_noted(state, key, raw, untrusted)
    if tv is None:
        return None
    calls, more = await turn_calls(
        state, blobs, tv.value, untrusted, most=calls_limit, namespace=namespace
    )
    return TurnDetail(
        session_id=session_id, turn=tv.value, calls=calls, calls_more=more, untrusted=untrusted
    )
