"""A stalled worker: paused past its lease while it holds a step, then resumed.

The kills of every step kind are in ``tests/test_matrix.py``; this is the stall of
docs/crash-matrix.md's stalled worker: the resumed worker must write, publish and ack nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog

from jetloop.demo.vendor import Vendor
from jetloop.schemas import CallState, SessionRecord, call_key
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.streams import topology
from jetloop.streams.connection import connect
from jetloop.streams.state import StateStore, call_state_key, session_key, step_reads_key
from jetloop.tooling.trials.harness import WorkerProcess
from tests.conftest import LEASE, WorkerFactory, body, call, script, until
from tests.fakes import FakeOpenAIChat, Reply, Stall
from tests.paused import paused
from tests.test_models_engine import model_env


async def test_stalled_worker_writes_and_acks_nothing(
    client: Client, workers: WorkerFactory, vendor: Vendor, tap: AckTap, tmp_path: object
) -> None:
    """A worker paused past its lease and resumed after a takeover writes and acks nothing:
    its tool is not called again, the record is the taker's, no ack, nak or term of its
    delivery reaches the server and the streams hold nothing new."""
    release = Path(str(tmp_path)) / "release"
    stalled = workers.start("stalled", hold="call_tool.in_tool", release_file=release)
    h = await client.send("tester", "st1", script([call("write", name="x")]))
    held = await stalled.wait_for("fault.hold", point="call_tool.in_tool")
    step, seq, delivery = held["step"], held["seq"], held["delivery"]
    stalled.pause()
    workers.start("taker")
    await client.wait(h, timeout=30)
    before = await client.call("st1", h.turn_id, 0, 0)
    assert before is not None and before.state == CallState.SUCCEEDED
    streams = await last_seqs(client, "st1")

    stalled.resume()
    release.touch()
    await stalled.wait_for("step.taken_over", step=step)

    after_hold = stalled.lines()
    after_hold = after_hold[after_hold.index(held) :]
    assert not [ln for ln in after_hold if ln["event"] == "step.acked" and ln.get("step") == step]
    assert not [ln for ln in after_hold if ln["event"] in ("call.recorded", "tool.failed")]
    after = await client.call("st1", h.turn_id, 0, 0)
    assert after == before, "the stalled worker must not write the call record"
    assert await vendor.request_counts("write") == {before_key(before): 1}
    await handled(stalled, held)
    await tap.nc.flush()
    assert tap.settled(seq, delivery) == [], "the stale delivery must not be settled"
    assert await last_seqs(client, "st1") == streams, "nothing new in the streams"


def before_key(rec: object) -> str:
    from jetloop.schemas import idempotency_key

    parts = rec.key.split(".")  # type: ignore[attr-defined]
    return idempotency_key(parts[0], parts[1], int(parts[2]), int(parts[3]))


@dataclass(frozen=True)
class Sent:
    """One message a worker sent on a JetStream delivery: an ack, nak, term or progress."""

    stream: str
    delivered: int  # which delivery of the message it answers
    seq: int  # the message's stream sequence
    kind: bytes  # b"+ACK", b"-NAK", b"+TERM", b"+WPI", ...


class AckTap:
    """Every ack, nak, term and in-progress ack any client sends, as the server receives
    them: a core subscription on ``$JS.ACK.>`` (read from the server, not from logs)."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []
        self.nc: Any = None

    async def start(self, url: str) -> AckTap:
        self.nc = await connect([url], "test-ack-tap")
        await self.nc.subscribe("$JS.ACK.>", cb=self._on)
        await self.nc.flush()
        return self

    async def _on(self, msg: Any) -> None:
        t = msg.subject.split(".")
        if len(t) > 9:  # the v2 form: $JS.ACK.<domain>.<account hash>.<stream>...
            t = t[:2] + t[4:]
        # An empty body is an ack too (nats-py's ack_sync sends one).
        kind = msg.data.split(b" ")[0] or b"+ACK"
        self.sent.append(Sent(t[2], int(t[4]), int(t[5]), kind))

    def settled(self, seq: int, delivered: int) -> list[bytes]:
        """What settled (or tried to settle) one delivery of a step: anything but an
        in-progress ack."""
        return [
            s.kind
            for s in self.sent
            if s.stream == topology.STEPS_STREAM
            and (s.seq, s.delivered) == (seq, delivered)
            and s.kind != b"+WPI"
        ]

    async def close(self) -> None:
        await self.nc.flush()
        await self.nc.close()


@pytest.fixture
async def tap(nats_ready: EmbeddedServer) -> AsyncIterator[AckTap]:
    t = await AckTap().start(nats_ready.url)
    yield t
    await t.close()


