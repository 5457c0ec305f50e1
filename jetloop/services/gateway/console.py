"""The web console's side of the gateway: its static files, and the JSON it reads.

The console (``console_assets/`` beside this module: one HTML page, one JavaScript module,
one style sheet, no build step, no library) is served at ``/`` by the gateway itself, so it
has the same tokens and scopes as any other client: the page holds no data, and everything
it shows comes from the ``/v1`` routes with the bearer token the person signed in with
(kept in the browser's ``sessionStorage``, never in a URL).

The routes here are the ones only a person's view needs, all paged so that no page of the
console loads everything however many sessions there are:

    GET /v1/whoami                                   the token's name and scopes
    GET /v1/namespaces                               the namespaces the token acts in
    GET /v1/events                                   SSE of every session, from now
    GET /v1/inbox                                    pending approvals, open questions
    GET /v1/sessions/{session}/turns/{turn}/timeline  a turn's events and calls
    GET /v1/sessions/{session}/events/{seq}          one event, whole
    GET /v1/dead-letters[/{seq}]                     JL_DEAD, newest first
    GET /v1/operations                               workers, agents, consumer lag

Everything is the request's namespace's (``?namespace=``, else the token's first): its
connection and its read model (``jetloop.services.gateway.state``). The page offers a
choice of namespace when the token holds more than one, and adds it to every request.

Lists and timelines come from the read model (``jetloop.services.readmodel``), dead letters and
operations from JetStream directly.
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path
from typing import Any

from aiohttp import web
from nats.js import api
from nats.js.errors import BadRequestError, NotFoundError

from jetloop.schemas.codec import readable
from jetloop.schemas.ids import idempotency_key
from jetloop.services.gateway import sse
from jetloop.services.gateway.http import (
    CONFIG,
    GRANT,
    METRICS,
    NATS_DOWN,
    Problem,
    ok,
    path_name,
    read_query,
)
from jetloop.services.gateway.openapi import (
    ASSET,
    SEQ,
    DeadLetter,
    DeadLetters,
    DeadQuery,
    Inbox,
    InboxItem,
    NamespaceList,
    Operations,
    PageQuery,
    Timeline,
    TimelineCall,
    TimelineEvent,
    TimelineQuery,
    Whoami,
)
from jetloop.services.gateway.state import STOPPING, client_of, namespace_of, readmodel_of
from jetloop.streams import topology

STATIC = Path(__file__).with_name("console_assets")
ASSET_RE = re.compile(ASSET)
SEQ_RE = re.compile(SEQ)
TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".txt": "text/plain",
    ".svg": "image/svg+xml",
    ".html": "text/html",
}
# The page runs only its own script and style, talks only to this origin, and is never
# framed: a token typed into it stays with it.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# What leaves a page without the registry's word: NATS away, or the namespace not reached.
NOT_NOW: tuple[type[BaseException], ...] = (*NATS_DOWN, Problem)
# Event data, dead-letter bodies: larger than this is cut in a page and fetched on demand.
PAYLOAD_CHARS = 2000


def _file(name: str) -> web.Response:
    path = STATIC / name
    if not path.is_file():
        raise Problem(404, "Not Found", f"no console file {name}")
    return web.Response(
        body=path.read_bytes(),
        headers={**HEADERS, "Content-Type": f"{TYPES[path.suffix]}; charset=utf-8"},
    )


async def index(request: web.Request) -> web.Response:
    return _file("index.html")


async def asset(request: web.Request) -> web.Response:
    return _file(path_name(request, "asset", ASSET_RE))


async def whoami(request: web.Request) -> web.Response:
    grant = request[GRANT]
    return ok(Whoami(name=grant.name, scopes=sorted(grant.scopes)))


async def token_namespaces(request: web.Request) -> web.Response:
    return ok(NamespaceList(namespaces=request[GRANT].ordered(), current=namespace_of(request)))


async def stream_all(request: web.Request) -> web.StreamResponse:
    """Every session's events, from now (or after Last-Event-ID): the console's live lists."""
    raw = request.headers.get("Last-Event-ID")
    app = request.app
    js = (await client_of(request)).js
    if raw is None:
        after = (await js.stream_info(topology.EVENTS_STREAM)).state.last_seq
    elif SEQ_RE.fullmatch(raw):
        after = int(raw)
    else:
        raise Problem(400, "invalid Last-Event-ID", "a JL_EVENTS stream sequence (digits)")
    app[METRICS].streams.inc()
    try:
        return await sse.stream(
            request, js, None, after, app[STOPPING], app[CONFIG].sse_keepalive_seconds
        )
    finally:
        app[METRICS].streams.dec()


async def add_worker_waits(request: web.Request, sessions: list[dict[str, Any]]) -> None:
    """Mark the page's busy sessions whose agent no live worker serves as waiting for a
    worker (the read model cannot know: it is the registry's, read once per page)."""
    busy = [r for r in sessions if r.get("status") not in (None, "idle") and r.get("agent")]
    if not busy:
        return
    try:
        client = await client_of(request)
        workers = await (await client.registry()).workers()
    except NOT_NOW:
        return  # the list still answers; it only cannot say this
    served = {a for w in workers for a in w.agents}
    for r in busy:
        if r["agent"] not in served:
            r["waiting_for"] = [*r.get("waiting_for", []), "worker"]


async def inbox(request: web.Request) -> web.Response:
    query = read_query(request, PageQuery)
    model = await readmodel_of(request).get()
    total, items = await model.inbox(query.limit, query.offset)
    return ok(
        Inbox(
            total=total,
            limit=query.limit,
            offset=query.offset,
            items=[InboxItem.model_validate(i) for i in items],
        )
    )


def _cut(data: str) -> tuple[Any, bool]:
    """The JSON text as data, or a preview when it is too large for a page."""
    if len(data) <= PAYLOAD_CHARS:
        return json.loads(data), False
    return data[:PAYLOAD_CHARS] + " …", True


def _event(row: dict[str, Any], whole: bool = False) -> TimelineEvent:
    text: str = row["data"]
    data, cut = (json.loads(text), False) if whole else _cut(text)
    return TimelineEvent(
        seq=row["seq"],
        key=row["key"],
        type=row["type"],
        at=row["at"],
        data=data,
        truncated=cut,
        size=len(text),
    )


def _call(namespace: str, session: str, turn: str, row: dict[str, Any]) -> TimelineCall:
    call = TimelineCall.model_validate(row)
    if call.model_step is not None and call.call_index is not None:
        call.idempotency_key = idempotency_key(
            session, turn, call.model_step, call.call_index, namespace
        )
    return call


async def timeline(request: web.Request) -> web.Response:
    session, turn_id = path_name(request, "session"), path_name(request, "turn_id")
    query = read_query(request, TimelineQuery)
    model = await readmodel_of(request).get()
    turn = await model.turn_row(session, turn_id)
    if turn is None:
        raise Problem(404, "no such turn", f"{session}/{turn_id} (not in the read model yet?)")
    events = await model.turn_events(session, turn_id, query.after, query.limit)
    calls = await model.turn_calls(session, turn_id, 1000)
    # (A page is ``limit`` messages of the log: one of the folded log may carry two events.)
    full = len({e["seq"] for e in events}) == query.limit
    return ok(
        Timeline(
            session_id=session,
            turn_id=turn_id,
            turn=turn,
            calls=[_call(namespace_of(request), session, turn_id, c) for c in calls],
            events=[_event(e) for e in events],
            next_after=events[-1]["seq"] if full else None,
        )
    )


async def event(request: web.Request) -> web.Response:
    session, seq = path_name(request, "session"), path_name(request, "seq", SEQ_RE)
    model = await readmodel_of(request).get()
    row = await model.event(session, int(seq))
    if row is None:
        raise Problem(404, "no such event", f"{session} #{seq}")
    return ok(_event(row, whole=True))


def _letter(m: api.RawStreamMsg, whole: bool = False) -> DeadLetter:
    h = dict(m.headers or {})
    body = readable(m.data or b"")
    text = json.dumps(body, default=str, ensure_ascii=False)
    cut = not whole and len(text) > PAYLOAD_CHARS
    return DeadLetter(
        seq=m.seq or 0,
        time=str(m.time) if m.time else None,
        subject=h.get("Jl-Dead-Subject", m.subject or ""),
        stream=h.get("Jl-Dead-Stream"),
        stream_seq=h.get("Jl-Dead-Sequence"),
        reason=h.get("Jl-Dead-Reason", "(none given)"),
        body=text[:PAYLOAD_CHARS] + " …" if cut else body,
        truncated=cut,
        size=len(text),
    )


async def dead_letters(request: web.Request) -> web.Response:
    """Newest first, ``limit`` at a time: read backwards by sequence from ``before``."""
    query = read_query(request, DeadQuery)
    js = (await client_of(request)).js
    state = (await js.stream_info(topology.DEAD_STREAM)).state
    seq = min(query.before - 1 if query.before else state.last_seq, state.last_seq)
    letters: list[DeadLetter] = []
    # A removed letter leaves a gap: bounded probes, so one page never reads the stream.
    probes = query.limit * 4
    while seq >= max(state.first_seq, 1) and len(letters) < query.limit and probes:
        probes -= 1
        try:
            letters.append(_letter(await js.get_msg(topology.DEAD_STREAM, seq=seq)))
        except NotFoundError:
            pass
        seq -= 1
    more = seq >= max(state.first_seq, 1)
    return ok(
        DeadLetters(total=state.messages, letters=letters, next_before=seq + 1 if more else None)
    )


async def dead_letter(request: web.Request) -> web.Response:
    seq = int(path_name(request, "seq", SEQ_RE))
    js = (await client_of(request)).js
    try:
        if seq < 1:
            raise NotFoundError
        m = await js.get_msg(topology.DEAD_STREAM, seq=seq)
    except (NotFoundError, BadRequestError):  # none there; a sequence the server refuses
        raise Problem(404, "no such dead letter", f"JL_DEAD #{seq}") from None
    return ok(_letter(m, whole=True))


async def operations(request: web.Request) -> web.Response:
    client = await client_of(request)
    reg = await client.registry()
    workers = await reg.workers()
    consumers, streams = [], []
    for info in sorted(await client.js.streams_info(), key=lambda i: i.config.name or ""):
        name = info.config.name or ""
        if not name.startswith("JL_"):
            continue  # the KV buckets' streams: their "lag" means nothing to a person
        streams.append(
            {
                "name": name,
                "messages": info.state.messages,
                "bytes": info.state.bytes,
                "last_seq": info.state.last_seq,
            }
        )
        for ci in sorted(await client.js.consumers_info(name), key=lambda c: c.name):
            if not ci.config.durable_name:
                continue  # clients' ephemeral watchers
            consumers.append(
                {
                    "stream": name,
                    "name": ci.name,
                    "pending": ci.num_pending or 0,
                    "ack_pending": ci.num_ack_pending or 0,
                    "redelivered": ci.num_redelivered or 0,
                }
            )
    position: int | None = None
    try:
        position = await (await readmodel_of(request).get()).position()
    except (Problem, sqlite3.Error):
        pass  # no read model yet (or one its projector is making): the rest still answers
    return ok(
        Operations.model_validate(
            {
                "workers": [
                    {
                        "worker_id": w.worker_id,
                        "agents": list(w.agents),
                        "pools": list(w.pools),
                        "since": w.since,
                        "release": w.release,
                        "reads": w.reads,
                    }
                    for w in sorted(workers, key=lambda w: w.worker_id)
                ],
                "agents": await reg.declared(),
                "consumers": consumers,
                "streams": streams,
                "readmodel_position": position,
            }
        )
    )
