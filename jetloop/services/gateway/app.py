"""The HTTP gateway: jetloop's API over aiohttp, for programs that do not speak NATS.

Routes (the OpenAPI 3.1 document is ``jetloop.services.gateway.openapi``, served at
``/v1/openapi.json``; a test holds it to this table):

    POST /v1/agents/{agent}/sessions/{session}/messages   write    send; Idempotency-Key
    GET  /v1/sessions                                     read     list/search (read model)
    GET  /v1/sessions/{session}                           read     snapshot, history paging
    GET  /v1/sessions/{session}/turns                     read     past turns, newest first
    GET  /v1/sessions/{session}/turns/{turn_id}           read     a turn, its calls, outcomes
    GET  /v1/sessions/{session}/events                    read     SSE, Last-Event-ID
    POST /v1/sessions/{session}/approvals/{approval_id}   approve  approve or reject
    POST /v1/sessions/{session}/questions/{question_id}   write    answer
    POST /v1/sessions/{session}/cancel                    write    cancel the running turn
    POST /v1/calls/{call_key}/reconcile                   approve  settle outcome_unknown
    POST /v1/hooks/{trigger}                              (signed) webhooks start turns
    GET  /v1/whoami                                       read     the token's name, scopes
    GET  /v1/namespaces                                   read     the token's namespaces
    GET  /v1/events                                       read     SSE of every session
    GET  /v1/inbox                                        read     pending approvals, questions
    GET  /v1/sessions/{session}/turns/{turn_id}/timeline  read     a turn's events and calls
    GET  /v1/sessions/{session}/events/{seq}              read     one event, whole
    GET  /v1/dead-letters[/{seq}]                         read     dead letters, newest first
    GET  /v1/operations                                   read     workers, agents, lag
    GET  /, /console/{asset}                              (open)   the web console
    GET  /v1/openapi.json, /healthz, /readyz, /metrics    (open)

Each request with a token acts in one namespace (``jetloop.services.namespaces``: a NATS
account of its own): the one its ``?namespace=`` names, or the token's first (``default``
when it holds it, else the first by name). A namespace the token does not hold is a 403,
whether it exists or not; a name that cannot be one, a 422. Requests without a token act in
``default``, a webhook in its trigger's ``namespace``. The namespace's connection and read
model serve it (``jetloop.services.gateway.state.Namespaces``): the default's is given to
``make_app`` as before, the others' come from its ``urls_for`` on first use; without it a
namespace other than the default is a 503.

Everything that changes something goes through ``jetloop.services.client.Client`` — the same
idempotent operations as the CLI and the NATS control API; the gateway holds no state of
its own. An ``Idempotency-Key`` (or a webhook's id) becomes the request id (the turn
request's ``Nats-Msg-Id`` is ``<session>.<request id>``), so a resend starts no second turn.

Every error is ``application/problem+json`` (RFC 9457) with a title, status and detail:
aiohttp's own 404/405/413, authentication (401 with ``WWW-Authenticate``, 403), invalid
bodies (422 with the field errors), ``ControlError`` (its status), NATS outages (503).

Lifecycle (docs/design.md, convention 3; aiohttp's ``cleanup_ctx``): NATS, then the read model, are
opened in order at start-up and closed in reverse; ``on_shutdown`` ends the event streams first.
``Gateway`` has ``run()`` / idempotent ``stop()`` / ``async with`` like the worker.

This module holds the handlers, the route table and the app; beside it in
``jetloop.services.gateway``: ``http`` (errors, auth, metrics, parsing), ``browser`` (what a
web page may not do), ``sse`` (event streams), ``hooks`` (webhook signatures), ``openapi``
(shapes and document), ``config`` (what it is configured with), ``console`` (the web console),
``guard`` (slow and many clients).
"""

from __future__ import annotations

import asyncio
import functools
import re
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import click
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import ValidationError