async def last_seqs(client: Client, session: str) -> dict[str, int]:
    """The last sequence of every stream the engine writes (a publish deduplicated by its
    message id adds nothing), once the session is idle again."""

    async def idle() -> bool:
        snap = await client.snapshot(session)
        return snap is not None and snap.status == "idle" and snap.turns_done >= 1

    await until(idle)
    skip = (f"KV_{topology.WORKERS_BUCKET}", f"KV_{topology.AGENTS_BUCKET}")
    return {
        s.config.name: s.state.last_seq
        for s in await client.js.streams_info()
        if s.config.name not in skip
    }


async def handled(w: WorkerProcess, held: dict[str, Any]) -> None:
    """Wait until a worker has finished handling one delivery (its dispatch logged the end)."""
    ends = (
        "step.taken_over",
        "step.acked",
        "step.error",
        "step.error_after_takeover",
        "step.retry_later",
        "step.dead_letter",
    )

    async def done() -> bool:
        return any(
            ln.get("event") in ends
            and all(ln.get(k) == held[k] for k in ("step", "seq", "delivery"))
            for ln in w.lines()
        )

    await until(done)


async def test_stalled_worker_after_its_commit_acks_nothing(
    client: Client, workers: WorkerFactory, tap: AckTap, tmp_path: Path
) -> None:
    """A worker paused past its lease just after committing a model answer, found lost when
    it resumes (the turn moved on meanwhile), sends nothing on its delivery: no ack, nak or
    term reaches the server, and its re-emission adds nothing to the streams."""
    release = tmp_path / "release"
    stalled = workers.start("stalled", hold="run_model.after_commit", release_file=release)
    h = await client.send("tester", "sa", script([call("write", name="x")]))
    held = await stalled.wait_for("fault.hold", point="run_model.after_commit")
    seq, delivery = held["seq"], held["delivery"]
    stalled.pause()
    workers.start("taker")
    await client.wait(h, timeout=30)
    turn = await client.turn("sa", h.turn_id)
    before = await last_seqs(client, "sa")

    stalled.resume()
    # The heartbeat reads the fence back and finds the turn moved on; then let it go on.
    await stalled.wait_for("step.lease_lost", seq=seq)
    release.touch()
    await handled(stalled, held)
    await tap.nc.flush()
    assert tap.settled(seq, delivery) == [], "the lost delivery must not be settled"
    assert await last_seqs(client, "sa") == before, "nothing new in the streams"
    assert await client.turn("sa", h.turn_id) == turn


async def test_stalled_worker_before_its_commit_is_fenced(
    client: Client, workers: WorkerFactory, vendor: Vendor, tap: AckTap, tmp_path: Path
) -> None:
    """A worker paused past its lease after its write reached the vendor and before it
    committed: the taker makes the write again with the same key and commits; the resumed
    worker's commit is refused by the fence, so the record is the taker's, the vendor saw
    the key twice and applied it once, and the stale delivery is not settled."""
    release = tmp_path / "release"
    stalled = workers.start("stalled", hold="call_tool.before_commit", release_file=release)
    h = await client.send("tester", "sc", script([call("write", name="x")]))
    held = await stalled.wait_for("fault.hold", point="call_tool.before_commit")
    seq, delivery = held["seq"], held["delivery"]
    stalled.pause()
    workers.start("taker")
    await client.wait(h, timeout=30)
    rec = await client.call("sc", h.turn_id, 0, 0)
    assert rec is not None and rec.state == CallState.SUCCEEDED and rec.attempts == 2
    before = await last_seqs(client, "sc")

    release.touch()
    stalled.resume()
    await handled(stalled, held)
    await tap.nc.flush()
    assert await client.call("sc", h.turn_id, 0, 0) == rec, "the stale commit must not land"
    assert await vendor.request_counts("write") == {before_key(rec): 2}
    assert await vendor.effect_count("write") == 1
    assert tap.settled(seq, delivery) == [], "the stale delivery must not be settled"
    assert await last_seqs(client, "sc") == before, "nothing new in the streams"


async def test_write_whose_reply_was_lost_is_read_back(nats_ready: EmbeddedServer) -> None:
    """A state write sent while the server is stopped (SIGSTOP) times out; the server applies
    it when it goes on, and the retried CAS then finds the revision moved: the write reads
    the key back, finds exactly what it wrote, and returns that revision instead of taking
    the retry's conflict for a takeover."""
    nc = await connect([nats_ready.url], "test-lost-reply")
    try:
        js = nc.jetstream(timeout=0.5)
        kv = await js.key_value(topology.STATE_BUCKET)
        store = StateStore(js, kv, retry_for=30.0)
        # Its writes and read-backs wait as a worker's with the tests' 2 s lease do (a quarter
        # of it): each try while the server is stopped costs 1 s, not 5.5 s (5 s defaults).
        store.write_timeout = store.read_timeout = LEASE / 4
        key = session_key("lr")
        first = await store.write(key, SessionRecord(session_id="lr", agent="tester"), None)
        moved = SessionRecord(session_id="lr", agent="tester", turns_done=1)
        assert nats_ready.proc is not None
        with paused(nats_ready.proc.pid), structlog.testing.capture_logs() as logs:
            write = asyncio.create_task(store.write(key, moved, first))

            async def timed_out_twice() -> bool:
                return sum(1 for e in logs if e["event"] == "nats.retry") >= 2

            await until(timed_out_twice, timeout=20)
        rev = await asyncio.wait_for(write, 30)
        entry = await kv.get(key)
        assert rev == entry.revision and rev > first
        assert entry.value == store._encode(key, moved, first)
    finally:
        await nc.close()


