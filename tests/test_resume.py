"""Crash resume (issue 5): sealed checkpoints, loss accounting, gates and settlement on
resume, keyed writes with a dedupe window, answers handed on once."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest

from jetloop.demo.vendor import Vendor
from jetloop.schemas import TurnPhase, call_key
from jetloop.services.client import Client, TurnFailed
from jetloop.streams import topology
from jetloop.streams.bus import H_HOLDER_LOST
from jetloop.streams.state import turn_key
from tests.conftest import SEAL_KEY, WorkerFactory, body, call, script, until
from tests.test_crash import last_seqs


async def events_of(client: Client, session: str, until_types: tuple[str, ...]) -> list[object]:
    out = []
    async for ev in client.events(session):
        out.append(ev)
        if ev.type in until_types:
            return out
    return out


async def pending_approval(client: Client, session: str) -> str:
    async def check() -> str | None:
        snap = await client.snapshot(session)
        return snap.approvals[0].approval_id if snap and snap.approvals else None

    found: str = await until(check)
    return found


async def test_tampered_checkpoint_is_not_run(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A checkpoint changed behind jetloop's back (a raw KV put) does not verify: the turn
    fails with the reason, audited, and the call it held is never made."""
    workers.start()
    h = await client.send("tester", "tp", script([call("guarded", name="harmless")]))
    approval = await pending_approval(client, "tp")
    kv = await client.js.key_value("jl_state")
    entry = await kv.get(turn_key("tp", h.turn_id))
    raw = msgpack.unpackb(entry.value)
    raw["calls"][0]["args"] = {"name": "evil"}  # the seal stays the old one
    await kv.put(turn_key("tp", h.turn_id), msgpack.packb(raw))
    await client.approve("tp", approval, by="alice")
    with pytest.raises(TurnFailed, match="checkpoint not trusted"):
        await client.wait(h, timeout=30)
    assert await vendor.effect_count("guarded") == 0
    kinds = [e.type for e in await events_of(client, "tp", ("turn.failed",))]  # type: ignore[attr-defined]
    assert "agent.run.checkpoint_rejected" in kinds


