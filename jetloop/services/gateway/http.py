"""The gateway's HTTP plumbing: problem+json errors, bearer-token scopes, metrics, parsing.

Middlewares, outermost first: ``measure`` (Prometheus counts and latency, by route
template), ``problems`` (every error → ``application/problem+json``, RFC 9457), ``auth``
(the route's scope, from the app's scope table, against the bearer token's grant; an address
that sent too many unknown tokens is refused before its token is looked at, ``AuthFailures``),
``body_deadline`` (the body read under a deadline).
Handlers raise ``Problem`` for their own errors and let ``ControlError``, aiohttp's
``HTTPException`` and NATS outages through: ``problems`` answers them all the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import math
import re
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any, TypeVar

import structlog
from aiohttp import web
from nats.errors import Error as NatsError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ValidationError

from jetloop.schemas.errors import (
    ControlError,
    RecordNotTrusted,
    SealKeyMissing,
    UnknownAgent,
    UnknownSession,
    UnknownTurn,
)
from jetloop.services import namespaces
from jetloop.services.gateway.config import GatewayConfig, Scope, TokenGrant
from jetloop.streams.clock import CHECK_EVERY, ClockOff
from jetloop.streams.connection import TRANSIENT, PayloadTooLarge

log = structlog.get_logger("jetloop.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=BaseModel)

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})

# --- errors ----------------------------------------------------------------------------


def problem_type(status: int, title: str) -> str:
    """RFC 9457: ``about:blank`` only when the title is the status phrase; our own titles
    get a type of their own (a URN: there is no page to point at)."""
    try:
        if HTTPStatus(status).phrase == title:
            return "about:blank"
    except ValueError:
        pass
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    return f"urn:jetloop:problem:{slug}"


class Problem(Exception):
    """An error answered as problem+json; raised anywhere in a handler."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        close: bool = False,
        **extra: Any,
    ) -> None:
        super().__init__(f"{status} {title}: {detail}")
        self.status = status
        self.title = title
        self.detail = detail
        self.headers = dict(headers or {})
        self.close = close  # end the connection after the answer (aiohttp says so in its header)
        self.extra = extra

    def response(self) -> web.Response:
        body: dict[str, Any] = {
            "type": problem_type(self.status, self.title),
            "title": self.title,
            "status": self.status,
        }
        if self.detail:
            body["detail"] = self.detail
        body.update(self.extra)
        resp = web.json_response(
            body, status=self.status, content_type="application/problem+json", headers=self.headers
        )
        if self.close:
            resp.force_close()
        return resp


