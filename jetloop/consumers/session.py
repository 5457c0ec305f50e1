"""The session: accepts turn requests in order, runs one turn at a time, queues the rest.

Turn requests come from ``JL_TURNS`` (a work queue, so the first stored message of a
session is the next one to accept: FIFO even with many workers). The same request id names
the same turn (``turn_id_for``), and the turn record is created only if absent, so a
duplicate request is dropped however late it comes. ``turn_done`` moves the session on.
"""

from __future__ import annotations

import json
import time
from datetime import datetime

import structlog

from jetloop.consumers.carry import carry
from jetloop.consumers.errors import DeadLetter, RetryLater
from jetloop.consumers.followers import Followers, accepted_event, finished, turn_start
from jetloop.consumers.logcontext import bind_step
from jetloop.consumers.runtime import Delivery, Runtime
from jetloop.consumers.side_by_side import side_by_side
from jetloop.schemas import (
    SessionRecord,
    Spent,
    StepMessage,
    TurnRecord,
    TurnRequest,
    TurnStatus,
    decode,
    scoped_msg_id,
    turn_id_for,
    validate_name,
)
from jetloop.schemas.codec import DecodeError, decode_map
from jetloop.schemas.ids import parse_traceparent
from jetloop.streams.bus import event_out
from jetloop.streams.replies import first_seq
from jetloop.streams.seal import SealBroken
from jetloop.streams.state import Conflict, Versioned, session_key, turn_key
from jetloop.streams.topology import TURNS_STREAM, session_turns_filter

log = structlog.get_logger("jetloop.session")


def _parse_subject(subject: str) -> tuple[str, str]:
    parts = subject.split(".")
    if len(parts) != 4:
        raise DeadLetter(f"turn subject {subject!r} is not jl.turn.<agent>.<session>")
    try:
        return validate_name("agent", parts[2]), validate_name("session id", parts[3])
    except ValueError as exc:
        raise DeadLetter(str(exc)) from None


async def on_turn_request(d: Delivery) -> None:
    rt = d.rt
    agent_name, sid = _parse_subject(d.msg.subject)
    request_id = _request_id(d, sid)
    req = _decode_request(d.msg.data)
    if rt.app.agent(agent_name) is None:
        raise DeadLetter(f"unknown agent {agent_name!r}")
    bind_step(session=sid)

    tid = turn_id_for(sid, request_id)
    bind_step(turn=tid)
    # Asked together (independent reads, one round trip): the session's first stored
    # request, and the turn and session records.
    try:
        first_seq, (turn, cur) = await side_by_side(
            _first_request(rt, sid), rt.state.turn_view(sid, tid)
        )
    except SealBroken as exc:
        if exc.key != session_key(sid):
            raise
        reason = (
            f"session {sid} is refused: {exc}; delete its record to go on "
            f"(nats kv del jl_state session.{sid})"
        )
        await _refuse(rt, sid, tid, agent_name, request_id, req, reason)
        raise  # the request itself is dead-lettered with the reason, kept for the operator
    # FIFO: accept only the first stored request of this session.
    if first_seq is not None and first_seq < d.msg.metadata.sequence.stream:
        raise RetryLater(0.1, f"an earlier request of session {sid} is not accepted yet")
    if cur is not None and cur.value.agent != agent_name:
        reason = f"session {sid} belongs to agent {cur.value.agent!r}, not {agent_name!r}"
        if turn is None:  # (a turn of that id is the other agent's: left as it is)
            await _refuse(rt, sid, tid, agent_name, request_id, req, reason)
        raise DeadLetter(reason)

    if turn is None:
        text, text_ref = req.text, req.text_ref
        if text_ref is None and rt.blobs.too_big(text.encode()):
            # Sent inline by a raw publisher: kept once, in the blob store, by identity.
            text_ref = await rt.blobs.put(f"{sid}.{tid}.request", text.encode())
            text = ""
        record = TurnRecord(
            session_id=sid,
            turn_id=tid,
            agent=agent_name,
            request_id=request_id,
            text=text,
            text_ref=text_ref,
            parent=req.parent,
            traceparent=_traceparent(d.msg.headers, req),
            accepted_at=time.time(),
        )
        try:
            turn_rev = await rt.state.write(turn_key(sid, tid), record, None)
        except Conflict:
            raise RetryLater(0.05, "turn created concurrently") from None
        turn_rec = record
    else:
        turn_rec, turn_rev = turn.value, turn.revision
        if turn_rec.status.terminal:
            log.info("turn.duplicate_request", request_id=request_id)
            return

    try:
        if cur is None:
            session = SessionRecord(session_id=sid, agent=agent_name, active=tid)
            session_rev = await rt.state.write(session_key(sid), session, None)
        else:
            session, session_rev = cur.value, cur.revision
            if session.active != tid and tid not in session.queue:
                if session.active is None:
                    session = session.model_copy(update={"active": tid})
                else:
                    session = session.model_copy(update={"queue": [*session.queue, tid]})
                session_rev = await rt.state.write(session_key(sid), session, cur.revision)
    except Conflict:
        raise RetryLater(0.05, "session changed concurrently") from None

    await rt.faults.point("turn_request.after_accept")
    accepted = accepted_event(turn_rec, queued=session.active != tid)
    if session.active == tid and turn_rec.status == TurnStatus.QUEUED:
        carried = carry(rt.state.sealer, turn_rec, turn_rev, session, session_rev)
        out = turn_start(turn_rec, carried, folded=rt.folded_log, accepted=accepted)
    elif rt.folded_log and session.active == tid:
        # Delivered again after its turn started: told again as it was (the folded log
        # carries ``turn.accepted`` in the user's entry; the same key lands once).
        out = Followers(turn_start(turn_rec, folded=True, accepted=accepted).records, [], True)
    else:
        out = Followers([event_out(accepted)], restorable=True)
    await out.publish(rt.bus)


