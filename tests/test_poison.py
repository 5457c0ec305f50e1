"""Poison messages (issue 13, finding 2): whatever a message carries, it is handled once or
dead-lettered with its reason; it never blocks its session, and the snapshot still reads."""

from __future__ import annotations

import json
import time

import msgpack
import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from jetloop.consumers.dispatch import (
    OUTAGE_BACKOFF,
    OUTAGE_JITTER,
    TRANSIENT_FOR,
    UNEXPECTED_TRIES,
    Failing,
    fate,
)
from jetloop.schemas import turn_id_for
from jetloop.services.client import Client, TurnFailed
from jetloop.streams.seal import SealBroken
from jetloop.streams.state import Conflict, turn_key
from tests.conftest import WorkerFactory, call, script, until
from tests.test_resume import pending_approval


async def dead_reasons(client: Client) -> dict[str, str]:
    return {subject: reason for subject, reason, _ in await client.dead_letters()}


async def test_bad_parent_is_dead_lettered_once(client: Client, workers: WorkerFactory) -> None:
    """A request whose ``metadata.parent`` is not a parent call (msgpack or JSON) is refused
    when it is decoded: dead-lettered on its first delivery, naming the field, and the
    session's next message runs at once instead of waiting behind it for ever."""
    w = workers.start()
    bad = {"text": "hi", "metadata": {"parent": {"x": 1}}}
    await client.js.publish(
        "jl.turn.tester.pp", msgpack.packb(bad), headers={"Nats-Msg-Id": "pp.1"}
    )
    await client.js.publish(
        "jl.turn.tester.pp", json.dumps(bad).encode(), headers={"Nats-Msg-Id": "pp.2"}
    )
    h = await client.send("tester", "pp", script([call("write", name="after")]))
    await client.wait(h, timeout=20)
    assert w.alive()

    letters = await client.dead_letters()
    assert [s for s, _, _ in letters] == ["jl.turn.tester.pp", "jl.turn.tester.pp"]
    for _, reason, _ in letters:
        assert "TurnRequest invalid at metadata" in reason and "parent" in reason, reason
    assert w.find("step.error") == []  # refused at decode: never a retry


async def test_unknown_schema_version_is_dead_lettered(
    client: Client, workers: WorkerFactory
) -> None:
    """A turn request or a step of a schema version this jetloop does not know (a newer
    writer's) is not run as version 1: the request, a client's, is dead-lettered at once; the
    step, a newer worker's, once no worker read it within JETLOOP_NEWER_WRITER_SECONDS (here
    1 s); both with the version in the reason."""
    w = workers.start(env={"JETLOOP_NEWER_WRITER_SECONDS": "1"})
    await client.js.publish(
        "jl.turn.tester.vv",
        msgpack.packb({"v": 999, "text": "from the future"}),
        headers={"Nats-Msg-Id": "vv.1"},
    )
    step = {"v": 999, "kind": "turn_done", "agent": "tester", "session_id": "vv", "turn_id": "t1"}
    await client.js.publish(
        "jl.step.session.tester.turn_done.vv", msgpack.packb(step), headers={"Nats-Msg-Id": "vv-s"}
    )
    h = await client.send("tester", "vv", script([call("write", name="after")]))
    await client.wait(h, timeout=20)
    assert w.alive()

    dead = await until(lambda: _two(client))
    assert "TurnRequest has schema version 999" in dead["jl.turn.tester.vv"]
    assert "StepMessage has schema version 999" in dead["jl.step.session.tester.turn_done.vv"]
    assert "no worker that reads it took it in 1 s" in dead["jl.step.session.tester.turn_done.vv"]

    async def counted() -> int | None:
        # The session counts a turn at its turn_done step, just after the turn's end event.
        snap = await client.snapshot("vv")
        return snap.turns_done if snap is not None and snap.turns_done else None

    assert await until(counted) == 1  # only the good request ran


async def test_a_newer_workers_step_is_handed_back_not_dead_lettered(
    client: Client, workers: WorkerFactory
) -> None:
    """In a rolling upgrade an older worker meets a step of a kind it does not know (or of a
    newer schema version): it hands the step back, again and again, for a worker that reads
    it, and dead-letters nothing meanwhile; the other sessions run."""
    w = workers.start()
    future = {"kind": "future_kind", "agent": "tester", "session_id": "nk", "turn_id": "t1"}
    await client.js.publish(
        "jl.step.session.tester.future_kind.nk",
        msgpack.packb(future),
        headers={"Nats-Msg-Id": "nk"},
    )
    newer = {"v": 2, "kind": "turn_done", "agent": "tester", "session_id": "nv", "turn_id": "t1"}
    await client.js.publish(
        "jl.step.session.tester.turn_done.nv", msgpack.packb(newer), headers={"Nats-Msg-Id": "nv"}
    )

    async def handed_back_twice() -> bool:
        seen = w.find("step.newer_writer")
        return {"nk", "nv"} <= {line.get("step") for line in seen} and len(seen) >= 4

    await until(handed_back_twice)
    h = await client.send("tester", "other", script([call("write", name="meanwhile")]))
    await client.wait(h, timeout=20)
    assert await client.dead_letters() == []
    reasons = {line["reason"] for line in w.find("step.newer_writer")}
    assert any("unknown step kind 'future_kind'" in r for r in reasons), reasons
    assert any("StepMessage has schema version 2" in r for r in reasons), reasons


