"""Connecting to NATS the way NATS-NOTES says a durable worker must."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import nats
import structlog
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

log = structlog.get_logger("jetloop.nats")


async def connect(urls: Sequence[str], name: str) -> Client:
    """Every server URL, unlimited reconnects, short waits, pings well under 120 s."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats.error", error=str(exc))

    closing: list[Client] = []

    async def on_disconnect() -> None:
        if closing and (closing[0].is_closed or closing[0].is_draining):
            return  # our own close, not an outage
        log.warning("nats.disconnected")

    async def on_reconnect() -> None:
        log.info("nats.reconnected")

    nc = await nats.connect(
        servers=list(urls),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        ping_interval=5,
        max_outstanding_pings=3,
        connect_timeout=5,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
    closing.append(nc)
    return nc


T = TypeVar("T")

# What a server restart or a leader election looks like from a client: nobody answers yet.
TRANSIENT: tuple[type[BaseException], ...] = (
    NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
    NatsTimeoutError,
    TimeoutError,
)


async def retrying(op: Callable[[], Awaitable[T]], seconds: float, what: str = "request") -> T:
    """Run an idempotent operation again while the servers are between leaders."""
    deadline = time.monotonic() + seconds
    delay = 0.1
    while True:
        try:
            return await op()
        except TRANSIENT as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.info("nats.retry", what=what, error=type(exc).__name__, retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