from jetloop.schemas.errors import SettingsError, TurnFailed
from jetloop.schemas.ids import parse_traceparent
from jetloop.services import namespaces
from jetloop.services.gateway import console, hooks, sse
from jetloop.services.gateway.browser import browser_rules, json_writes
from jetloop.services.gateway.config import (
    GatewayConfig,
    Scope,
    TokenGrant,
    exposure_error,
    is_loopback,
)
from jetloop.services.gateway.guard import ConnectionGuard
from jetloop.services.gateway.http import (
    ANONYMOUS_NAMESPACES,
    AUTH_FAILURES,
    CONFIG,
    GRANT,
    METRICS,
    SCOPES,
    TOKENS,
    AuthFailures,
    Handler,
    Metrics,
    Problem,
    auth,
    body_deadline,
    by_whom,
    digest,
    measure,
    ok,
    path_name,
    problems,
    read_body,
    read_query,
)
from jetloop.services.gateway.openapi import (
    REQUEST_ID,
    AnswerIn,
    CancelIn,
    DecisionIn,
    HookOut,
    ListQuery,
    MessageIn,
    MessageQuery,
    ReconcileIn,
    SessionList,
    SessionRow,
    SnapshotQuery,
    TurnOut,
    TurnQuery,
    TurnsQuery,
    Usage,
    UsageQuery,
    openapi_document,
)
from jetloop.services.gateway.state import (
    CLIENT,
    NAMESPACE,
    NAMESPACES,
    NATS_CLOSED,
    NATS_URLS,
    READMODEL,
    STOPPING,
    URLS_FOR,
    Namespaces,
    ReadModelReader,
    UrlsFor,
    client_of,
    make_client,
    readmodel_of,
)
from jetloop.services.lifecycle import Service
from jetloop.services.logs import configure
from jetloop.services.settings import describe_errors, load_settings
from jetloop.sessions.decisions import dump
from jetloop.sessions.requests import (
    AnswerRequest,
    ApproveRequest,
    CancelRequest,
    DecisionRequest,
    ReconcileRequest,
    RejectRequest,
)
from jetloop.sessions.usage import totals_json
from jetloop.streams import topology
from jetloop.streams.connection import ConnectionLost, connect, finish

log = structlog.get_logger("jetloop.gateway")

CALL_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){3}$")
REQUEST_ID_RE = re.compile(REQUEST_ID)
SEQ_RE = re.compile(r"^[0-9]{1,19}$")

D = TypeVar("D", bound=DecisionRequest[Any])


# --- handlers --------------------------------------------------------------------------


async def send_message(request: web.Request) -> web.Response:
    agent, session = path_name(request, "agent"), path_name(request, "session")
    query = read_query(request, MessageQuery)
    key = request.headers.get("Idempotency-Key")
    if key is not None and not REQUEST_ID_RE.fullmatch(key):
        raise Problem(422, "invalid Idempotency-Key", "1-200 printable ASCII characters, no spaces")
    body = await read_body(request, MessageIn)
    client = await client_of(request)
    # The caller's W3C trace context parents the turn's trace; a malformed one is ignored,
    # as Trace Context asks of a receiver.
    trace = request.headers.get("traceparent")
    if trace is not None and parse_traceparent(trace) is None:
        trace = None
    h = await client.send(
        agent, session, body.text, request_id=key, traceparent=trace, will_wait=query.wait
    )
    out = TurnOut(
        agent=agent,
        session_id=session,
        turn_id=h.turn_id,
        request_id=h.request_id,
        duplicate=h.duplicate,
        status=h.status.value if h.status else "accepted",
    )
    where = {"Location": f"/v1/sessions/{session}"}
    if not query.wait:
        return ok(out, 202, **where)
    timeout = min(query.timeout, request.app[CONFIG].wait_max_seconds)
    try:
        res = await client.wait(h, timeout)
    except TimeoutError:
        return ok(out.model_copy(update={"status": "pending"}), 202, **where)
    except TurnFailed as exc:
        failed = {"status": exc.turn.status.value, "error": exc.turn.error}
        return ok(out.model_copy(update=failed))
    return ok(out.model_copy(update={"status": res.status.value, "text": res.text}))


