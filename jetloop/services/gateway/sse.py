"""Server-Sent Events of one session's log (or of every session's, for the console's live
lists), resumable by stream sequence.

Each event goes out as ``id: <JL_EVENTS stream sequence>``, ``event: <type>``, ``data:
<Event JSON>``. A client that reconnects with ``Last-Event-ID: n`` gets everything after
sequence n of the session — no gap, no repeat — because the read starts an ephemeral
pull consumer at n + 1 (deliver by start sequence, filter ``jl.event.<session>.>``).
History entries share those subjects and are passed over (their sequences still count),
but for the events one carries in the folded log (``jetloop.schemas.log``): each goes out in
order, the last with the entry's sequence as its id and any before it with the sequence
before, so a client that reconnects between them reads the entry again (a repeat of an
event, never a gap; the same ``key`` tells it).
A consumer lost to a server restart or an election is made again from the next sequence,
the way ``Client.events`` does. Idle streams get a keep-alive comment, which is also how a
gone client is noticed (the write fails).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import structlog
from aiohttp import web
from nats.errors import Error as NatsError
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from jetloop.schemas import DecodeError, Event
from jetloop.schemas.log import events_in
from jetloop.streams import topology
from jetloop.streams.intake import Intake

log = structlog.get_logger("jetloop.gateway")

IDLE_POLL = 1.0  # how often a quiet stream looks at the stop flag and the keep-alive clock


async def follow(
    js: JetStreamContext,
    session_id: str | None,
    after: int,
    stopping: asyncio.Event,
    idle: float = IDLE_POLL,
) -> AsyncGenerator[tuple[int, Event] | None, None]:
    """(sequence, event) of the session (of every session: ``None``) after ``after``;
    ``None`` whenever it is quiet."""
    next_seq = after + 1
    subject = "jl.event.>" if session_id is None else topology.session_events_filter(session_id)
    while not stopping.is_set():
        cfg = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=next_seq,
            ack_policy=api.AckPolicy.NONE,
            inactive_threshold=30.0,
            mem_storage=True,
            num_replicas=1,
            filter_subject=subject,
        )
        try:
            intake = await Intake.ephemeral(js, topology.EVENTS_STREAM, cfg)
        except (TimeoutError, NatsError) as exc:  # no leader yet (an election, a restart)
            log.info("sse.subscribe_failed", session=session_id, error=str(exc))
            yield None
            await asyncio.sleep(0.2)
            continue
        try:
            quiet = 0
            while not stopping.is_set():
                try:
                    msgs = await intake.take(64, timeout=idle)
                except NatsError:
                    break
                if not msgs:
                    quiet += 1
                    if quiet % 5 == 0 and not await _alive(intake):
                        break
                    yield None
                    continue
                quiet = 0
                for m in msgs:
                    seq = m.metadata.sequence.stream
                    if seq < next_seq:
                        continue  # a redelivery across a consumer reset: already sent
                    next_seq = seq + 1
                    try:
                        told = events_in(m.subject, m.data)
                    except DecodeError as exc:
                        log.warning("sse.unreadable", seq=seq, error=str(exc))
                        continue
                    for i, ev in enumerate(told):
                        yield (seq if i == len(told) - 1 else seq - 1), ev
        finally:
            await intake.stop()


async def _alive(intake: Intake) -> bool:
    try:
        await intake.info()
    except (NotFoundError, TimeoutError, NatsError):
        return False
    return True


def frame(seq: int, ev: Event) -> bytes:
    # JSON has no raw newlines, so one data line carries the whole event.
    return f"id: {seq}\nevent: {ev.type.value}\ndata: {ev.model_dump_json()}\n\n".encode()


async def stream(
    request: web.Request,
    js: JetStreamContext,
    session_id: str | None,
    after: int,
    stopping: asyncio.Event,
    keepalive: float,
) -> web.StreamResponse:
    """Write the session's (every session's: ``None``) events to the client until it goes
    or the gateway stops."""
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            # Proxies such as nginx would otherwise hold events back in a buffer.
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    last_write = time.monotonic()
    try:
        await resp.write(b"retry: 2000\n: connected\n\n")
        async with aclosing(
            follow(js, session_id, after, stopping, min(IDLE_POLL, keepalive))
        ) as events:
            async for item in events:
                now = time.monotonic()
                if item is None:
                    if now - last_write >= keepalive:
                        await resp.write(b": keep-alive\n\n")
                        last_write = now
                    continue
                await resp.write(frame(*item))
                last_write = now
    except ConnectionResetError:
        pass  # the client went away; its next connection resumes by Last-Event-ID
    return resp
