"""The short way answers come back (``streams.replies``, inline subscriptions, batched direct
gets), against a real server: the errors nats-py gives, timeouts, and nothing left waiting."""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import signal
import time

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import StreamConfig
from nats.js.errors import APIError, KeyNotFoundError, NoStreamResponseError

from jetloop.services.embedded import EmbeddedServer
from jetloop.streams.connection import (
    MSG_ID_IN_PROCESS,
    AnswerLost,
    SizedClient,
    connect,
    transient,
)
from jetloop.streams.direct import direct_batch, direct_get
from jetloop.streams.replies import (
    Answer,
    first_seq,
    js_publish,
    js_publish_all,
    replies_of,
    stored,
)
from tests.paused import paused, wait_stopped


async def _stream(nc: SizedClient) -> None:
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(name="R", subjects=["r.>"], allow_direct=True, max_msgs_per_subject=1)
    )


async def test_a_publish_is_answered_with_where_it_landed_and_dedupe_is_reported(
    server: EmbeddedServer,
) -> None:
    await server.wait_jetstream()
    nc = await connect([server.url], "test-replies")
    try:
        assert isinstance(nc, SizedClient)
        await _stream(nc)
        first = await js_publish(nc, "r.a", b"1", {"Nats-Msg-Id": "m1"}, 2.0)
        again = await js_publish(nc, "r.a", b"1", {"Nats-Msg-Id": "m1"}, 2.0)
        assert (first.stream, first.seq, first.duplicate) == ("R", 1, False)
        assert (again.seq, again.duplicate) == (1, True)
        # In order, all answered: sequences follow the order sent.
        many = await js_publish_all(nc, [(f"r.b{i}", b"x", None) for i in range(20)], 2.0)
        assert [p.seq for p in many] == list(range(2, 22))
        # The server's refusal is nats-py's APIError, with its code (a CAS from a stale
        # revision: what StateStore reads as a conflict).
        with pytest.raises(APIError) as refused:
            await js_publish(nc, "r.a", b"2", {"Nats-Expected-Last-Subject-Sequence": "9"}, 2.0)
        assert refused.value.err_code == 10071
        # Nobody stores the subject: nats-py's NoStreamResponseError (a transient error).
        with pytest.raises(NoStreamResponseError):
            await js_publish(nc, "nowhere.a", b"x", None, 2.0)
        # The first message on a filter, asked of the leader: its sequence, or None.
        assert await first_seq(nc, "R", "r.b1", 2.0) == 3
        assert await first_seq(nc, "R", "r.none", 2.0) is None
        # One key by a direct get: the message, or None.
        got = await direct_get(nc, "R", "r.b2", 2.0)
        assert got is not None and (got.seq, got.data) == (4, b"x")
        assert await direct_get(nc, "R", "r.none", 2.0) is None
        assert replies_of(nc)._waiting == {}
    finally:
        await nc.close()


def test_a_pub_ack_is_read_as_json_reads_it() -> None:
    """The PubAck shapes read without a JSON parse, and the ones left to ``json.loads``."""
    for data, want in (
        (b'{"stream":"R","seq":1}', ("R", 1, False)),
        (b'{"stream":"KV_jl_state","seq":12345,"duplicate":true}', ("KV_jl_state", 12345, True)),
        (b'{"stream":"R","domain":"hub","seq":3}', ("R", 3, False)),
        (b'{"stream":"R","seq":4,"val":"9"}', ("R", 4, False)),  # a counter's: json.loads
        (b'{"stream": "R", "seq": 5}', ("R", 5, False)),  # spaced: json.loads
    ):
        got = stored(Answer(data, None))
        assert (got.stream, got.seq, got.duplicate) == want, data
    with pytest.raises(APIError) as refused:
        stored(Answer(b'{"error":{"code":400,"err_code":10071,"description":"x"}}', None))
    assert refused.value.err_code == 10071
    with pytest.raises(NoStreamResponseError):
        stored(Answer(b"", {"Status": "503"}))