async def list_sessions(request: web.Request) -> web.Response:
    query = read_query(request, ListQuery)
    model = await readmodel_of(request).get()
    page = await model.list_sessions(query.q, query.status, query.agent, query.limit, query.offset)
    await console.add_worker_waits(request, page.sessions)
    return ok(
        SessionList(
            total=page.total,
            limit=query.limit,
            offset=query.offset,
            sessions=[SessionRow.model_validate(r) for r in page.sessions],
        )
    )


async def get_session(request: web.Request) -> web.Response:
    session = path_name(request, "session")
    query = read_query(request, SnapshotQuery)
    client = await client_of(request)
    snap = await client.snapshot(session, query.history_offset, query.history_limit)
    if snap is None:
        raise Problem(404, "no such session", session)
    return ok(snap)


async def get_usage(request: web.Request) -> web.Response:
    """The usage ledger's totals, from the read model (``jetloop.sessions.usage``: the same
    sums as ``jetloop usage``)."""
    query = read_query(request, UsageQuery)
    if query.turn is not None and query.session is None:
        raise Problem(422, "turn needs session", "give session= with turn=")
    model = await readmodel_of(request).get()
    lines = [
        line
        for line in await model.usage_lines(query.session)
        if (query.turn is None or line.turn_id == query.turn)
        and (query.agent is None or line.agent == query.agent)
        and (query.day is None or line.day == query.day)
    ]
    return ok(Usage.model_validate(totals_json(lines, query.by)))


async def list_turns(request: web.Request) -> web.Response:
    session = path_name(request, "session")
    query = read_query(request, TurnsQuery)
    return ok(await (await client_of(request)).turns(session, query.limit, query.offset))


async def get_turn(request: web.Request) -> web.Response:
    session, turn_id = path_name(request, "session"), path_name(request, "turn_id")
    query = read_query(request, TurnQuery)
    client = await client_of(request)
    return ok(await client.turn_calls(session, turn_id, query.calls_limit))


async def stream_events(request: web.Request) -> web.StreamResponse:
    session = path_name(request, "session")
    raw = request.headers.get("Last-Event-ID") or request.query.get("after") or "0"
    if not SEQ_RE.fullmatch(raw):
        raise Problem(400, "invalid Last-Event-ID", "a JL_EVENTS stream sequence (digits)")
    app = request.app
    js = (await client_of(request)).js
    app[METRICS].streams.inc()
    try:
        return await sse.stream(
            request,
            js,
            session,
            int(raw),
            app[STOPPING],
            app[CONFIG].sse_keepalive_seconds,
        )
    finally:
        app[METRICS].streams.dec()


def decision(request: web.Request, model: type[D], body: dict[str, Any], **path: str) -> D:
    """The decision a request asks for: the path's names, the body's fields and, as who
    decides, the token's name (``by_whom``: the body may not name one)."""
    return model.model_validate({**body, **path, "by": by_whom(request)})


async def decide_approval(request: web.Request) -> web.Response:
    session, approval_id = path_name(request, "session"), path_name(request, "approval_id")
    fields = (await read_body(request, DecisionIn)).model_dump()
    model = ApproveRequest if fields.pop("approve") else RejectRequest
    req = decision(request, model, fields, session_id=session, approval_id=approval_id)
    return ok(dump(await (await client_of(request)).decide(req)))


async def answer_question(request: web.Request) -> web.Response:
    session, question_id = path_name(request, "session"), path_name(request, "question_id")
    body = (await read_body(request, AnswerIn)).model_dump()
    req = decision(request, AnswerRequest, body, session_id=session, question_id=question_id)
    return ok(dump(await (await client_of(request)).decide(req)))


async def cancel_turn(request: web.Request) -> web.Response:
    session = path_name(request, "session")
    body = (await read_body(request, CancelIn, optional=True)).model_dump()
    req = decision(request, CancelRequest, body, session_id=session)
    return ok(dump(await (await client_of(request)).decide(req)))