async def test_a_read_commits_its_outcome_as_its_first_write(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A read on its first delivery writes no ``running`` claim: its one write is its
    outcome, kept with its step's other reads (``reads.<session>.<turn>.<step>``, one
    version), and the call has no record of its own."""
    w = workers.start()
    await w.wait_for("worker.step_reads", now=True, timeout=30)
    h = await client.send("tester", "ur1", script([call("read", name="r")]))
    await client.wait(h, timeout=30)
    # Counted by the bucket's stream (a KV watch's history can miss an entry delivered
    # before its consumer info comes back: nats-py's race, seen on a busy machine).
    prefix = f"$KV.{topology.STATE_BUCKET}."
    own = prefix + call_state_key(call_key("ur1", h.turn_id, 0, 0))
    kept = prefix + step_reads_key("ur1", h.turn_id, 0)
    for subject, versions in ((own, {}), (kept, {kept: 1})):
        stream = f"KV_{topology.STATE_BUCKET}"
        info = await client.js.stream_info(stream, subjects_filter=subject)
        assert (info.state.subjects or {}) == versions
    rec = await client.call("ur1", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 1
    assert await count_of(vendor, "read") == 1


async def test_stalled_unclaimed_read_commits_nothing_after_a_takeover(
    client: Client, workers: WorkerFactory, tap: AckTap, vendor: Vendor, tmp_path: Path
) -> None:
    """A worker paused past its lease while it makes a read (first delivery: no claim),
    resumed once another worker made the read again and finished the turn: its outcome,
    a create, finds the taker's record, so it writes, publishes and acks nothing. The
    redelivery counted the unclaimed delivery as an attempt."""
    release = tmp_path / "release"
    stalled = workers.start("stalled", hold="call_tool.before_commit", release_file=release)
    h = await client.send("tester", "ur2", script([call("read", name="r")]))
    held = await stalled.wait_for("fault.hold", point="call_tool.before_commit")
    seq, delivery = held["seq"], held["delivery"]
    assert delivery == 1
    stalled.pause()
    workers.start("taker")
    await client.wait(h, timeout=30)
    rec = await client.call("ur2", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 2
    before = await last_seqs(client, "ur2")

    stalled.resume()
    release.touch()
    await handled(stalled, held)
    await tap.nc.flush()
    assert stalled.find("step.taken_over", seq=seq, delivery=delivery)
    assert tap.settled(seq, delivery) == [], "the stale delivery must not be settled"
    assert await last_seqs(client, "ur2") == before, "nothing new in the streams"
    assert await client.call("ur2", h.turn_id, 0, 0) == rec
    assert await count_of(vendor, "read") == 2, "each delivery made the read once"


async def count_of(vendor: Vendor, op: str) -> int:
    return sum((await vendor.request_counts(op)).values())


async def test_stalled_worker_makes_no_model_call_after_a_takeover(
    client: Client, workers: WorkerFactory, tap: AckTap, tmp_path: Path
) -> None:
    """A worker paused past its lease after claiming a model step and before calling the
    model, resumed once another worker took the step over and finished the turn, calls no
    model (the fence is checked right before the call): the provider sees the taker's request
    only, and the stale attempt writes, publishes and acks nothing."""
    async with FakeOpenAIChat() as fake:
        fake.script(Reply(text="The one answer."))
        env = model_env(fake, "openai:gpt-test")
        release = tmp_path / "release"
        stalled = workers.start(
            "stalled",
            app="jetloop.demo.agent:app",
            env=env,
            hold="run_model.in_call",
            release_file=release,
        )
        h = await client.send("demo", "pf1", "hello")
        held = await stalled.wait_for("fault.hold", point="run_model.in_call")
        seq, delivery = held["seq"], held["delivery"]
        stalled.pause()
        workers.start("taker", app="jetloop.demo.agent:app", env=env)
        res = await client.wait(h, timeout=30)
        assert res.text == "The one answer."
        assert len(fake.received) == 1
        turn = await client.turn("pf1", h.turn_id)
        before = await last_seqs(client, "pf1")

        stalled.resume()
        release.touch()
        await handled(stalled, held)
        await tap.nc.flush()
        after_hold = stalled.lines()
        after_hold = after_hold[after_hold.index(held) :]
        assert not [ln for ln in after_hold if ln["event"] == "model.call"], "a model call"
        assert stalled.find("step.taken_over", seq=seq, delivery=delivery)
        assert len(fake.received) == 1, "the provider was asked again"
    assert tap.settled(seq, delivery) == [], "the stale delivery must not be settled"
    assert await last_seqs(client, "pf1") == before, "nothing new in the streams"
    assert await client.turn("pf1", h.turn_id) == turn


async def test_model_call_in_flight_is_cancelled_when_the_claim_is_found_lost(
    client: Client, workers: WorkerFactory, tap: AckTap, tmp_path: Path
) -> None:
    """A worker paused past its lease while its model call is in flight, resumed after
    another worker took the step over and finished the turn: its first heartbeat finds the
    claim lost and cancels the call (the provider sees the client leave, unanswered), and
    the stale attempt writes, publishes and acks nothing."""
    async with FakeOpenAIChat() as fake:
        fake.script(Stall(), Reply(text="The one answer."))
        env = model_env(fake, "openai:gpt-test")
        release = tmp_path / "release"
        release.touch()  # the hold point only names the delivery; it does not wait
        stalled = workers.start(
            "stalled",
            app="jetloop.demo.agent:app",
            env=env,
            hold="run_model.in_call",
            release_file=release,
        )
        h = await client.send("demo", "pf2", "hello")
        held = await stalled.wait_for("fault.hold", point="run_model.in_call")
        seq, delivery = held["seq"], held["delivery"]

        async def in_flight() -> bool:
            return len(fake.received) >= 1

        await until(in_flight)
        stalled.pause()
        workers.start("taker", app="jetloop.demo.agent:app", env=env)
        res = await client.wait(h, timeout=30)
        assert res.text == "The one answer."
        turn = await client.turn("pf2", h.turn_id)
        before = await last_seqs(client, "pf2")
        assert fake.abandoned == 0

        stalled.resume()
        # Within a heartbeat, while the provider still holds the request open.
        await stalled.wait_for("step.taken_over", seq=seq, delivery=delivery, timeout=10)

        async def left() -> bool:
            return fake.abandoned == 1

        await until(left, timeout=5)
        assert len(fake.received) == 2
    await tap.nc.flush()
    assert tap.settled(seq, delivery) == [], "the stale delivery must not be settled"
    assert await last_seqs(client, "pf2") == before, "nothing new in the streams"
    assert await client.turn("pf2", h.turn_id) == turn


async def test_stalled_worker_makes_no_summary_call_after_a_takeover(
    client: Client, workers: WorkerFactory, vendor: Vendor, tap: AckTap, tmp_path: Path
) -> None:
    """The same for a context compaction: a worker paused past its lease after claiming the
    summary and before asking the model for it, resumed once another worker compacted and
    finished the turn, asks for no summary and settles nothing."""
    release = tmp_path / "release"
    stalled = workers.start("stalled", hold="compact_context.in_call", release_file=release)
    h1 = await client.send("compactor", "pc", script(answer="padding " * 60))
    await client.wait(h1, timeout=30)
    h2 = await client.send("compactor", "pc", script(answer="after"))
    held = await stalled.wait_for("fault.hold", point="compact_context.in_call")
    seq, delivery = held["seq"], held["delivery"]
    stalled.pause()
    workers.start("taker")
    res = await client.wait(h2, timeout=30)
    assert body(res.text)["summaries"] == ["SUMMARY of 2 messages"]
    assert sum((await vendor.payload_counts("summary_call")).values()) == 1
    # The session counts the turn done in the step's last write, after the turn's end is
    # heard: wait for it, or it lands among the writes this test says nothing makes.
    await until(lambda: _turns_done(client, "pc", 2), timeout=30)
    before = await last_seqs(client, "pc")

    stalled.resume()
    release.touch()
    await handled(stalled, held)
    await tap.nc.flush()
    after_hold = stalled.lines()
    after_hold = after_hold[after_hold.index(held) :]
    assert not [ln for ln in after_hold if ln["event"] == "model.call"], "a summary call"
    assert stalled.find("step.taken_over", seq=seq, delivery=delivery)
    assert sum((await vendor.payload_counts("summary_call")).values()) == 1
    assert tap.settled(seq, delivery) == [], "the stale delivery must not be settled"
    assert await last_seqs(client, "pc") == before, "nothing new in the streams"


async def _turns_done(client: Client, session: str, n: int) -> bool:
    snap = await client.snapshot(session)
    return snap is not None and snap.turns_done >= n