async def test_an_unanswered_request_times_out_and_leaves_nothing_waiting(
    server: EmbeddedServer,
) -> None:
    await server.wait_jetstream()
    nc = await connect([server.url], "test-replies")
    try:
        await _stream(nc)
        await js_publish(nc, "r.a", b"0", None, 2.0)
        assert server.proc is not None
        with paused(server.proc.pid):
            with pytest.raises(NatsTimeoutError):
                await js_publish_all(nc, [("r.a", b"1", None), ("r.b", b"2", None)], 0.3)
            with pytest.raises(TimeoutError):
                await direct_batch(nc, "R", {"multi_last": ["r.>"], "batch": 10}, 0.3)
        assert replies_of(nc)._waiting == {}
        # Answers that come after their request gave up are dropped; new requests work.
        await asyncio.sleep(0.2)
        found, left = await direct_batch(nc, "R", {"multi_last": ["r.>"], "batch": 10}, 2.0)
        assert {m.subject for m in found} >= {"r.a"} and left == 0
        assert (await js_publish(nc, "r.c", b"3", None, 2.0)).seq > 0
    finally:
        await nc.close()


async def test_inline_subscriptions_are_sent_again_after_a_reconnect(
    server: EmbeddedServer,
) -> None:
    await server.wait_jetstream()
    nc = await connect([server.url], "test-replies")
    try:
        await _stream(nc)
        await js_publish(nc, "r.a", b"0", None, 2.0)
        server.restart()
        await server.wait_jetstream()

        async def answered() -> int:
            return (await js_publish(nc, "r.a", b"1", None, 1.0)).seq

        for _ in range(100):
            try:
                assert await answered() > 0
                break
            except (NatsTimeoutError, NoStreamResponseError):
                await asyncio.sleep(0.1)
        else:
            pytest.fail("no answer after the server came back")
        found, _ = await direct_batch(nc, "R", {"multi_last": ["r.a"], "batch": 1}, 2.0)
        assert [m.data for m in found] == [b"1"]
    finally:
        await nc.close()


async def test_a_request_waiting_when_the_link_is_lost_fails_at_once(
    server: EmbeddedServer,
) -> None:
    """The server dies under requests waiting for answers: they fail at once with
    ``AnswerLost`` (a timeout, so they are asked again), not after their whole timeout."""
    await server.wait_jetstream()
    nc = await connect([server.url], "test-replies")
    try:
        await _stream(nc)
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        wait_stopped(server.proc.pid)
        write = asyncio.ensure_future(js_publish_all(nc, [("r.a", b"1", None)] * 3, 30.0))
        read = asyncio.ensure_future(direct_batch(nc, "R", {"multi_last": ["r.>"], "batch": 9}, 30))
        await asyncio.sleep(0.2)
        server.kill()
        started = time.monotonic()
        with pytest.raises(AnswerLost):
            await write
        with pytest.raises(AnswerLost):
            await read
        assert time.monotonic() - started < 5.0
        assert replies_of(nc)._waiting == {}
        assert isinstance(AnswerLost(), NatsTimeoutError)  # what retries treat as transient
    finally:
        await nc.close()


async def test_reads_and_writes_leave_no_reference_cycles(server: EmbeddedServer) -> None:
    """What a step's reads and writes allocate is freed by reference counting: a cycle left
    per read (a timer's closure that re-armed itself) made the collector run every few
    thousand reads, a twentieth of the worker's time (docs/performance.md)."""
    await server.wait_jetstream()
    nc = await connect([server.url], "test-replies-gc")
    try:
        assert isinstance(nc, SizedClient)
        await _stream(nc)
        await js_publish_all(nc, [(f"r.g{i}", b"x", None) for i in range(5)], 2.0)
        await direct_get(nc, "R", "r.g0")  # the inboxes are subscribed before counting
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for i in range(100):
                await js_publish(nc, f"r.g{i % 5}", b"y", None, 2.0)
                assert await direct_get(nc, "R", f"r.g{i % 5}") is not None
                assert await direct_get(nc, "R", "r.none") is None
                found, _ = await direct_batch(nc, "R", {"multi_last": ["r.g*"], "batch": 10})
                assert len(found) == 5
            gc.collect()
            left = collections.Counter(type(o).__name__ for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert not left, left  # 100 rounds of four reads and writes: not one cycle
    finally:
        await nc.close()


def test_transient_asks_what_an_error_says_without_requiring_an_error_code() -> None:
    """Some of nats-py's API errors carry no ``err_code`` (``KeyNotFoundError``): asked
    whether such an error is worth a retry, the answer is no, not an AttributeError that
    ends the step (seen on a node cut off from its peers, tests/test_cluster_faults.py)."""
    assert not transient(KeyNotFoundError())
    assert transient(APIError(code=409, err_code=MSG_ID_IN_PROCESS, description="in process"))
    assert not transient(APIError(code=400, err_code=10071, description="wrong last sequence"))
    assert transient(NatsTimeoutError())
