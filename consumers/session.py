"""The session: accepts turn requests in order, runs one turn at a time, queues the rest.

Turn requests come from ``JL_TURNS`` (a work queue, so the first stored message of a
session is the next one to accept: FIFO even with many workers). The same request id names
the same turn (``turn_id_for``), and the turn record is created only if absent, so a
duplicate request is dropped however late it comes. ``turn_done`` moves the session on.
"""

from __future__ import annotations

import json
from datetime import datetime

import structlog
from nats.js.errors import NotFoundError

from consumers.errors import DeadLetter, RetryLater
from consumers.followers import Followers, turn_start
from consumers.logcontext import bind_step
from consumers.runtime import Delivery
from schemas import (
    Event,
    EventType,
    SessionRecord,
    StepMessage,
    TurnRecord,
    TurnRequest,
    TurnStatus,
    decode,
    turn_id_for,
    validate_name,
)
from schemas.codec import DecodeError, decode_map
from streams.bus import event_out
from streams.state import Conflict, session_key, turn_key
from streams.topology import TURNS_STREAM, session_turns_filter

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
    request_id = _request_id(d)
    req = _decode_request(d.msg.data)
    if rt.app.agent(agent_name) is None:
        raise DeadLetter(f"unknown agent {agent_name!r}")
    bind_step(session=sid)

    # FIFO: accept only the first stored request of this session.
    seq = d.msg.metadata.sequence.stream
    try:
        first = await rt.js.get_msg(
            TURNS_STREAM, seq=1, subject=session_turns_filter(sid), next=True
        )
        if first.seq is not None and first.seq < seq:
            raise RetryLater(0.1, f"an earlier request of session {sid} is not accepted yet")
    except NotFoundError:
        pass

    tid = turn_id_for(sid, request_id)
    bind_step(turn=tid)
    cur = await rt.state.session(sid)
    if cur is not None and cur.value.agent != agent_name:
        raise DeadLetter(f"session {sid} belongs to agent {cur.value.agent!r}, not {agent_name!r}")

    turn = await rt.state.turn(sid, tid)
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
        )
        try:
            await rt.state.write(turn_key(sid, tid), record, None)
        except Conflict:
            raise RetryLater(0.05, "turn created concurrently") from None
        turn_rec = record
    else:
        turn_rec = turn.value
        if turn_rec.status.terminal:
            log.info("turn.duplicate_request", request_id=request_id)
            return

    try:
        if cur is None:
            session = SessionRecord(session_id=sid, agent=agent_name, active=tid)
            await rt.state.write(session_key(sid), session, None)
        else:
            session = cur.value
            if session.active != tid and tid not in session.queue:
                if session.active is None:
                    session = session.model_copy(update={"active": tid})
                else:
                    session = session.model_copy(update={"queue": [*session.queue, tid]})
                await rt.state.write(session_key(sid), session, cur.revision)
    except Conflict:
        raise RetryLater(0.05, "session changed concurrently") from None

    await rt.faults.point("turn_request.after_accept")
    accepted = Event(
        key=f"{sid}.{tid}.accepted",
        type=EventType.TURN_ACCEPTED,
        session_id=sid,
        turn_id=tid,
        data={"request_id": request_id, "queued": session.active != tid},
    )
    out = Followers([event_out(accepted)])
    if session.active == tid and turn_rec.status == TurnStatus.QUEUED:
        out = out + turn_start(turn_rec)
    await out.publish(rt.bus)


def _request_id(d: Delivery) -> str:
    found = request_id_of(d.msg.headers or {}, d.msg.metadata.timestamp)
    if found is None:
        raise DeadLetter("turn request has no Nats-Msg-Id (the request id)")
    return found


def request_id_of(hdrs: dict[str, str], stored: datetime) -> str | None:
    """The client's ``Nats-Msg-Id``; for a trigger's fire, the trigger and its fire time
    (``stored``: when the server stored the message). None when the request has none."""
    if hdrs.get("Jl-Request-Id"):
        return hdrs["Jl-Request-Id"]  # jetloop's clients scope Nats-Msg-Id by session
    if hdrs.get("Nats-Msg-Id"):
        return hdrs["Nats-Msg-Id"]
    if hdrs.get("Nats-Scheduler"):
        trigger = hdrs.get("Jl-Trigger") or hdrs["Nats-Scheduler"]
        # The stored message's time: identical however often this fire is delivered.
        fired = stored.replace(microsecond=0)
        return f"{trigger}@{fired:%Y-%m-%dT%H:%M:%SZ}"
    return None


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


async def on_turn_done(d: Delivery, step: StepMessage) -> None:
    """A turn ended: make the next queued turn active and start it."""
    rt = d.rt
    sid = step.session_id
    cur = await rt.state.session(sid)
    if cur is None:
        raise DeadLetter(f"turn_done for session {sid}, which has no record")
    session = cur.value
    if session.active == step.turn_id or step.turn_id in session.queue:
        queue = [t for t in session.queue if t != step.turn_id]
        active = session.active
        if active == step.turn_id:
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
                "last_turn": step.turn_id,
            }
        )
        try:
            await rt.state.write(session_key(sid), session, cur.revision)
        except Conflict:
            raise RetryLater(0.05, "session changed concurrently") from None
    if session.active is None:
        return
    nxt_turn = await rt.state.turn(sid, session.active)
    if nxt_turn is not None and nxt_turn.value.status == TurnStatus.QUEUED:
        await turn_start(nxt_turn.value).publish(rt.bus)
