"""A consumer's messages reach the worker as they arrive (``jetloop.streams.intake``).

Against a real nats-server: the messages of an idle consumer arrive within milliseconds at
whatever moment they are published (nats-py's batched ``fetch`` held some of them up to its
timeout), the worker never has more out than its room, and an expired request is asked again
at once, so no window opens in which nothing is asked.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js import api

from jetloop.services.embedded import EmbeddedServer
from jetloop.streams.connection import connect
from jetloop.streams.intake import Intake

STREAM, CONSUMER = "INTAKE_T", "taker"


@pytest.fixture
async def nc(server: EmbeddedServer) -> AsyncIterator[Client]:
    await server.wait_jetstream()
    nc = await connect([server.url], "test-intake")
    js = nc.jetstream()
    await js.add_stream(name=STREAM, subjects=["intake.>"])
    await js.add_consumer(
        STREAM, api.ConsumerConfig(durable_name=CONSUMER, ack_policy=api.AckPolicy.EXPLICIT)
    )
    yield nc
    await nc.close()


async def test_a_message_on_an_idle_consumer_arrives_at_once_whenever_it_is_published(
    nc: Client,
) -> None:
    """Messages published at random moments across many 0.2 s take windows, to a taker that
    asks for up to 10, each arrive within 50 ms (nats-py's ``fetch(10, timeout=0.2)`` in the
    same loop held some until its window ran out)."""
    intake = Intake(nc, STREAM, CONSUMER)
    await intake.start()
    arrived: dict[bytes, float] = {}
    came = asyncio.Event()

    async def taker() -> None:
        while True:
            for m in await intake.take(10, timeout=0.2):
                arrived[m.data] = time.perf_counter()
                came.set()
                await m.ack()

    task = asyncio.create_task(taker())
    js = nc.jetstream()
    waits = []
    rng = random.Random(7)
    try:
        for i in range(40):
            await asyncio.sleep(rng.uniform(0, 0.4))
            body = str(i).encode()
            sent = time.perf_counter()
            await js.publish("intake.x", body)
            while body not in arrived:
                came.clear()
                await asyncio.wait_for(came.wait(), 5.0)
            waits.append(arrived[body] - sent)
    finally:
        task.cancel()
        await intake.stop()
    assert max(waits) < 0.05, sorted(waits)[-5:]


async def test_no_more_messages_are_out_to_the_taker_than_its_room(nc: Client) -> None:
    """Ten messages wait; a taker with room for 3 is given 3 (the consumer has only 3 out
    unacked), and the next take gives the next ones."""
    js = nc.jetstream()
    for i in range(10):
        await js.publish("intake.x", str(i).encode())
    intake = Intake(nc, STREAM, CONSUMER)
    await intake.start()
    try:
        first = await intake.take(3, timeout=2.0)
        while len(first) < 3:
            first += await intake.take(3 - len(first), timeout=2.0)
        assert [m.data for m in first] == [b"0", b"1", b"2"]
        await asyncio.sleep(0.2)  # nothing more may arrive: nothing more was asked
        info = await js.consumer_info(STREAM, CONSUMER)
        assert info.num_ack_pending == 3
        assert intake.asked == 0
        for m in first:
            await m.ack()
        rest = await intake.take(7, timeout=2.0)
        while len(rest) < 7:
            rest += await intake.take(7 - len(rest), timeout=2.0)
        assert [m.data for m in rest] == [str(i).encode() for i in range(3, 10)]
    finally:
        await intake.stop()


async def test_an_expired_request_is_asked_again_at_once(nc: Client) -> None:
    """Requests that expire every 0.3 s: a message published just after an expiry arrives at
    once, because the expiry itself wakes the taker to ask again (it does not wait out the
    taker's 5 s turn)."""
    intake = Intake(nc, STREAM, CONSUMER, expires=0.3, heartbeat=0.1)
    await intake.start()
    try:
        taking = asyncio.create_task(intake.take(5, timeout=5.0))
        await asyncio.sleep(0.7)  # at least two requests expired and were asked again
        assert not taking.done()
        sent = time.perf_counter()
        await nc.jetstream().publish("intake.x", b"late")
        msgs = await asyncio.wait_for(taking, 2.0)
        assert [m.data for m in msgs] == [b"late"]
        assert time.perf_counter() - sent < 0.1
    finally:
        await intake.stop()


async def test_messages_not_taken_are_handed_back_at_stop(nc: Client) -> None:
    """What arrived but was not taken comes back from ``stop`` for the caller to nak."""
    intake = Intake(nc, STREAM, CONSUMER)
    await intake.start()
    await intake.take(2, timeout=0.05)  # asks for 2, none there yet
    js = nc.jetstream()
    await js.publish("intake.x", b"a")
    await js.publish("intake.x", b"b")
    await asyncio.sleep(0.2)
    left = await intake.stop()
    assert [m.data for m in left] == [b"a", b"b"]
