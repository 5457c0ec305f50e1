"""A model step's calls travel in one message (``call_tools``): one publish, one delivery,
one ack for them all, each call still fenced and settled on its own; and a message per call
while a worker that does not run that kind is alive (a rolling upgrade from a release without
it). Real nats-server, real worker processes."""

from __future__ import annotations

import collections
import json
import time
from datetime import datetime
from typing import Any

import msgpack
from nats.aio.msg import Msg
from nats.js.errors import NoKeysError

from jetloop.consumers.call_tool import outcome_bytes
from jetloop.consumers.join import KEPT_READ_BYTES, KEPT_READ_OVERHEAD, StepCalls
from jetloop.demo.vendor import Vendor
from jetloop.schemas import CallOutcome, CallState, StepKind
from jetloop.services.client import Client
from jetloop.streams.history import HistoryReader
from jetloop.streams.topology import STATE_BUCKET, WORKERS_BUCKET
from tests.conftest import WorkerFactory, body, call, script, until
from tests.test_folded_log import stored


async def _tool_steps(client: Client) -> collections.Counter[str]:
    """Counts, by kind, the tool steps published from now on (a core subscription)."""
    seen: collections.Counter[str] = collections.Counter()

    async def on(msg: Msg) -> None:
        if not (msg.reply or "").startswith("$JS.ACK"):  # the publish, not a delivery
            seen[msg.subject.split(".")[4]] += 1

    await client.nc.subscribe("jl.step.tool.tester.>", cb=on)
    await client.nc.flush()
    return seen