async def _refuse(
    rt: Runtime,
    sid: str,
    tid: str,
    agent_name: str,
    request_id: str,
    req: TurnRequest,
    reason: str,
) -> None:
    """A request the session refuses (its record does not verify, or the session is another
    agent's): the turn is not run, but it ends, failed with the reason (its record and its
    ``turn.failed`` event), so the caller's wait returns and every view says the same; then
    the request is dead-lettered, as before. A session whose record does not verify stays
    refused until an operator deletes it (docs/security.md, "State seals")."""
    found = await rt.state.turn(sid, tid)
    if found is not None and found.value.status.terminal:
        failed = found.value  # refused before: say it again (the events are deduplicated)
    else:
        base = found.value if found is not None else None
        if base is None:
            inline = req.text_ref is None and rt.blobs.too_big(req.text.encode())
            base = TurnRecord(
                session_id=sid,
                turn_id=tid,
                agent=agent_name,
                request_id=request_id,
                text="" if inline else req.text,
                text_ref=req.text_ref,
                parent=req.parent,
            )
        failed = base.model_copy(
            update={"status": TurnStatus.FAILED, "error": reason, "attempt": None}
        )
        try:
            await rt.state.write(
                turn_key(sid, tid), failed, found.revision if found is not None else None
            )
        except Conflict:
            raise RetryLater(0.05, "turn changed while refusing it") from None
        log.warning("turn.refused", reason=reason)
    await finished(failed, folded=rt.folded_log).publish(rt.bus)


async def _first_request(rt: Runtime, sid: str) -> int | None:
    """The stream sequence of the first request of session ``sid`` still in ``JL_TURNS``."""
    return await first_seq(rt.nc, TURNS_STREAM, session_turns_filter(sid), rt.state.read_timeout)


def _request_id(d: Delivery, session_id: str) -> str:
    try:
        found = request_id_of(d.msg.headers or {}, session_id, d.msg.metadata.timestamp)
    except UnscopedRequestId as exc:
        raise DeadLetter(str(exc)) from None
    if found is None:
        raise DeadLetter(
            f"turn request has no Nats-Msg-Id: send 'Nats-Msg-Id: {session_id}.<request id>'"
        )
    return found


class UnscopedRequestId(ValueError):
    """A turn request whose ``Nats-Msg-Id`` is not ``<session>.<request id>``.

    ``JL_TURNS`` drops a message whose id it has seen in its dedupe window on *any*
    subject, so an id that is not scoped by its session would make the same request id in
    a second session a silent duplicate that never runs. Such a request is refused (dead
    -lettered with this reason) on its first use, not only when two sessions collide."""


# jetloop's own copies of a held request (``jetloop.services.rescue``) carry the request id in
# ``Jl-Request-Id`` and a message id of their own.
RESCUE_ID_PREFIX = "rescue."


def request_id_of(hdrs: dict[str, str], session_id: str, stored: datetime) -> str | None:
    """The request id of a turn request on ``jl.turn.<agent>.<session_id>``.

    - a fire of a trigger (``Nats-Scheduler``, made by the server): ``Jl-Request-Id`` (a
      one-off schedule) or the trigger and its fire time (``stored``, when the server
      stored the message: identical however often this fire is delivered);
    - ``Jl-Request-Id`` when set (jetloop's clients); ``Nats-Msg-Id`` must then be
      ``<session_id>.<Jl-Request-Id>`` (or a rescue copy's id);
    - otherwise ``Nats-Msg-Id``, which must be ``<session_id>.<request id>``: the request
      id is what follows the session.

    None when the request carries no id; ``UnscopedRequestId`` when its id is not scoped.
    """
    if hdrs.get("Nats-Scheduler"):
        if hdrs.get("Jl-Request-Id"):
            return hdrs["Jl-Request-Id"]
        trigger = hdrs.get("Jl-Trigger") or hdrs["Nats-Scheduler"]
        fired = stored.replace(microsecond=0)
        return f"{trigger}@{fired:%Y-%m-%dT%H:%M:%SZ}"
    msg_id = hdrs.get("Nats-Msg-Id")
    given = hdrs.get("Jl-Request-Id")
    if given:
        expected = scoped_msg_id(session_id, given)
        if msg_id and msg_id != expected and not msg_id.startswith(RESCUE_ID_PREFIX):
            raise UnscopedRequestId(
                f"Nats-Msg-Id {msg_id!r} does not match Jl-Request-Id {given!r}: send "
                f"'Nats-Msg-Id: {expected}' (JL_TURNS drops a repeated message id across "
                "all sessions; see docs/protocol.md)"
            )
        return given
    if not msg_id:
        return None
    prefix = scoped_msg_id(session_id, "")
    if not msg_id.startswith(prefix) or msg_id == prefix:
        raise UnscopedRequestId(
            f"Nats-Msg-Id {msg_id!r} is not '{prefix}<request id>': JL_TURNS drops a "
            "repeated message id across all sessions, so the request id is scoped by its "
            "session (see docs/protocol.md)"
        )
    return msg_id[len(prefix) :]