async def _two(client: Client) -> dict[str, str] | None:
    dead = await dead_reasons(client)
    return dead if len(dead) == 2 else None


async def test_garbage_call_record_fails_the_turn_and_the_session_moves_on(
    client: Client, workers: WorkerFactory
) -> None:
    """Garbage bytes put over a call's record: the snapshot shows the call as unreadable
    (it does not fail); the step that meets it fails the turn, its close step settles the
    call over the garbage (nothing is dead-lettered), and the session's next turn runs."""
    w = workers.start()
    h = await client.send("tester", "gc", script([call("guarded", name="g")]))
    approval = await pending_approval(client, "gc")
    kv = await client.js.key_value("jl_state")
    key = f"call.gc.{h.turn_id}.0.0"
    await kv.put(key, b"\xc1 garbage")

    snap = await client.snapshot("gc")
    assert snap is not None
    [view] = snap.calls
    assert view.state == "unreadable" and view.tool == "guarded"
    assert view.error is not None and view.error.startswith("unreadable record: it is not msgpack")

    await client.approve("gc", approval, by="alice")
    with pytest.raises(TurnFailed, match="checkpoint not trusted"):
        await client.wait(h, timeout=20)
    nxt = await client.send("tester", "gc", script([call("write", name="after")]))
    await client.wait(nxt, timeout=20)
    assert w.alive()
    assert await client.dead_letters() == []

    closed = await client.call("gc", h.turn_id, 0, 0)  # sealed again, readable
    assert closed is not None and closed.state == "outcome_unknown"
    assert closed.outcome is not None and closed.outcome.error is not None
    assert closed.outcome.error.startswith("unreadable record: it is not msgpack")

    async def both_done() -> bool:
        snap = await client.snapshot("gc")
        return snap is not None and snap.turns_done == 2

    await until(both_done, timeout=10)  # the session moved past both turns


async def test_untrusted_record_under_a_request_is_dead_lettered_at_once(
    client: Client, workers: WorkerFactory
) -> None:
    """A turn request whose turn record is not trusted (garbage, where a duplicate request
    would find its turn) is dead-lettered on its first delivery with the reason: no retry can
    cure a seal. The session's next request then runs."""
    w = workers.start()
    kv = await client.js.key_value("jl_state")
    await kv.put(turn_key("ue", turn_id_for("ue", "ue-1")), b"\xc1 garbage")
    await client.js.publish(
        "jl.turn.tester.ue", msgpack.packb({"text": "hi"}), headers={"Nats-Msg-Id": "ue.ue-1"}
    )
    h = await client.send("tester", "ue", script([call("write", name="after")]))
    await client.wait(h, timeout=30)
    assert w.alive()

    dead = await dead_reasons(client)
    assert "SealBroken" in dead["jl.turn.tester.ue"]
    assert "is not msgpack" in dead["jl.turn.tester.ue"]
    assert len(w.find("step.error")) == 1


def test_unexpected_errors_are_retried_a_bounded_number_of_times() -> None:
    """An error that is neither an outage nor a bad body nor an untrusted record is retried
    with backoff for ``UNEXPECTED_TRIES`` deliveries in a row, then dead-lettered; an outage
    is retried for ``TRANSIENT_FOR`` seconds; the incurable at once."""
    failing = Failing(since=time.monotonic())
    for n in range(1, UNEXPECTED_TRIES + 1):
        delay, _ = fate(RuntimeError("a bug"), failing)
        assert delay is not None and delay > 0, n
        failing.count, failing.unexpected = n, n
    delay, why = fate(RuntimeError("a bug"), failing)
    assert delay is None and f"failed {UNEXPECTED_TRIES} deliveries in a row" in why
    assert fate(SealBroken("turn.s.t", "forged"), Failing(since=time.monotonic()))[0] is None
    outage = Failing(since=time.monotonic() - TRANSIENT_FOR - 1, count=40)
    assert fate(Conflict("turn.s.t", 1), Failing(since=time.monotonic(), count=40))[0] is not None
    assert fate(Conflict("turn.s.t", 1), outage)[0] is None


def test_an_outage_is_waited_out_in_short_steps() -> None:
    """A step failing in an outage is tried again at most ``OUTAGE_BACKOFF`` (+ its jitter)
    apart however long it lasts, so it moves within seconds of the outage's end; a bug's
    retries still back off further."""
    waits = [
        fate(NatsTimeoutError(), Failing(since=time.monotonic(), count=n))[0] for n in range(1, 30)
    ]
    assert all(w is not None and 0 < w <= OUTAGE_BACKOFF * (1 + OUTAGE_JITTER) for w in waits)
    assert max(w for w in waits if w is not None) > OUTAGE_BACKOFF * 0.99
    bug = fate(RuntimeError("a bug"), Failing(since=time.monotonic(), count=6, unexpected=1))[0]
    assert bug is not None and bug > OUTAGE_BACKOFF * (1 + OUTAGE_JITTER)