async def reconcile_call(request: web.Request) -> web.Response:
    key = path_name(request, "call_key", CALL_KEY_RE)
    body = (await read_body(request, ReconcileIn)).model_dump()
    req = decision(request, ReconcileRequest, body, call_key=key)
    return ok(dump(await (await client_of(request)).decide(req)))


async def receive_webhook(request: web.Request) -> web.Response:
    app = request.app
    name = request.match_info["trigger"]
    trigger = app[CONFIG].hooks.get(name)
    if trigger is None:
        app[METRICS].hooks.labels("unknown", "no_trigger").inc()
        raise Problem(404, "no such trigger", name)
    body = await request.read()
    try:
        delivery = hooks.verify(
            trigger, request.headers, body, time.time(), app[CONFIG].hook_tolerance_seconds
        )
        payload = hooks.payload_of(body)
        session = hooks.session_for(trigger, name, delivery, payload)
        text = hooks.text_for(trigger, name, delivery, payload)
    except hooks.HookRefused as exc:
        app[METRICS].hooks.labels(name, "refused").inc()
        log.info("webhook.refused", trigger=name, status=exc.status, reason=exc.title)
        raise Problem(exc.status, exc.title, exc.detail or None) from None
    client = await client_of(request, trigger.namespace)
    h = await client.send(
        trigger.agent,
        session,
        text,
        request_id=hooks.request_id_for(name, delivery),
        will_wait=False,
    )
    app[METRICS].hooks.labels(name, "duplicate" if h.duplicate else "accepted").inc()
    log.info(
        "webhook.accepted",
        trigger=name,
        namespace=trigger.namespace,
        session=session,
        turn=h.turn_id,
        duplicate=h.duplicate,
        delivery=delivery.id,
        sender_delivery=delivery.sender_id or None,
    )
    out = HookOut(
        agent=trigger.agent,
        session_id=session,
        turn_id=h.turn_id,
        request_id=h.request_id,
        duplicate=h.duplicate,
        status=h.status.value if h.status else "accepted",
        trigger=name,
        webhook_id=delivery.id,
    )
    return ok(out, 202, Location=f"/v1/sessions/{session}")


@functools.cache
def _document() -> dict[str, Any]:
    return openapi_document()


async def get_openapi(request: web.Request) -> web.Response:
    return web.json_response(_document())


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    client = request.app[CLIENT]
    if not client.nc.is_connected:
        raise Problem(503, "not ready", "NATS is not connected")
    missing = await asyncio.wait_for(topology.present(client.js), 5.0)
    if missing:
        raise Problem(503, "not ready", f"topology missing: {', '.join(missing)}", missing=missing)
    return web.json_response({"status": "ready", "missing": []})