async def test_rotated_key_still_verifies(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Checkpoints sealed under a key moved to JETLOOP_SEAL_OLD_KEYS still verify; a worker
    that does not know the old key does not trust them (so verification is really on)."""
    old = workers.start()
    h_unknown = await client.send("tester", "unk", script([call("guarded", name="u")]))
    h = await client.send("tester", "rot", script([call("guarded", name="g")]))
    unknown = await pending_approval(client, "unk")
    approval = await pending_approval(client, "rot")
    # Stopped cleanly (its steps acked), not killed: a worker started after a kill takes over
    # at once what the dead one still held, and the stranger below must never see "rot".
    old.terminate()
    new_key = "ab" * 32
    from jetloop.services.settings import load_settings

    # A worker with the new key only: the old seal does not verify, nothing runs.
    stranger = workers.start("stranger", env={"JETLOOP_SEAL_KEY": new_key})
    await client.approve("unk", unknown, by="alice")
    strangers = Client(client.nc, sealer=load_settings(seal_key=new_key).sealer())
    with pytest.raises(TurnFailed, match="checkpoint not trusted"):
        await strangers.wait(h_unknown, timeout=30)
    assert await vendor.effect_count("guarded") == 0
    stranger.kill()

    workers.start(env={"JETLOOP_SEAL_KEY": new_key, "JETLOOP_SEAL_OLD_KEYS": SEAL_KEY})
    rotated = Client(
        client.nc, sealer=load_settings(seal_key=new_key, seal_old_keys=SEAL_KEY).sealer()
    )
    await rotated.approve("rot", approval, by="alice")
    await rotated.wait(h, timeout=30)
    assert await vendor.effect_count("guarded") == 1


async def test_turn_lost_three_times_fails(client: Client, workers: WorkerFactory) -> None:
    """Every takeover is a loss; the third fails the turn with the reason, and the waiting
    caller and the transcript are told. Each resume is audited with the loss count."""
    h = await client.send("tester", "l3", script([call("read", name="r")]))
    for n in range(3):
        victim = workers.start(f"victim{n}", hold="run_model.in_call")
        await victim.wait_for("fault.hold", point="run_model.in_call")
        victim.kill()
    workers.start("survivor")
    with pytest.raises(TurnFailed, match="lost 3 times"):
        await client.wait(h, timeout=60)
    events = await events_of(client, "l3", ("turn.failed",))
    resumed = [e.data["losses"] for e in events if e.type == "agent.run.crash_resumed"]  # type: ignore[attr-defined]
    assert resumed == [1, 2]
    assert [e.type for e in events][-1] == "turn.failed"  # type: ignore[attr-defined]


async def test_one_worker_lost_is_one_loss(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A worker killed while it held three parallel calls of one turn lost the turn once:
    each call is resumed and audited with a loss count of 1, and the turn completes."""
    victim = workers.start("victim", hold="call_tool.before_commit")
    calls = [call("write", name=f"w{i}") for i in range(3)]
    h = await client.send("tester", "p3", script(calls))

    async def all_held() -> bool:
        return len(victim.find("fault.hold", point="call_tool.before_commit")) == 3

    await until(all_held)
    victim.kill()
    workers.start("survivor")
    await client.wait(h, timeout=60)
    events = await events_of(client, "p3", ("turn.completed",))
    resumed = [e.data["losses"] for e in events if e.type == "agent.run.crash_resumed"]  # type: ignore[attr-defined]
    assert resumed == [1, 1, 1]
    assert await vendor.effect_count("write") == 3


async def test_a_step_its_live_worker_abandoned_is_resumed_without_a_loss(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A live worker whose delivery ended with its claim still recorded (an outage that
    outlasted its writes' retries, made here at two points, once each) resumes the step as
    after a crash — the model step by a new attempt, the single-attempt write it had made
    settled in doubt, not made again — and each resume is audited as abandoned, but the turn
    records no loss: a turn must not fail its loss limit on workers that never died."""
    fails = "run_model.before_commit,call_tool.before_commit"
    w = workers.start("w", env={"JETLOOP_FAULT_FAIL": fails})
    h = await client.send("tester", "ab", script([call("once", name="o")]))
    res = await client.wait(h, timeout=60)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "outcome_unknown"
    assert await vendor.effect_count("once") == 1
    assert len(w.find("fault.fail")) == 2
    events = await events_of(client, "ab", ("turn.completed",))
    resumed = [e.data for e in events if e.type == "agent.run.crash_resumed"]  # type: ignore[attr-defined]
    assert [(r["abandoned"], r["losses"], r["lost_worker"]) for r in resumed] == [
        (True, 0, "w"),
        (True, 0, "w"),
    ]
    turn = await client.turn("ab", h.turn_id)
    assert turn is not None and turn.lost == []


async def test_a_model_attempt_its_own_worker_never_began_is_continued_not_counted(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A delivery that ended after its model step's claim and before the model was called
    (an outage past its writes' retries; or a claim answered "wrong last sequence" that
    landed all the same, as a failover can answer) left an attempt that never ran. The next
    delivery in the same process continues that attempt under its number: nothing is
    resumed, nothing audited, and the step's attempts are not spent on it — a network fault
    that keeps ending deliveries before their call cannot fail the turn's model step."""
    w = workers.start("w", env={"JETLOOP_FAULT_FAIL": "run_model.in_call"})
    h = await client.send("tester", "uc", script([]))
    await client.wait(h, timeout=60)
    assert len(w.find("fault.fail")) == 1
    events = await events_of(client, "uc", ("turn.completed",))
    assert [e.type for e in events if e.type == "agent.run.crash_resumed"] == []  # type: ignore[attr-defined]
    usage = [e.data["attempt"] for e in events if e.type == "model.usage"]  # type: ignore[attr-defined]
    assert usage == [1]
    turn = await client.turn("uc", h.turn_id)
    assert turn is not None and turn.attempts == 1 and turn.lost == []
    assert sum((await vendor.payload_counts("model_call")).values()) == 1
    assert [e["attempt"] for e in w.find("model.attempt_continued")] == [1]


async def test_a_write_its_own_worker_marked_and_never_began_is_made_not_left_in_doubt(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """The same for a single-attempt write: its delivery ended between the in-doubt mark and
    the write. The process that marked it knows the write never began, so the next delivery
    there continues that attempt and makes the write once — no false ``outcome_unknown`` for
    a person to settle, no resume audited, no attempt spent."""
    w = workers.start("w", env={"JETLOOP_FAULT_FAIL": "call_tool.in_tool"})
    h = await client.send("tester", "uw", script([call("once", name="o")]))
    res = await client.wait(h, timeout=60)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "ok", seen
    assert await vendor.effect_count("once") == 1
    assert len(w.find("fault.fail")) == 1
    events = await events_of(client, "uw", ("turn.completed",))
    assert [e.type for e in events if e.type == "agent.run.crash_resumed"] == []  # type: ignore[attr-defined]
    [outcome] = [e.data for e in events if e.type == "call.outcome"]  # type: ignore[attr-defined]
    assert (outcome["state"], outcome["attempts"]) == ("succeeded", 1)
    assert [e["attempt"] for e in w.find("call.attempt_continued")] == [1]


async def test_gates_again_on_resume(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A resumed call meets the gates as they stand now: a tool the agent no longer offers
    is not made (a write in doubt is outcome_unknown), a policy set meanwhile holds the
    call for approval, a turn cancelled meanwhile runs nothing."""
    # 1. the tool was removed by a deploy while its write was in doubt
    victim = workers.start("victim", hold="call_tool.before_commit")
    h = await client.send("tester", "gr", script([call("write", name="w")]))
    await victim.wait_for("fault.hold")
    victim.kill()
    reduced = workers.start("reduced", app="tests.apps:reduced_app")
    res = await client.wait(h, timeout=30)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "outcome_unknown" and "no longer offers" in seen["error"]
    reduced.kill()

    # 2. the approval policy changed while the worker was dead
    victim = workers.start("victim2", hold="call_tool.before_mark")
    h = await client.send("tester", "gp", script([call("read", name="r")]))
    await victim.wait_for("fault.hold")
    victim.kill()
    await client.set_approval("gp", "read", True)
    survivor = workers.start("survivor")
    approval = await pending_approval(client, "gp")
    await client.approve("gp", approval)
    await client.wait(h, timeout=30)
    survivor.kill()

    # 3. cancelled while the worker was dead
    victim = workers.start("victim3", hold="call_tool.before_mark")
    h = await client.send("tester", "gc", script([call("slow", name="s", seconds=0)]))
    await victim.wait_for("fault.hold")
    victim.kill()
    await client.cancel("gc")
    workers.start("survivor3")
    with pytest.raises(TurnFailed, match="cancelled"):
        await client.wait(h, timeout=30)
    assert await vendor.effect_count("slow") == 0


async def test_keyed_write_past_its_dedupe_window_is_settled(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A keyed write whose vendor dedupes for 1 s only, resumed after more than 1 s, is
    not sent again with a key the vendor has forgotten: outcome_unknown."""
    victim = workers.start("victim", hold="call_tool.before_commit")
    h = await client.send("tester", "kw", script([call("windowed", name="w")]))
    await victim.wait_for("fault.hold")
    victim.kill()
    # A worker started now would take the step over at once (it hands on what a dead worker
    # held); the vendor's window has to pass first, which is this case.
    await asyncio.sleep(1.5)
    workers.start("survivor")
    res = await client.wait(h, timeout=30)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "outcome_unknown" and "dedupes the key only for 1s" in seen["error"]
    assert sum((await vendor.request_counts("windowed")).values()) == 1


async def test_answer_handed_on_once_after_a_crash(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A worker dying after the last step and before handing the answer on is replaced by
    one that hands on the recorded answer; asking again with the same request id returns
    it without running anything."""
    victim = workers.start("victim", hold="run_model.after_commit")
    h = await client.send("tester", "ans", script(answer="the answer"), request_id="req-ans")
    await victim.wait_for("fault.hold", point="run_model.after_commit")
    victim.kill()
    workers.start("survivor")
    res = await client.wait(h, timeout=30)
    assert res.text is not None and res.text.startswith("the answer")
    again = await client.send("tester", "ans", script(answer="the answer"), request_id="req-ans")
    assert again.duplicate and again.turn_id == h.turn_id
    res2 = await client.wait(again, timeout=30)
    assert res2.text == res.text
    assert sum((await vendor.payload_counts("model_call")).values()) == 1
    events = await events_of(client, "ans", ("turn.completed",))
    assert [e.type for e in events].count("turn.completed") == 1  # type: ignore[attr-defined]


async def test_join_lost_before_publishing_is_published_again(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A worker that moved the turn on in the join (its CAS landed) and died before it
    published what follows: the call step, handed on (a rescue copy at once, or the
    original at its lease), finds its outcome committed and the turn moved, and publishes
    the next model step; the model is asked once for each step and the write made once."""
    victim = workers.start("victim", hold="join.before_publish")
    h = await client.send("tester", "jn", script([call("write", name="x")]))
    held = await victim.wait_for("fault.hold", point="join.before_publish")
    moved = await client.turn("jn", h.turn_id)
    assert moved is not None and moved.model_step == 1 and moved.phase == TurnPhase.MODEL
    victim.kill()
    survivor = workers.start("survivor")
    await client.wait(h, timeout=30)
    assert survivor.find("step.acked", step=held["step"])
    asked = await vendor.payload_counts("model_call")
    assert sorted(json.loads(p)["step"] for p, n in asked.items() for _ in range(n)) == [0, 1]
    assert await vendor.effect_count("write") == 1


async def pending_question(client: Client, session: str) -> str:
    async def check() -> str | None:
        snap = await client.snapshot(session)
        return snap.questions[0].question_id if snap and snap.questions else None

    found: str = await until(check)
    return found


async def stored(client: Client, stream: str, after: int = 0) -> list[dict[str, str]]:
    """The headers of every message stored in a stream after sequence ``after``, in order."""
    info = await client.js.stream_info(stream)
    out = []
    for seq in range(max(after + 1, info.state.first_seq), info.state.last_seq + 1):
        msg = await client.js.get_msg(stream, seq)
        out.append(dict(msg.headers or {}))
    return out


async def test_outcome_committed_before_its_worker_died_is_told_after_the_turn_moved_on(
    client: Client, workers: WorkerFactory
) -> None:
    """A worker killed after committing call 0's outcome and before publishing what follows,
    while call 1 moved the turn on (and the turn completed) elsewhere: the redelivery of
    call 0 publishes its ``call.outcome`` from state, once, and nothing else (no join, no
    next step, no history entry, no event twice). On the separate log, where the outcome is
    an event of its own (the folded log's entry carrying it is checked by test_folded_log)."""
    separate = {"JETLOOP_EVENT_LOG": "separate"}
    held_w = workers.start("held", hold="call_tool.after_commit", env=separate)
    calls = [call("read", name="r"), call("ask_user", question="go on?")]
    h = await client.send("tester", "ro", script(calls))
    held = await held_w.wait_for("fault.hold", point="call_tool.after_commit")
    question = await pending_question(client, "ro")
    taker = workers.start("taker", env=separate)
    await client.answer("ro", question, "yes")
    await client.wait(h, timeout=30)
    before = await last_seqs(client, "ro")
    outcome = f"call.{call_key('ro', h.turn_id, 0, 0)}.outcome"
    ids_before = [m["Nats-Msg-Id"] for m in await stored(client, topology.EVENTS_STREAM)]
    assert outcome not in ids_before

    held_w.kill()
    await taker.wait_for("step.acked", step=held["step"])
    # Only call 0's own step may be sent again (to hand it to a live worker); nothing that
    # would move the turn (a join, a model step) is. A rescue copy of another step the dead
    # worker ran (its last list may still name a step it settled since: jl_workers' lists
    # are not sent on settling) is one more delivery of a finished step: it is waited for,
    # and must change nothing.
    again = await stored(client, topology.STEPS_STREAM, before[topology.STEPS_STREAM])
    others = [m for m in again if m["Jl-Step"] != held["step"]]
    assert all(H_HOLDER_LOST in m for m in others), others
    for m in others:
        await taker.wait_for("step.acked", step=m["Jl-Step"])
    ids = [m["Nats-Msg-Id"] for m in await stored(client, topology.EVENTS_STREAM)]
    assert ids == [*ids_before, outcome], "call 0's outcome is told once, and only it"
    assert len(set(ids)) == len(ids), "no event or history entry is stored twice"
    after = await last_seqs(client, "ro")
    moved = {topology.EVENTS_STREAM, topology.STEPS_STREAM}
    assert {k: v for k, v in after.items() if k not in moved} == {
        k: v for k, v in before.items() if k not in moved
    }