async def test_a_model_steps_calls_travel_in_one_message(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Three calls of three effects: one ``call_tools`` message, no message per call, each
    tool made once, each outcome its own record, the turn joined once."""
    w = workers.start()
    await w.wait_for("worker.started", timeout=30)
    seen = await _tool_steps(client)
    h = await client.send(
        "tester",
        "ct1",
        script([call("write", name="a"), call("once", name="b"), call("read", name="c")]),
    )
    await client.wait(h, timeout=30)
    assert dict(seen) == {"call_tools": 1}
    for i in range(3):
        rec = await client.call("ct1", h.turn_id, 0, i)
        assert rec is not None and rec.state == CallState.SUCCEEDED, (i, rec)
    assert list((await vendor.request_counts("write")).values()) == [1]
    assert list((await vendor.request_counts("once")).values()) == [1]
    assert len(w.find("step.acked", kind="call_tools")) == 1


async def test_a_call_handed_back_leaves_the_others_made_once(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """One call of the message fails twice with a transient error: the message is handed
    back twice; the calls beside it, committed on the first delivery, are not made again
    (found done, told again, joined), and the turn completes once the third attempt succeeds."""
    w = workers.start()
    h = await client.send(
        "tester",
        "ct2",
        script([call("flaky", name="f"), call("write", name="a"), call("once", name="b")]),
    )
    await client.wait(h, timeout=60)
    states = [(await client.call("ct2", h.turn_id, 0, i)) for i in range(3)]
    assert [r.state if r else None for r in states] == [CallState.SUCCEEDED] * 3
    assert states[0] is not None and states[0].attempts == 3
    assert list((await vendor.request_counts("write")).values()) == [1]
    assert list((await vendor.request_counts("once")).values()) == [1]
    assert list((await vendor.request_counts("flaky")).values()) == [1]
    assert len(w.find("step.retry_later", kind="call_tools")) == 2


async def test_a_worker_that_does_not_run_it_means_a_message_per_call(
    client: Client, workers: WorkerFactory
) -> None:
    """While a presence names no step kinds (a release before ``call_tools``), calls go one
    message per call, which every release runs; once it is gone, in one message again."""
    kv = await client.js.key_value(WORKERS_BUCKET)
    older = {"agents": ["tester"], "pools": ["tool"], "since": time.time()}
    await kv.put("worker.older-release", json.dumps(older).encode())
    try:
        w = workers.start()
        await w.wait_for("worker.started", timeout=30)
        seen = await _tool_steps(client)
        h = await client.send(
            "tester", "ct3", script([call("write", name="a"), call("read", name="b")])
        )
        await client.wait(h, timeout=30)
        assert dict(seen) == {"call_tool": 2}
    finally:
        await kv.delete("worker.older-release")
    # The worker looks again with its next presence (every 5 s).
    await w.wait_for("worker.calls_in_one_message", now=True, timeout=30)
    seen.clear()
    again = script([call("write", name="c"), call("read", name="d")])
    h = await client.send("tester", "ct3", again)
    await client.wait(h, timeout=30)
    assert dict(seen) == {"call_tools": 1}


async def test_a_call_tools_message_of_no_or_too_many_calls_is_dead_lettered(
    client: Client, workers: WorkerFactory
) -> None:
    """A hand-made ``call_tools`` message claiming 0 or a million calls is dead-lettered with
    the reason, nothing run; the worker serves on."""
    w = workers.start()
    for sid, n in (("ct4a", 0), ("ct4b", 1_000_000)):
        body = {
            "kind": "call_tools",
            "agent": "tester",
            "session_id": sid,
            "turn_id": "t1",
            "calls": n,
        }
        await client.js.publish(
            f"jl.step.tool.tester.call_tools.{sid}",
            msgpack.packb(body),
            headers={"Nats-Msg-Id": f"{sid}.t1.m0.calls", "Jl-Kind": "call_tools"},
        )

    async def both() -> dict[str, str] | None:
        dead = {subject: reason for subject, reason, _ in await client.dead_letters()}
        mine = {s: r for s, r in dead.items() if ".call_tools.ct4" in s}
        return mine if len(mine) == 2 else None

    dead = await until(both, timeout=15)
    assert "with 0 calls (1 to 64 are sent)" in dead["jl.step.tool.tester.call_tools.ct4a"]
    assert "with 1000000 calls" in dead["jl.step.tool.tester.call_tools.ct4b"]
    h = await client.send("tester", "ct4-next", script([call("write", name="after")]))
    await client.wait(h, timeout=30)
    assert w.alive()


async def test_the_tool_pools_concurrency_counts_the_calls_of_one_message(
    client: Client, workers: WorkerFactory
) -> None:
    """With ``JETLOOP_TOOL_CONCURRENCY=1`` the three calls of one message run one after
    another (each sleeps 0.4 s, then writes): their outcomes are at least 0.8 s apart."""
    w = workers.start(env={"JETLOOP_TOOL_CONCURRENCY": "1"})
    slow = [call("slow", name=n, seconds=0.4) for n in "abc"]
    h = await client.send("tester", "ct5", script(slow))
    await client.wait(h, timeout=60)
    stamps = sorted(datetime.fromisoformat(ln["timestamp"]) for ln in w.find("call.recorded"))
    assert len(stamps) == 3
    assert (stamps[-1] - stamps[0]).total_seconds() >= 0.8


async def test_a_call_whose_wait_ends_while_its_siblings_run_still_joins(
    client: Client, workers: WorkerFactory
) -> None:
    """One call of the message waits for an approval, granted at once: its own message
    commits it and joins while a sibling still runs in the message of calls, so that join
    finds the sibling open. The waiting call's record is not written again for the message
    (its heartbeat would fail on the commit and take the whole message for lost), and the
    sibling, ending later, joins from state (from what the message knows it would wait for
    the approved call, which ended elsewhere): the turn completes, and the message is acked
    on its first delivery."""
    w = workers.start()
    await w.wait_for("worker.started", timeout=30)
    h = await client.send(
        "tester", "ct6", script([call("guarded", name="g"), call("slow", name="s", seconds=3)])
    )

    async def held() -> Any:
        snap = await client.snapshot("ct6")
        return snap.approvals[0] if snap is not None and snap.approvals else None

    approval = await until(held, timeout=30)
    await client.approve("ct6", approval.approval_id, by="tester")
    res = await client.wait(h, timeout=30)
    assert res.status == "completed"
    await w.wait_for("step.acked", kind="call_tools", timeout=10)
    assert [ln["delivery"] for ln in w.find("step.acked", kind="call_tools")] == [1]
    assert w.find("fence.lost_on_beat") == []
    recorded = {ln["call"]: ln["kind"] for ln in w.find("call.recorded")}
    assert recorded == {
        f"ct6.{h.turn_id}.0.0": "await_tool_approval",  # the approved call, by its own message
        f"ct6.{h.turn_id}.0.1": "call_tools",
    }


async def _state_keys(client: Client, prefix: str) -> list[str]:
    kv = await client.js.key_value(STATE_BUCKET)
    try:
        return sorted(k for k in await kv.keys() if k.startswith(prefix))
    except NoKeysError:
        return []


async def test_a_steps_reads_are_kept_in_one_record(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Three reads and a write in one message: the reads' outcomes are written together, one
    ``StepReads`` record (one write the server syncs, not three); the write keeps its own.
    Every read is made once, and reads back as a call's record would (``Client.call``, the
    snapshot), and the model is given every result in call order."""
    w = workers.start()
    await w.wait_for("worker.step_reads", now=True, timeout=30)
    calls = [call("read", name="a"), call("read", name="bb"), call("write", name="w")]
    calls.append(call("read", name="ccc"))
    h = await client.send("tester", "kr1", script(calls))
    res = await client.wait(h, timeout=30)
    assert await _state_keys(client, f"call.kr1.{h.turn_id}.") == [f"call.kr1.{h.turn_id}.0.2"]
    assert await _state_keys(client, f"reads.kr1.{h.turn_id}.") == [f"reads.kr1.{h.turn_id}.0"]
    for i, want in ((0, 1), (1, 2), (3, 3)):
        rec = await client.call("kr1", h.turn_id, 0, i)
        assert rec is not None and rec.state == CallState.SUCCEEDED and rec.attempts == 1
        assert rec.outcome is not None and rec.outcome.result["value"] == want
    snap = await client.snapshot("kr1")
    assert snap is not None
    assert [(c.index, c.tool, c.state) for c in snap.calls] == [
        (0, "read", "succeeded"),
        (1, "read", "succeeded"),
        (2, "write", "succeeded"),
        (3, "read", "succeeded"),
    ]
    assert sorted((await vendor.payload_counts("read")).values()) == [1, 1, 1]
    seen = body(res.text)["seen"]
    assert [s["result"]["value"] for s in seen if s["tool"] == "read"] == [1, 2, 3]


async def test_reads_kept_before_their_worker_died_are_not_made_again(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A worker killed after it wrote the step's reads record and before the join moved the
    turn: the message's next delivery finds every read's outcome kept, makes none again,
    tells them and joins; the turn completes with the first results."""
    victim = workers.start("victim", hold="call_tool.after_commit")
    await victim.wait_for("worker.step_reads", now=True, timeout=30)
    h = await client.send("tester", "kr2", script([call("read", name="a"), call("read", name="b")]))
    await victim.wait_for("fault.hold", point="call_tool.after_commit", timeout=30)
    assert await _state_keys(client, f"call.kr2.{h.turn_id}.") == []
    assert await _state_keys(client, f"reads.kr2.{h.turn_id}.") == [f"reads.kr2.{h.turn_id}.0"]
    turn = await client.turn("kr2", h.turn_id)
    assert turn is not None and turn.model_step == 0  # not joined yet
    victim.kill()
    workers.start("survivor")
    res = await client.wait(h, timeout=60)
    assert sorted((await vendor.payload_counts("read")).values()) == [1, 1]
    assert [s["status"] for s in body(res.text)["seen"]] == ["ok", "ok"]
    assert await _state_keys(client, f"call.kr2.{h.turn_id}.") == []
    assert await _state_keys(client, f"reads.kr2.{h.turn_id}.") == [f"reads.kr2.{h.turn_id}.0"]


async def test_reads_told_in_one_entry_and_again_one_by_one_are_read_once(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A worker killed after it told a step's kept reads in one entry (and sent the next
    model step) but before it acked its message: the message's next delivery tells each read
    again in an entry of its own. The conversation holds each result once, in call order, and
    no read is made again."""
    victim = workers.start("victim", hold="join.after_publish")
    await victim.wait_for("worker.results_entry", now=True, timeout=30)
    calls = [call("read", name="a"), call("read", name="bb"), call("read", name="ccc")]
    h = await client.send("tester", "kr5", script(calls))
    await victim.wait_for("fault.hold", point="join.after_publish", timeout=30)
    victim.kill()
    workers.start("survivor")
    res = await client.wait(h, timeout=60)
    assert sorted((await vendor.payload_counts("read")).values()) == [1, 1, 1]
    assert [s["result"]["value"] for s in body(res.text)["seen"]] == [1, 2, 3]
    base = f"kr5.{h.turn_id}.m0"

    async def told() -> collections.Counter[str | None] | None:
        # The message's next delivery may come after the turn ended (the survivor ran the
        # next model step from what the victim had sent): waited for, not read once.
        ids = collections.Counter(
            (m.headers or {}).get("Nats-Msg-Id")
            for m in await stored(client, "kr5", "history.tool")
        )
        return ids if len(ids) == 4 else None

    ids = await until(told, timeout=60)
    assert ids[f"{base}.results"] == 1
    assert sorted(k for k in ids if k != f"{base}.results") == [
        f"{base}.c{i}.result" for i in range(3)
    ]
    reader = HistoryReader(client.nc)
    keys = [e.key for e in await reader.read("kr5") if e.role.value == "tool"]
    assert keys == [f"{base}.c{i}.result" for i in range(3)]


async def test_a_worker_that_does_not_read_it_means_a_record_per_read(
    client: Client, workers: WorkerFactory
) -> None:
    """While a live worker's presence does not list ``step_reads`` (a release before it),
    every read keeps its own record, which every release reads."""
    kv = await client.js.key_value(WORKERS_BUCKET)
    older = {"agents": ["tester"], "pools": ["tool"], "since": time.time()}
    older["kinds"] = sorted(StepKind)
    await kv.put("worker.older-release", json.dumps(older).encode())
    try:
        w = workers.start()
        await w.wait_for("worker.started", timeout=30)
        h = await client.send(
            "tester", "kr3", script([call("read", name="a"), call("read", name="b")])
        )
        await client.wait(h, timeout=30)
        assert await _state_keys(client, f"call.kr3.{h.turn_id}.") == [
            f"call.kr3.{h.turn_id}.0.0",
            f"call.kr3.{h.turn_id}.0.1",
        ]
    finally:
        await kv.delete("worker.older-release")


async def test_a_steps_reads_wait_for_a_sibling_that_waits(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Two reads and a question in one message: the question's part ends with its wait, so
    the step's last outcome is not in the message; the reads are kept together once every
    part has ended, and the answer, by the question's own message, joins from state, which
    sees them: the turn completes, each read made once."""
    w = workers.start()
    await w.wait_for("worker.step_reads", now=True, timeout=30)
    calls = [call("read", name="a"), call("ask_user", question="go on?"), call("read", name="b")]
    h = await client.send("tester", "kr4", script(calls))

    async def asked() -> Any:
        snap = await client.snapshot("kr4")
        return snap.questions[0] if snap is not None and snap.questions else None

    question = await until(asked, timeout=30)

    async def kept() -> bool:
        # Written once every part of the message ended: the reads may end after the
        # question is asked (a loaded machine), so waited for, not read once.
        keys = await _state_keys(client, f"reads.kr4.{h.turn_id}.")
        return keys == [f"reads.kr4.{h.turn_id}.0"]

    await until(kept, timeout=15)
    await client.answer("kr4", question.question_id, "yes")
    res = await client.wait(h, timeout=30)
    assert [s["tool"] for s in body(res.text)["seen"]] == ["read", "ask_user", "read"]
    assert sorted((await vendor.payload_counts("read")).values()) == [1, 1]
    assert await _state_keys(client, f"call.kr4.{h.turn_id}.") == [f"call.kr4.{h.turn_id}.0.1"]


def test_reads_are_kept_together_only_while_the_record_stays_well_within_a_message() -> None:
    """A read's outcome is kept for its step's reads record while it is small (its error
    counted) and while the record, each outcome counted with its record's other fields,
    stays within half the server's limit on a message: with a low limit (an account's) the
    later reads write records of their own instead of one record the server would refuse."""
    ok = CallOutcome(state=CallState.SUCCEEDED, result={"value": "x" * 1000})
    size = outcome_bytes(ok)
    assert size is not None and size > 1000
    failed = CallOutcome(state=CallState.FAILED, error="e" * (KEPT_READ_BYTES + 1))
    assert (outcome_bytes(failed) or 0) > KEPT_READ_BYTES
    assert outcome_bytes(CallOutcome(state=CallState.SUCCEEDED, result={1, 2})) is None

    roomy = StepCalls(parts=[])
    assert all(roomy.keeps(size, 1024 * 1024) for _ in range(64))
    assert not roomy.keeps(KEPT_READ_BYTES + 1, 1024 * 1024)

    # Room for three: half of the limit holds three outcomes and their overheads.
    limit = 2 * 3 * (size + KEPT_READ_OVERHEAD)
    low = StepCalls(parts=[])
    assert [low.keeps(size, limit) for _ in range(5)] == [True, True, True, False, False]
    assert low.kept_bytes == 3 * (size + KEPT_READ_OVERHEAD)