def from_http(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own errors (no route, wrong method, body too large) as problems."""
    keep = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
    detail = exc.text or None
    if exc.status == 404:
        detail = f"no route matches {request.path}"
    elif exc.status == 405:
        detail = f"{request.method} is not allowed here; allowed: {keep.get('Allow', '')}"
    elif detail is not None and detail.startswith(f"{exc.status}:"):
        detail = None
    return Problem(exc.status, exc.reason, detail, headers=keep).response()


def field_errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [
        {"loc": [str(p) for p in e["loc"]], "msg": e["msg"], "type": e["type"]}
        for e in exc.errors(include_url=False, include_input=False, include_context=False)
    ]


# What a NATS outage looks like once the client's short retries are spent.
NATS_DOWN: tuple[type[BaseException], ...] = (*TRANSIENT, NatsError)


@web.middleware
async def problems(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Problem as p:
        return p.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return from_http(request, exc)
    except ControlError as exc:
        return Problem(exc.status, exc.title, exc.detail or None).response()
    except UnknownAgent as exc:
        return Problem(404, "no such agent", str(exc)).response()
    except UnknownSession as exc:
        return Problem(404, "no such session", exc.session_id).response()
    except UnknownTurn as exc:
        return Problem(404, "no such turn", f"{exc.session_id}/{exc.turn_id}").response()
    except SealKeyMissing as exc:
        return Problem(503, "state cannot be verified", str(exc)).response()
    except ClockOff as exc:
        # The gateway's own clock: it decides nothing until the clock is set right.
        log.error("gateway.clock_off", error=str(exc), offset=round(exc.offset, 3))
        return Problem(
            503, "clock off", str(exc), headers={"Retry-After": str(int(CHECK_EVERY))}
        ).response()
    except RecordNotTrusted as exc:
        return Problem(409, "record not trusted", str(exc)).response()
    except PayloadTooLarge as exc:
        # Refused before it was sent: the connection is fine, the message is not.
        return Problem(413, "message too large", str(exc)).response()
    except NATS_DOWN as exc:
        log.warning("gateway.nats_unavailable", error=repr(exc), path=request.path)
        return Problem(
            503, "NATS unavailable", type(exc).__name__, headers={"Retry-After": "1"}
        ).response()
    except sqlite3.Error as exc:
        return Problem(503, "read model unavailable", str(exc)).response()
    except Exception:
        # Anything else is a bug: logged with its traceback, answered without details.
        # (CancelledError is not an Exception: a cancelled request stays cancelled.)
        log.exception("gateway.error", method=request.method, path=request.path)
        return Problem(500, "internal error", "see the gateway's log").response()


# --- state -----------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics of one app (its own registry, so several apps can coexist)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "jetloop_gateway_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "jetloop_gateway_request_duration_seconds",
            "HTTP request latency by route and method",
            ["route", "method"],
            registry=self.registry,
        )
        self.hooks = Counter(
            "jetloop_gateway_webhooks",
            "Webhook deliveries by trigger and outcome",
            ["trigger", "outcome"],
            registry=self.registry,
        )
        self.streams = Gauge(
            "jetloop_gateway_event_streams", "Open SSE streams", registry=self.registry
        )
        self.auth_refused = Counter(
            "jetloop_gateway_auth_refused",
            "Requests refused for their bearer token: unknown (401), or from an address that "
            "sent too many unknown ones (429, the token not looked at)",
            ["reason"],
            registry=self.registry,
        )


CONFIG = web.AppKey("config", GatewayConfig)
TOKENS: web.AppKey[dict[bytes, TokenGrant]] = web.AppKey("tokens")
SCOPES: web.AppKey[dict[str, Scope | None]] = web.AppKey("scopes")
METRICS = web.AppKey("metrics", Metrics)
# The namespaces a request without a token may act in (``jetloop up`` with no tokens: every
# namespace of its store, for the person at this machine); unset: the default one alone.
ANONYMOUS_NAMESPACES: web.AppKey[Callable[[], frozenset[str]]] = web.AppKey("anonymous_namespaces")
GRANT = web.RequestKey("grant", TokenGrant)


# --- auth ------------------------------------------------------------------------------


class AuthFailures:
    """Unknown bearer tokens counted per client address, so tokens cannot be guessed fast.

    An address's window opens with its first unknown token and lasts ``window`` seconds; once
    it has sent ``limit`` unknown tokens in it, every request of that address that carries an
    ``Authorization`` header is answered 429 (``Retry-After``: the rest of the window) without
    looking at the token, and the connection is closed. The next unknown token after the
    window opens a new one: at most ``limit`` guesses per window per address, whatever the
    rate. Requests without a token and open routes are not affected; a known token does not
    reset the count (else a valid ``read`` token would let its holder guess ``approve`` ones).

    IPv6 addresses count by their /64, which one host usually holds whole. At most ``capacity``
    addresses are remembered, the least recently failed one forgotten first, so memory stays
    bounded however many addresses try. Behind a reverse proxy every client has the proxy's
    address, and one guesser locks the others out: limit there instead.
    """

    def __init__(
        self,
        limit: int,
        window: float,
        capacity: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window = window
        self.capacity = capacity
        self.clock = clock
        # address -> (when its window opened, unknown tokens in it), least recent first
        self.seen: OrderedDict[str, tuple[float, int]] = OrderedDict()

    @staticmethod
    def key(remote: str | None) -> str:
        if remote is None:
            return "unknown"
        try:
            ip = ipaddress.ip_address(remote)
        except ValueError:
            return remote
        if isinstance(ip, ipaddress.IPv6Address):
            if ip.ipv4_mapped is not None:
                return str(ip.ipv4_mapped)
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
        return str(ip)

    def blocked(self, key: str) -> float | None:
        """Seconds until ``key`` may try again, or None when it may now."""
        entry = self.seen.get(key)
        if entry is None:
            return None
        opened, failures = entry
        left = opened + self.window - self.clock()
        if left <= 0:
            del self.seen[key]
            return None
        return left if failures >= self.limit else None

    def failed(self, key: str) -> bool:
        """Count an unknown token from ``key``; True when this one reached the limit."""
        now = self.clock()
        opened, failures = self.seen.pop(key, (now, 0))
        if now - opened >= self.window:
            opened, failures = now, 0
        self.seen[key] = (opened, failures + 1)  # last: the most recent
        while len(self.seen) > self.capacity:
            self.seen.popitem(last=False)
        return failures + 1 == self.limit


AUTH_FAILURES = web.AppKey("auth_failures", AuthFailures)


def digest(token: str) -> bytes:
    """Tokens are kept and looked up by their SHA-256."""
    return hashlib.sha256(token.encode()).digest()


def _challenge(error: str | None = None, scope: str | None = None) -> dict[str, str]:
    value = 'Bearer realm="jetloop"'
    if error:
        value += f', error="{error}"'
    if scope:
        value += f', scope="{scope}"'
    return {"WWW-Authenticate": value}


def authorize(request: web.Request, scope: Scope) -> TokenGrant:
    cfg = request.app[CONFIG]
    header = request.headers.get("Authorization")
    if header is None:
        if scope in cfg.anonymous_scopes:
            names = request.app.get(ANONYMOUS_NAMESPACES)
            if names is None:
                return TokenGrant(name="anonymous", scopes=cfg.anonymous_scopes)
            return TokenGrant(
                name="anonymous",
                scopes=cfg.anonymous_scopes,
                namespaces=names() | {namespaces.DEFAULT},
            )
        raise Problem(
            401,
            "authentication required",
            "send Authorization: Bearer <token>",
            headers=_challenge(),
        )
    kind, _, token = header.partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        raise Problem(
            401,
            "invalid authorization header",
            "expected: Bearer <token>",
            headers=_challenge("invalid_request"),
        )
    # Looked up by digest: the lookup's timing tells nothing about the tokens' text.
    grant: TokenGrant | None = request.app[TOKENS].get(digest(token.strip()))
    if grant is None:
        raise Problem(
            401, "invalid token", "the token is not known", headers=_challenge("invalid_token")
        )
    if scope not in grant.scopes:
        raise Problem(
            403,
            "insufficient scope",
            f"this needs the {scope!r} scope; the token has {sorted(grant.scopes)}",
            headers=_challenge("insufficient_scope", scope),
        )
    return grant


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    name = request.match_info.route.name
    scope = request.app[SCOPES].get(name) if name else None
    if scope is not None:
        request[GRANT] = guarded(request, scope)
    return await handler(request)


def guarded(request: web.Request, scope: Scope) -> TokenGrant:
    """``authorize``, unless the client's address is refused for guessing (429); an unknown
    token is counted. Both answers close the connection: each guess costs a new one."""
    app = request.app
    if "Authorization" not in request.headers:
        return authorize(request, scope)
    failures = app[AUTH_FAILURES]
    key = failures.key(request.remote)
    wait = failures.blocked(key)
    if wait is not None:
        app[METRICS].auth_refused.labels("too_many_failures").inc()
        raise Problem(
            429,
            "too many unknown tokens",
            f"this address sent {failures.limit} unknown tokens within "
            f"{failures.window:g} s; try again in {math.ceil(wait)} s",
            headers={"Retry-After": str(math.ceil(wait))},
            close=True,
        )
    try:
        return authorize(request, scope)
    except Problem as p:
        if p.status == 401 and p.title == "invalid token":
            app[METRICS].auth_refused.labels("unknown_token").inc()
            p.close = True
            if failures.failed(key):
                log.warning(
                    "gateway.auth_limited",
                    remote=key,
                    failures=failures.limit,
                    seconds=failures.window,
                )
        raise


@web.middleware
async def body_deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The whole body must arrive within ``body_timeout_seconds`` (408), so a client that
    sends a byte now and then cannot hold a handler (``jetloop.services.gateway.guard``). Read here,
    once: ``request.read()`` in a handler returns it again."""
    if request.body_exists:
        limit = request.app[CONFIG].body_timeout_seconds
        try:
            async with asyncio.timeout(limit):
                await request.read()  # 413 past client_max_size
        except TimeoutError:
            log.info("gateway.body_timeout", path=request.path, seconds=limit)
            raise Problem(
                408, "request body too slow", f"the body must arrive within {limit:g} s"
            ) from None
    return await handler(request)


@web.middleware
async def measure(request: web.Request, handler: Handler) -> web.StreamResponse:
    start = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        resource = request.match_info.route.resource
        # Templates, not paths: one series per route, whatever ids are asked for.
        route = resource.canonical if resource is not None else "unmatched"
        method = request.method if request.method in METHODS else "OTHER"
        elapsed = time.perf_counter() - start
        m = request.app[METRICS]
        m.requests.labels(route, method, str(status)).inc()
        m.latency.labels(route, method).observe(elapsed)
        log.debug("http.request", method=method, route=route, status=status, seconds=elapsed)


# --- helpers ---------------------------------------------------------------------------


def path_name(request: web.Request, key: str, pattern: re.Pattern[str] = NAME_RE) -> str:
    value = request.match_info[key]
    # fullmatch: `$` alone would let a trailing newline through (%0A in the path).
    if not pattern.fullmatch(value):
        raise Problem(
            422, f"invalid {key.replace('_', ' ')}", f"{value!r} does not match {pattern.pattern}"
        )
    return value


async def read_body(request: web.Request, model: type[M], optional: bool = False) -> M:
    raw = await request.read()  # raises 413 past client_max_size
    if optional and not raw.strip():
        raw = b"{}"
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise Problem(
            422, "invalid request body", f"{exc.error_count()} error(s)", errors=field_errors(exc)
        ) from None


def read_query(request: web.Request, model: type[M]) -> M:
    try:
        return model.model_validate(dict(request.query))
    except ValidationError as exc:
        raise Problem(
            422,
            "invalid query parameter",
            f"{exc.error_count()} error(s)",
            errors=field_errors(exc),
        ) from None


def ok(model: BaseModel | Mapping[str, Any], status: int = 200, **headers: str) -> web.Response:
    data = model.model_dump(mode="json") if isinstance(model, BaseModel) else dict(model)
    return web.json_response(data, status=status, headers=headers or None)


def by_whom(request: web.Request) -> str:
    """Who decides: the name of the token's grant (``anonymous`` without a token). Never the
    body's word: a request cannot record another person as the author."""
    return request[GRANT].name
