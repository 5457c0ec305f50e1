"""A service's last drain is bounded: a subscription whose callback never returns cannot
hold a stop for nats-py's 30 s drain timeout (a stuck stop is killed by whoever runs the
service, losing what an orderly stop keeps); it is named in the log, and the connection
closed."""

from __future__ import annotations

import asyncio
import gc
import time
import warnings

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


async def test_failed_handshakes_while_reconnecting_leave_no_socket_open(
    server: EmbeddedServer,
) -> None:
    """A client whose server is gone tries the others; one that accepts and hangs up at once
    (a node dying, a port taken over) fails each handshake. nats-py opens every attempt's
    socket in one transport and dropped the failed one unclosed; nothing is left to the
    garbage collector now (a cluster power-cut trial failed on that ResourceWarning)."""
    await server.wait_jetstream()

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    rude = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    rude_port = rude.sockets[0].getsockname()[1]
    nc = await connect([server.url, f"nats://127.0.0.1:{rude_port}"], "test-handshakes")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            server.kill()
            await asyncio.sleep(3.0)  # attempts every 0.5 s, each refused or hung up on
            gc.collect()
        unclosed = [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert unclosed == [], [str(w.message) for w in unclosed]
    finally:
        await nc.close()
        rude.close()
        await rude.wait_closed()
