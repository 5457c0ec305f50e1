"""The turn pipeline end to end, on a real nats-server with worker subprocesses."""

from __future__ import annotations

import asyncio
import json

from jetloop.demo.vendor import Vendor
from jetloop.schemas import EventType, TurnStatus
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.streams import topology
from tests.conftest import WorkerFactory, call, script


async def collect(
    client: Client, session: str, until_completed: int
) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    done = 0
    async for ev in client.events(session):
        out.append((ev.type.value, ev.turn_id))
        if ev.type in (EventType.TURN_COMPLETED, EventType.TURN_FAILED):
            done += 1
            if done == until_completed:
                return out
    return out


async def test_parallel_calls_complete(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A turn whose model asks for three calls at once runs them all and answers once."""
    workers.start()
    text = script([call("write", name="a"), call("write", name="b"), call("read", name="c")])
    h = await client.send("tester", "s1", text)
    res = await client.wait(h, timeout=30)
    seen = json.loads(res.text.split("\n", 1)[1])["seen"] if res.text else []
    assert [s["status"] for s in seen] == ["ok", "ok", "ok"]
    assert {s["result"]["name"] for s in seen if s["tool"] == "write"} == {"a", "b"}
    assert await vendor.effect_count("write") == 2
    counts = await vendor.payload_counts("model_call")
    assert sorted(counts.values()) == [1, 1]  # step 0 and step 1, each asked once


async def test_duplicate_request_is_dropped(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """The same request id twice starts one turn; the second publish is a duplicate."""
    workers.start()
    text = script([call("write", name="dup")])
    h1 = await client.send("tester", "s2", text, request_id="req-1")
    h2 = await client.send("tester", "s2", text, request_id="req-1")
    assert h1.turn_id == h2.turn_id
    assert h2.duplicate
    await client.wait(h1, timeout=30)
    assert await vendor.effect_count("write") == 1
    assert sorted((await vendor.payload_counts("model_call")).values()) == [1, 1]
    events = await collect(client, "s2", 1)
    assert events.count(("turn.completed", h1.turn_id)) == 1


async def test_duplicate_is_told_from_state_after_the_stream_forgot_the_id(
    client: Client, workers: WorkerFactory, vendor: Vendor, nats_ready: EmbeddedServer
) -> None:
    """A repeat while the first request is still queued is a duplicate by its PubAck; a
    repeat after the turn completed and the server restarted (the work queue has forgotten
    the id) is a duplicate by the turn record, with its status, and is not published: the
    turn ran once and the turn stream holds nothing new."""
    text = script([call("write", name="dup")])
    h1 = await client.send("tester", "fd", text, request_id="req-f")
    h2 = await client.send("tester", "fd", text, request_id="req-f")
    assert (h1.duplicate, h1.status) == (False, None)
    assert (h2.duplicate, h2.status, h2.turn_id) == (True, None, h1.turn_id)
    workers.start()
    await client.wait(h1, timeout=30)
    await asyncio.to_thread(nats_ready.stop)  # graceful: the deletion of the request is kept
    await asyncio.to_thread(nats_ready.start)
    await nats_ready.wait_jetstream()
    turns = (await client.js.stream_info(topology.TURNS_STREAM)).state.last_seq

    h3 = await client.send("tester", "fd", text, request_id="req-f")
    assert (h3.duplicate, h3.status, h3.turn_id) == (True, TurnStatus.COMPLETED, h1.turn_id)
    assert (await client.js.stream_info(topology.TURNS_STREAM)).state.last_seq == turns
    assert (await client.wait(h3, timeout=30)).status == TurnStatus.COMPLETED
    assert await vendor.effect_count("write") == 1
    assert sorted((await vendor.payload_counts("model_call")).values()) == [1, 1]
    snap = await client.snapshot("fd")
    assert snap is not None and snap.turns_done == 1


async def test_two_messages_run_in_order(client: Client, workers: WorkerFactory) -> None:
    """A second message while a turn runs is queued and starts after the first ends."""
    workers.start()
    h1 = await client.send("tester", "s3", script([call("slow", name="one", seconds=0.5)]))
    h2 = await client.send("tester", "s3", script([call("write", name="two")]))
    await client.wait(h2, timeout=30)
    events = await collect(client, "s3", 2)
    order = [e for e in events if e[0] in ("turn.started", "turn.completed")]
    assert order == [
        ("turn.started", h1.turn_id),
        ("turn.completed", h1.turn_id),
        ("turn.started", h2.turn_id),
        ("turn.completed", h2.turn_id),
    ]