async def metrics(request: web.Request) -> web.Response:
    # The gateway's own metrics, and the engine's (the default registry) when a worker runs
    # in this process, as under `jetloop up`.
    body = generate_latest(request.app[METRICS].registry) + generate_latest(REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    name: str  # = the operationId in the OpenAPI document
    scope: Scope | None  # None: open (or, for webhooks, signed)
    handler: Handler


ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/agents/{agent}/sessions/{session}/messages",
        "sendMessage",
        "write",
        send_message,
    ),
    Route("GET", "/v1/sessions", "listSessions", "read", list_sessions),
    Route("GET", "/v1/sessions/{session}", "getSession", "read", get_session),
    Route("GET", "/v1/sessions/{session}/turns", "listTurns", "read", list_turns),
    Route("GET", "/v1/sessions/{session}/turns/{turn_id}", "getTurn", "read", get_turn),
    Route("GET", "/v1/sessions/{session}/events", "streamEvents", "read", stream_events),
    Route(
        "POST",
        "/v1/sessions/{session}/approvals/{approval_id}",
        "decideApproval",
        "approve",
        decide_approval,
    ),
    Route(
        "POST",
        "/v1/sessions/{session}/questions/{question_id}",
        "answerQuestion",
        "write",
        answer_question,
    ),
    Route("POST", "/v1/sessions/{session}/cancel", "cancelTurn", "write", cancel_turn),
    Route("POST", "/v1/calls/{call_key}/reconcile", "reconcileCall", "approve", reconcile_call),
    Route("POST", "/v1/hooks/{trigger}", "receiveWebhook", None, receive_webhook),
    # The console's reads (jetloop.services.gateway.console).
    Route("GET", "/v1/whoami", "whoami", "read", console.whoami),
    Route("GET", "/v1/namespaces", "listNamespaces", "read", console.token_namespaces),
    Route("GET", "/v1/events", "streamAllEvents", "read", console.stream_all),
    Route("GET", "/v1/inbox", "getInbox", "read", console.inbox),
    Route(
        "GET",
        "/v1/sessions/{session}/turns/{turn_id}/timeline",
        "getTimeline",
        "read",
        console.timeline,
    ),
    Route("GET", "/v1/sessions/{session}/events/{seq}", "getEvent", "read", console.event),
    Route("GET", "/v1/dead-letters", "listDeadLetters", "read", console.dead_letters),
    Route("GET", "/v1/dead-letters/{seq}", "getDeadLetter", "read", console.dead_letter),
    Route("GET", "/v1/usage", "getUsage", "read", get_usage),
    Route("GET", "/v1/operations", "getOperations", "read", console.operations),
    Route("GET", "/", "console", None, console.index),
    Route("GET", "/console/{asset}", "consoleAsset", None, console.asset),
    Route("GET", "/v1/openapi.json", "getOpenAPI", None, get_openapi),
    Route("GET", "/healthz", "health", None, health),
    Route("GET", "/readyz", "ready", None, ready),
    Route("GET", "/metrics", "metrics", None, metrics),
)


# --- the app ---------------------------------------------------------------------------


def requested_namespace(request: web.Request, grant: TokenGrant) -> str:
    """The namespace ``?namespace=`` names (one the grant holds), else the grant's first."""
    given = request.query.getall("namespace", [])
    if not given:
        return grant.home
    try:
        if len(given) > 1:
            raise namespaces.NamespaceError("name one namespace")
        name = namespaces.check_name(given[0])
    except namespaces.NamespaceError as exc:
        raise Problem(
            422,
            "invalid query parameter",
            "1 error(s)",
            errors=[{"loc": ["namespace"], "msg": str(exc), "type": "value_error"}],
        ) from None
    if name not in grant.namespaces:
        # The same answer whether it exists or not: a token learns nothing of the others.
        raise Problem(403, "namespace not allowed", f"the token may not act in {name!r}")
    return name