def _decode_request(data: bytes) -> TurnRequest:
    """msgpack, as jetloop publishes; JSON too, so `nats pub` can send a message. Either
    way the whole request is checked here (its schema version, ``metadata.parent``), so
    nothing later in the handler can fail on what it carries: a bad one is dead-lettered."""
    if data[:1] == b"{":
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise DecodeError(f"body is not JSON: {exc}") from None
        return decode_map(TurnRequest, raw)
    return decode(TurnRequest, data)


def _traceparent(headers: dict[str, str] | None, req: TurnRequest) -> str | None:
    """The caller's W3C trace context: the message's ``traceparent`` header, else its
    ``metadata.traceparent``; one that is malformed is dropped (the turn starts a trace of
    its own), as W3C Trace Context says."""
    for value in ((headers or {}).get("traceparent"), req.metadata.get("traceparent")):
        if isinstance(value, str) and parse_traceparent(value) is not None:
            return value.strip().lower()
    return None


async def on_turn_done(d: Delivery, step: StepMessage) -> None:
    """A ``turn_done`` message (published by workers of an earlier version): as
    ``session_moves_on``."""
    ended = await d.rt.state.turn(step.session_id, step.turn_id)
    spent = ended.value.spent if ended is not None else Spent()
    await session_moves_on(d.rt, step.session_id, step.turn_id, spent)


async def end_turn(
    rt: Runtime, turn: TurnRecord, session: Versioned[SessionRecord] | None = None
) -> None:
    """A turn ended (its terminal record is committed): publish its last words and event,
    then move its session on — in the step that ended it, not in a message of its own. A
    redelivery of that step finds the turn ended and calls this again: both parts are
    idempotent (message ids; the session moves only while the turn is still in it).
    ``session``: the session's record as the step read it (``session_moves_on``)."""
    await finished(turn, folded=rt.folded_log).publish(rt.bus)
    if rt.tracing is not None:
        rt.tracing.turn_ended(turn)
    await session_moves_on(rt, turn.session_id, turn.turn_id, turn.spent, session)


# A session record written by two steps at once (a turn request queued while a turn
# ends): the loser reads it again, this often, before its step is handed back.
SESSION_WRITE_TRIES = 5


async def session_moves_on(
    rt: Runtime,
    sid: str,
    turn_id: str,
    spent: Spent,
    known: Versioned[SessionRecord] | None = None,
) -> None:
    """Turn ``turn_id`` ended: make the next queued turn active and start it, and add what
    its model calls used (``spent``) to the session's count, once (only while the turn is
    still in the session).

    ``known``: the session's record as the ending step read it, written over without a
    read of its own when it still holds the turn (a revision moved on since fails the
    write, and the record is read again); one that no longer does is read again first."""
    for _ in range(SESSION_WRITE_TRIES):
        if known is not None and (known.value.active == turn_id or turn_id in known.value.queue):
            cur: Versioned[SessionRecord] | None = known
        else:
            cur = await rt.state.session(sid)
        known = None
        if cur is None:
            raise DeadLetter(f"turn_done for session {sid}, which has no record")
        session = cur.value
        if session.active == turn_id or turn_id in session.queue:
            queue = [t for t in session.queue if t != turn_id]
            active = session.active
            if active == turn_id:
                # The next queued turn that is still to run (a queued turn may be cancelled).
                active = None
                while queue:
                    cand = queue.pop(0)
                    cand_turn = await rt.state.turn(sid, cand)
                    if cand_turn is not None and cand_turn.value.status == TurnStatus.QUEUED:
                        active = cand
                        break
            session = session.model_copy(
                update={
                    "active": active,
                    "queue": queue,
                    "turns_done": session.turns_done + 1,
                    "last_turn": turn_id,
                    "spent": session.spent.add(spent),
                }
            )
            try:
                await rt.state.write(session_key(sid), session, cur.revision)
            except Conflict:
                continue
        break
    else:
        raise RetryLater(0.05, "session changed concurrently")
    if session.active is None:
        return
    nxt_turn = await rt.state.turn(sid, session.active)
    if nxt_turn is not None and nxt_turn.value.status == TurnStatus.QUEUED:
        await turn_start(nxt_turn.value, folded=rt.folded_log).publish(rt.bus)
