"""A service's last drain is bounded: a subscription whose callback never returns cannot
hold a stop for nats-py's 30 s drain timeout (a stuck stop is killed by whoever runs the
service, losing what an orderly stop keeps); it is named in the log, and the connection
closed."""

from __future__ import annotations

import asyncio
import time

from nats.aio.msg import Msg
from structlog.testing import capture_logs

from jetloop.services.embedded import EmbeddedServer
from jetloop.streams.connection import connect, finish


async def test_a_drain_held_by_a_stuck_callback_is_given_up_and_named(
    server: EmbeddedServer,
) -> None:
    await server.wait_jetstream()
    nc = await connect([server.url], "test-finish")
    stuck = asyncio.Event()

    async def never_returns(msg: Msg) -> None:
        stuck.set()
        await asyncio.Event().wait()

    await nc.subscribe("finish.stuck", cb=never_returns)
    await nc.publish("finish.stuck", b"1")
    await nc.publish("finish.stuck", b"2")  # queued behind the stuck one
    await asyncio.wait_for(stuck.wait(), 5)
    started = time.monotonic()
    with capture_logs() as logs:
        await finish(nc, timeout=0.5)
    took = time.monotonic() - started
    assert nc.is_closed
    assert took < 5, took
    [slow] = [e for e in logs if e["event"] == "nats.drain_slow"]
    assert slow["subscriptions"] == ["finish.stuck (1 queued)"], slow


async def test_a_drain_with_nothing_held_is_quiet(server: EmbeddedServer) -> None:
    await server.wait_jetstream()
    nc = await connect([server.url], "test-finish")
    got: list[bytes] = []

    async def keep(msg: Msg) -> None:
        got.append(msg.data)

    await nc.subscribe("finish.ok", cb=keep)
    await nc.publish("finish.ok", b"1")
    await nc.flush()
    with capture_logs() as logs:
        await finish(nc, timeout=5)
    assert nc.is_closed
    assert not [e for e in logs if e["event"] == "nats.drain_slow"]
