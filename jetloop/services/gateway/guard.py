"""Slow and many clients: a deadline for a connection's request headers, a cap on connections.

aiohttp bounds a request's size but not how long a client may take to send it, nor how many
connections may be open. The gateway bounds the three ways a client can hold it:

- **headers**: a connection has ``header_timeout`` seconds, from the moment it is accepted, to
  finish its first request's headers, or it is closed. For the requests after the first one on
  a kept-alive connection, aiohttp's own ``keepalive_timeout`` (set to the same value) closes a
  connection that has not sent a whole request that long after the previous response.
- **body**: ``jetloop.services.gateway.http.body_deadline`` reads a request's body under a deadline
  (408); an unread body is drained for at most as long (``lingering_time``), then the
  connection is closed.
- **connections**: at most ``max_connections`` are open at once; one more is answered ``503``
  with ``Retry-After`` and closed at once, before a byte of it is read. Event streams count:
  each is a connection.

The mechanism is a protocol wrapped around each of aiohttp's ``RequestHandler``: it counts
open connections and arms the header deadline when a connection is made; aiohttp's request
factory, which it calls once a request's headers are parsed, disarms it. The wrapper passes
every other protocol call through unchanged.
"""

from __future__ import annotations

import asyncio
from typing import cast

import structlog
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

log = structlog.get_logger("jetloop.gateway")


def _busy() -> bytes:
    body = (
        b'{"type":"about:blank","title":"Service Unavailable","status":503,'
        b'"detail":"too many connections"}'
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/problem+json\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """The protocol factory of one listening socket (``loop.create_server(guard, …)``)."""

    def __init__(self, server: web.Server, header_timeout: float, max_connections: int) -> None:
        self.server = server
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.open: dict[RequestHandler, GuardedConnection] = {}
        self.refused = 0
        self.timed_out = 0
        self.busy = _busy()
        parse_done = server.request_factory

        def request_factory(
            message: RawRequestMessage,
            payload: StreamReader,
            protocol: RequestHandler,
            writer: AbstractStreamWriter,
            task: asyncio.Task[None],
        ) -> BaseRequest:
            conn = self.open.get(protocol)
            if conn is not None:
                conn.headers_done()
            return parse_done(message, payload, protocol, writer, task)

        # Read by each RequestHandler when it is made: replaced before the first connection.
        server.request_factory = request_factory

    def __call__(self) -> GuardedConnection:
        return GuardedConnection(self)


class GuardedConnection(asyncio.Protocol):
    """One connection: refused when the gateway is full, closed when its headers are late."""

    def __init__(self, owner: ConnectionGuard) -> None:
        self.owner = owner
        self.inner: RequestHandler | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transport, though not always of asyncio's class (uvloop's is not).
        transport = cast(asyncio.Transport, transport)
        owner = self.owner
        if len(owner.open) >= owner.max_connections:
            owner.refused += 1
            if owner.refused == 1 or owner.refused % 100 == 0:
                log.warning(
                    "gateway.connections_full", limit=owner.max_connections, refused=owner.refused
                )
            transport.write(owner.busy)
            transport.close()
            return
        self.transport = transport
        self.inner = owner.server()
        owner.open[self.inner] = self
        self.inner.connection_made(transport)
        self.deadline = asyncio.get_running_loop().call_later(owner.header_timeout, self._late)

    def headers_done(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _late(self) -> None:
        self.deadline = None
        self.owner.timed_out += 1
        log.info("gateway.header_timeout", seconds=self.owner.header_timeout)
        if self.transport is not None:
            self.transport.abort()  # nothing of ours is buffered: no need to flush

    def connection_lost(self, exc: Exception | None) -> None:
        self.headers_done()
        if self.inner is not None:
            self.owner.open.pop(self.inner, None)
            self.inner.connection_lost(exc)
            self.inner = None
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.inner is not None:
            self.inner.eof_received()  # aiohttp's: keeps the transport open (returns nothing)
        return None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
