"""The heartbeat's write of the claim never undoes a commit it waited behind.

A heartbeat writes the claimed record again (jetloop/consumers/runtime.py). When a commit is slow —
the server stalls, as through a restart — the heartbeat waits for the delivery's lock behind
it; what it then writes must be the record as the commit left it, not the one it saw before
waiting. (In a kill trial, a value read before the wait put a call back "in doubt" after its
outcome was committed, and the turn never ended.) The server is paused with SIGSTOP here, and
found stopped before anything is sent (``tests.paused``), so the commit is in flight for as
long as the test wants; everything is real.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import structlog
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import BaseModel

from jetloop.consumers.dispatch import dispatch
from jetloop.consumers.runtime import Delivery, Runtime
from jetloop.services.embedded import EmbeddedServer
from jetloop.streams import topology
from jetloop.streams.blobs import BlobStore
from jetloop.streams.bus import Bus
from jetloop.streams.connection import connect
from jetloop.streams.history import HistoryReader
from jetloop.streams.state import StateStore
from tests.apps import app as test_app
from tests.paused import paused


class Note(BaseModel):
    text: str


@pytest.fixture
async def delivery(nats_ready: EmbeddedServer) -> AsyncIterator[Delivery]:
    nc = await connect([nats_ready.url], "test-heartbeat")
    js = nc.jetstream()
    await js.add_stream(name="T_BEAT", subjects=["t.beat"])
    await js.publish("t.beat", b"step")
    sub = await js.pull_subscribe("t.beat", durable="beat", stream="T_BEAT")
    [msg] = await sub.fetch(1, timeout=5)
    rt = Runtime(
        nc=nc,
        js=js,
        state=await StateStore.open(nc),
        blobs=BlobStore(await js.object_store(topology.BLOB_BUCKET), 64 * 1024),
        history=await HistoryReader.for_stream(nc),
        bus=Bus(js),
        app=test_app,
        worker_id="beat",
        lease_seconds=30.0,
    )
    yield Delivery(rt, msg)
    await nc.close()


async def test_a_heartbeat_behind_a_slow_commit_writes_the_commit(
    delivery: Delivery, nats_ready: EmbeddedServer
) -> None:
    key = "test.beat.claim"
    await delivery.claim(key, Note(text="claimed"), None)
    assert nats_ready.proc is not None
    with paused(nats_ready.proc.pid):
        commit = asyncio.create_task(delivery.commit(Note(text="committed")))
        await asyncio.sleep(0.2)  # the commit holds the lock, its request unanswered
        assert not commit.done(), "the paused server answered the commit"
        assert delivery.fence_value == Note(text="claimed")
        beat = asyncio.create_task(delivery.heartbeat())
        await asyncio.sleep(0.2)  # the heartbeat waits for the lock
        assert not commit.done() and not beat.done()
    rev = await asyncio.wait_for(commit, 20)
    await asyncio.wait_for(beat, 20)
    assert not delivery.lost
    current = await delivery.rt.state.kv.get(key)
    assert current.revision > rev, "the heartbeat wrote after the commit"
    assert Note.model_validate(_decoded(current.value)) == Note(text="committed")


async def test_a_read_the_server_does_not_answer_gives_up_at_the_read_timeout(
    delivery: Delivery, nats_ready: EmbeddedServer
) -> None:
    """A read sent while the servers elect a leader may get no answer at all; the step waits
    only ``read_timeout`` (a worker sets a quarter of its lease), not nats-py's 5 s, and is
    tried again once the leader is there (a takeover trial saw steps stand still 5 s past
    the election)."""
    state = delivery.rt.state
    key = "test.beat.read"
    await state.write(key, Note(text="x"), None)
    state.read_timeout = 0.3
    assert nats_ready.proc is not None
    with paused(nats_ready.proc.pid):
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await state.revision(key)
        with pytest.raises(TimeoutError):
            await state.step_view("s", "t", "c")
        waited = asyncio.get_running_loop().time() - started
    assert waited < 2.0, f"two reads waited {waited:.1f}s"
    assert await state.revision(key) is not None


async def test_a_claim_is_held_while_its_write_is_unanswered(
    delivery: Delivery, nats_ready: EmbeddedServer
) -> None:
    """A restarting server may deliver a message again (as delivery 1) while this process's
    claim write for it waits for an answer; that delivery must find the key held by this
    process (and wait), not a claim of ours that "ended" (a kill trial saw a worker take over
    its own live attempt and charge a loss)."""
    key = "test.beat.pending-claim"
    assert nats_ready.proc is not None
    with paused(nats_ready.proc.pid):
        claim = asyncio.create_task(delivery.claim(key, Note(text="claimed"), None))
        await asyncio.sleep(0.2)
        assert not claim.done(), "the paused server answered the claim"
        assert key in delivery.rt.holding, "held while the claim's write is unanswered"
    await asyncio.wait_for(claim, 20)
    assert key in delivery.rt.holding
    delivery.release()
    assert key not in delivery.rt.holding


def _decoded(data: bytes | None) -> dict[str, object]:
    import msgpack

    assert data is not None
    out = msgpack.unpackb(data, raw=False)
    assert isinstance(out, dict)
    out.pop("seal", None)
    return out


async def test_a_transient_failure_is_logged_as_a_warning_and_a_bug_as_an_error(
    delivery: Delivery,
) -> None:
    """A step that fails on an outage (a NATS timeout, as through a server restart) is tried
    again and logged as a warning without a traceback; any other exception is an error with
    its traceback. Both keep the event name ``step.error``."""

    async def outage(d: Delivery) -> None:
        raise NatsTimeoutError

    async def bug(d: Delivery) -> None:
        raise ValueError("a bug")

    rt, msg = delivery.rt, delivery.msg
    with structlog.testing.capture_logs() as logs:
        await dispatch(rt, msg, outage)
        await dispatch(rt, msg, bug)
    errors = [e for e in logs if e["event"] == "step.error"]
    assert [e["log_level"] for e in errors] == ["warning", "error"], errors
    assert errors[0].get("transient") is True and "exc_info" not in errors[0]
    assert errors[1].get("exc_info") is True and errors[1]["retry_in"] > 0