@web.middleware
async def in_namespace(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Settle the namespace a request with a grant (``auth``) acts in."""
    grant = request.get(GRANT)
    if grant is not None:
        request[NAMESPACE] = requested_namespace(request, grant)
    return await handler(request)


async def _nats(app: web.Application) -> AsyncIterator[None]:
    urls = app[NATS_URLS]
    closed = app[NATS_CLOSED]

    async def on_closed() -> None:
        if not app[STOPPING].is_set():
            log.error("gateway.connection_closed")
            closed.set()

    nc = await connect(list(urls), name="jetloop-gateway", closed_cb=on_closed)
    config = app[CONFIG]
    if config.sealer is None:
        # Without the key the client sends decisions, answers and cancels to the workers'
        # control API (jl.control.*), and asks it for snapshots, which the workers verify;
        # the other state it reads (turns) is served unchecked only when
        # JETLOOP_READ_UNVERIFIED says so, else such a read is a 503.
        log.warning(
            "gateway.unsealed",
            hint="set JETLOOP_SEAL_KEY to the workers' key",
            state="read unverified" if config.read_unverified else "reads refused",
        )
    app[CLIENT] = make_client(nc, config)
    try:
        yield
    finally:
        await finish(nc)


async def _read_model(app: web.Application) -> AsyncIterator[None]:
    reader = ReadModelReader(app[CONFIG].readmodel_db)
    app[READMODEL] = reader
    try:
        yield
    finally:
        await reader.close()


async def _namespaces(app: web.Application) -> AsyncIterator[None]:
    found = Namespaces(app[CONFIG], app[CLIENT], app[READMODEL], app[URLS_FOR])
    app[NAMESPACES] = found
    try:
        yield
    finally:
        await found.close()


async def _stop_streams(app: web.Application) -> None:
    app[STOPPING].set()


def make_app(
    config: GatewayConfig,
    nats_urls: Sequence[str] | str,
    urls_for: UrlsFor | None = None,
    anonymous_namespaces: Callable[[], frozenset[str]] | None = None,
) -> web.Application:
    """The gateway's aiohttp application; NATS is connected when it starts.

    ``nats_urls`` reach the default namespace; ``urls_for(namespace)`` the server URLs, with a
    credential of that namespace, for the others (``Settings.for_namespace(ns).nats_urls``).
    Without it the gateway acts in the default namespace alone. ``anonymous_namespaces``: the
    namespaces a request without a token may act in, when ``anonymous_scopes`` lets it in
    (default: the default namespace)."""
    if isinstance(nats_urls, str):
        nats_urls = [u.strip() for u in nats_urls.split(",") if u.strip()]
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[
            measure,
            problems,
            browser_rules,
            auth,
            in_namespace,
            json_writes,
            body_deadline,
        ],
    )
    app[CONFIG] = config
    app[NATS_URLS] = tuple(nats_urls)
    app[URLS_FOR] = urls_for
    if anonymous_namespaces is not None:
        app[ANONYMOUS_NAMESPACES] = anonymous_namespaces
    app[TOKENS] = {digest(token): grant for token, grant in config.tokens.items()}
    app[SCOPES] = {r.name: r.scope for r in ROUTES}
    app[METRICS] = Metrics()
    app[AUTH_FAILURES] = AuthFailures(config.max_auth_failures, config.auth_failure_window_seconds)
    app[STOPPING] = asyncio.Event()
    app[NATS_CLOSED] = asyncio.Event()
    for r in ROUTES:
        app.router.add_route(r.method, r.path, r.handler, name=r.name)
    app.cleanup_ctx.append(_nats)
    app.cleanup_ctx.append(_read_model)
    app.cleanup_ctx.append(_namespaces)
    app.on_shutdown.append(_stop_streams)
    if not config.tokens and not config.anonymous_scopes:
        log.warning("gateway.no_tokens", hint="no token is configured: only open routes work")
    return app


class GatewayRefused(Exception):
    """The gateway will not serve this address with this configuration (one line)."""


class Gateway(Service):
    """The gateway as a service: ``run()`` serves until ``stop()``."""

    def __init__(
        self,
        config: GatewayConfig,
        nats_urls: Sequence[str] | str,
        host: str = "127.0.0.1",
        port: int = 8080,
        shutdown_timeout: float = 10.0,
        urls_for: UrlsFor | None = None,
        anonymous_namespaces: Callable[[], frozenset[str]] | None = None,
    ) -> None:
        """``nats_urls``, ``urls_for`` and ``anonymous_namespaces``: as ``make_app``'s."""
        super().__init__()
        self.config = config
        self.nats_urls = nats_urls
        self.urls_for = urls_for
        self.anonymous_namespaces = anonymous_namespaces
        self.host = host
        self.port = port
        self.shutdown_timeout = shutdown_timeout
        self.url: str | None = None

    async def run(self) -> None:
        config = self.config
        refused = exposure_error(config, self.host)
        if refused is not None:
            raise GatewayRefused(refused)
        if config.anonymous_scopes and not is_loopback(self.host):
            log.warning(
                "gateway.anonymous_remote",
                host=self.host,
                scopes=sorted(config.anonymous_scopes),
                hint="anyone who reaches this address has these scopes without a token",
            )
        app = make_app(config, self.nats_urls, self.urls_for, self.anonymous_namespaces)
        runner = web.AppRunner(
            app,
            access_log=None,  # the `measure` middleware logs requests through structlog
            shutdown_timeout=self.shutdown_timeout,
            # Between requests, and for the headers of every request after a connection's
            # first (jetloop.services.gateway.guard bounds the first).
            keepalive_timeout=config.header_timeout_seconds,
            # A body the handler did not read is drained at most this long, then closed.
            lingering_time=config.body_timeout_seconds,
        )
        await runner.setup()
        listener: asyncio.Server | None = None
        try:
            assert runner.server is not None
            guard = ConnectionGuard(
                runner.server, config.header_timeout_seconds, config.max_connections
            )
            listener = await asyncio.get_running_loop().create_server(
                guard, self.host, self.port, reuse_address=True
            )
            host, port = listener.sockets[0].getsockname()[:2]
            self.url = f"http://{host}:{port}"
            log.info("gateway.started", url=self.url)
            self._started.set()
            stopping = asyncio.create_task(self._stopping.wait())
            closed = asyncio.create_task(app[NATS_CLOSED].wait())
            try:
                await asyncio.wait((stopping, closed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                closed.cancel()
        finally:
            if listener is not None:
                listener.close()  # no new connections; the runner ends the open ones
            await runner.cleanup()
            if listener is not None:
                await listener.wait_closed()
            log.info("gateway.stopped")
        if app[NATS_CLOSED].is_set():
            # The default namespace's connection is never reopened: end, so a supervisor
            # starts a new one (another namespace's is made again on its next request).
            raise ConnectionLost("gateway")


async def run_gateway(
    config: GatewayConfig,
    nats_urls: Sequence[str] | str,
    host: str = "127.0.0.1",
    port: int = 8080,
    urls_for: UrlsFor | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM."""
    gateway = Gateway(config, nats_urls, host, port, urls_for=urls_for)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, gateway.stop_soon)
    try:
        await gateway.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


@click.command("gateway")
@click.option("--nats", "nats_url", help="NATS server URL(s), comma-separated")
@click.option("--host", default=None, help="address to listen on (default 127.0.0.1)")
@click.option("--port", type=int, default=None, help="port to listen on (default 8080)")
@click.option(
    "--allow-anonymous-remote",
    is_flag=True,
    default=None,
    help="serve JETLOOP_GATEWAY_ANONYMOUS_SCOPES on an address that is not loopback",
)
def gateway_command(
    nats_url: str | None, host: str | None, port: int | None, allow_anonymous_remote: bool | None
) -> None:
    """Serve the HTTP API (/v1), webhooks, SSE, health and metrics."""
    overrides: dict[str, object] = {}
    if nats_url:
        overrides["nats_url"] = nats_url
    if allow_anonymous_remote:
        overrides["gateway_allow_anonymous_remote"] = True
    try:
        settings = load_settings(**overrides)
        config = GatewayConfig.from_settings(settings)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    except ValidationError as exc:
        raise click.ClickException(describe_errors(exc, "JETLOOP_GATEWAY_")) from None
    configure(settings.log_format, settings.log_level)
    host = host or getattr(settings, "gateway_host", "127.0.0.1")
    port = port if port is not None else getattr(settings, "gateway_port", 8080)
    refused = exposure_error(config, str(host))
    if refused is not None:
        raise click.ClickException(refused)

    def urls_for(namespace: str) -> list[str]:
        return settings.for_namespace(namespace).nats_urls

    try:
        asyncio.run(run_gateway(config, settings.nats_urls, str(host), int(port), urls_for))
    except KeyboardInterrupt:
        pass
    except ConnectionLost as exc:  # exit 1, to be restarted
        raise click.ClickException(str(exc)) from None


if __name__ == "__main__":
    gateway_command()
