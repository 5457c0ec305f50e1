"""How fast a dead worker's step moves on, and that a live worker's step never does.

A dead worker's connection closes at once; the server says so to the system account's
watch user, and another worker hands on what the dead one held (``jetloop.services.rescue``) — well
before the lease. A worker restarted after the death does the same at start. A step whose
holder still lives is never taken over, whatever delivery of it another worker gets: a copy
of its message, a copy claiming the holder is dead, a redelivery after a server restart
(``jetloop.consumers.liveness``). The leases here are long (30 s) so that a takeover by the lease
cannot pass for either.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from jetloop.demo.vendor import Vendor
from jetloop.schemas import CallState, EventType
from jetloop.services.client import Client, TurnHandle
from jetloop.services.embedded import EmbeddedServer
from jetloop.streams import topology
from jetloop.streams.holds import LIST_SPACING, read_holds
from tests.conftest import WorkerFactory, body, call, script, until
from tests.paused import paused

LONG_LEASE = {"JETLOOP_LEASE_SECONDS": "30"}


async def resumed_events(client: Client, session: str) -> list[object]:
    """The session's resume audits, read up to the end of its (one, finished) turn."""
    out: list[object] = []
    async for ev in client.events(session):
        if ev.type == EventType.CRASH_RESUMED:
            out.append(ev)
        if ev.type in (EventType.TURN_COMPLETED, EventType.TURN_FAILED):
            return out
    return out


async def made_once_by_its_holder(
    client: Client, vendor: Vendor, h: TurnHandle, session: str
) -> None:
    """The released single-attempt write ends ``ok``, the vendor saw it once, and no loss was
    charged or resumed: its live holder kept it."""
    res = await client.wait(h, timeout=30)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "ok"
    assert await vendor.effect_count("once") == 1
    turn = await client.turn(session, h.turn_id)
    assert turn is not None and turn.lost == []
    assert await resumed_events(client, session) == []


async def test_dead_workers_step_moves_on_at_once(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """SIGKILL of the worker holding a single-attempt write: another worker settles it
    (outcome_unknown, never sent again) within seconds, not at the 30 s lease."""
    victim = workers.start("victim", hold="call_tool.in_tool", env=LONG_LEASE)
    h = await client.send("tester", "fast", script([call("once", name="x")]))
    await victim.wait_for("fault.hold", point="call_tool.in_tool")
    taker = workers.start("taker", env=LONG_LEASE)
    await taker.wait_for("rescue.watching")
    killed = time.monotonic()
    victim.kill()
    res = await client.wait(h, timeout=20)
    took = time.monotonic() - killed
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "outcome_unknown"
    assert await vendor.effect_count("once") == 0
    assert took < 10, f"the step waited {took:.1f}s: the lease, not the rescue, moved it"
    handed = await taker.wait_for("rescue.handed_on")
    assert handed["messages"] >= 1
    await taker.wait_for("step.holder_gone", holder="victim")


async def test_restarted_worker_hands_on_what_its_predecessor_held(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Without the watch user (a wrong password here), a worker started after a death sweeps
    the dead process's list at start: the step moves on at once, not at the lease (the list
    names the server instance the new worker is linked to, so it is judged without waiting
    for the new link to settle). (Killed
    once its list has gone out: a step fetched within ``LIST_SPACING`` of the list before
    waits for the next list, and a kill before that leaves it to its lease.)"""
    victim = workers.start("victim", hold="call_tool.in_tool", env=LONG_LEASE)
    h = await client.send("tester", "sweep", script([call("write", name="w")]))
    await victim.wait_for("fault.hold", point="call_tool.in_tool")
    await asyncio.sleep(LIST_SPACING * 4)
    victim.kill()
    started = time.monotonic()
    successor = workers.start(
        "successor", env={**LONG_LEASE, "JETLOOP_NATS_WATCH_PASSWORD": "wrong"}
    )
    res = await client.wait(h, timeout=25)
    assert time.monotonic() - started < 15
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "ok"  # an idempotent write: made again with the same key
    assert await vendor.effect_count("write") == 1
    rescued = await successor.wait_for("worker.swept")
    assert rescued["messages"] >= 1
    # Its list named the server instance the successor is linked to: judged at once, without
    # waiting for the successor's link to settle.
    await successor.wait_for("rescue.swept", same_instance=True)
    await successor.wait_for("worker.watch_failed")  # and it keeps running without it


# A worker that hears no disconnect advisories: a server without the system account's watch
# user (a wrong password here, refused).
NO_WATCH = {**LONG_LEASE, "JETLOOP_NATS_WATCH_PASSWORD": "wrong"}


async def test_without_the_watch_user_a_live_worker_finds_the_dead_one(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Without the system account's advisories, SIGKILL of the worker holding a
    single-attempt write is found by a live worker's probe (the server the dead one's list
    was sent to no longer knows its subscription): the step moves on in about a second, not
    at the 30 s lease, and is settled (outcome_unknown, never sent again)."""
    victim = workers.start("victim", hold="call_tool.in_tool", env=NO_WATCH)
    h = await client.send("tester", "probed", script([call("once", name="x")]))
    await victim.wait_for("fault.hold", point="call_tool.in_tool")
    taker = workers.start("taker", env=NO_WATCH)
    await taker.wait_for("worker.watch_failed")
    await asyncio.sleep(LIST_SPACING * 4)  # the victim's list has gone out
    killed = time.monotonic()
    victim.kill()
    res = await client.wait(h, timeout=25)
    took = time.monotonic() - killed
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "outcome_unknown"
    assert await vendor.effect_count("once") == 0
    assert took < 10, f"the step waited {took:.1f}s: the lease, not the probe, moved it"
    handed = await taker.wait_for("rescue.handed_on", reason="probe")
    assert handed["messages"] >= 1
    await taker.wait_for("step.holder_gone", holder="victim")


async def test_without_the_watch_user_a_stalled_holder_is_not_probed_away(
    client: Client, workers: WorkerFactory, vendor: Vendor, tmp_path: Path
) -> None:
    """A holder stopped by SIGSTOP keeps its connection and its subscription: the probe's
    asks time out, which proves nothing, so nothing is handed on; resumed, the holder makes
    its write once."""
    release = tmp_path / "release"
    holder = workers.start("holder", hold="call_tool.in_tool", release_file=release, env=NO_WATCH)
    h = await client.send("tester", "stalled", script([call("once", name="x")]))
    await holder.wait_for("fault.hold", point="call_tool.in_tool")
    other = workers.start("other", env=NO_WATCH)
    await other.wait_for("worker.watch_failed")
    await asyncio.sleep(LIST_SPACING * 4)
    with paused(holder.pid):
        # Ten of the probe's looks, and its patience, several times over.
        await asyncio.sleep(3.0)
    assert other.find("rescue.handed_on") == [], "the probe handed on a live holder's step"
    release.touch()
    await made_once_by_its_holder(client, vendor, h, "stalled")


async def test_live_holder_is_never_taken_over(
    client: Client, workers: WorkerFactory, vendor: Vendor, tmp_path: Path
) -> None:
    """Two more deliveries of a step a live worker holds (a plain copy, and one whose header
    says the holder is dead) wait for it; the write is made once and no loss is charged."""
    release = tmp_path / "release"
    holder = workers.start("holder", hold="call_tool.in_tool", release_file=release, env=LONG_LEASE)
    h = await client.send("tester", "live", script([call("once", name="x")]))
    await holder.wait_for("fault.hold", point="call_tool.in_tool")
    other = workers.start("other", env=LONG_LEASE)
    await other.wait_for("worker.started")
    rec = await client.call("live", h.turn_id, 0, 0)
    assert rec is not None and rec.state == CallState.IN_DOUBT and rec.attempt is not None
    inc = rec.attempt.incarnation

    js = client.nc.jetstream()
    holds = await read_holds(js, inc)
    steps = [(s, q) for s, q in holds if s == topology.STEPS_STREAM]
    assert steps, f"the holder listed no step: {holds}"
    for stream, seq in steps:
        raw = await js.get_msg(stream, seq)
        assert raw.subject is not None and raw.data is not None
        for n, extra in enumerate(({}, {"Jl-Holder-Lost": inc})):
            hdrs = {k: v for k, v in (raw.headers or {}).items() if not k.startswith("Nats-")}
            hdrs.update({"Nats-Msg-Id": f"copy{n}.{seq}", **extra})
            await js.publish(raw.subject, raw.data, headers=hdrs)

    async def both_waited() -> bool:
        # Either worker may get a copy: the other one waits for the live holder, the holder
        # itself knows it still runs the step. A copy that settled the call instead fails
        # at once (the holder is held inside the tool: nothing else may record the call).
        settled = [ln for w in (holder, other) for ln in w.find("call.recorded")]
        assert settled == [], f"a copy settled the call its live holder runs: {settled}"
        waited = {
            ln["seq"]
            for w in (holder, other)
            for ln in w.lines()
            if ln["event"] == "step.retry_later"
            and ("is alive" in str(ln.get("reason")) or "still runs" in str(ln.get("reason")))
        }
        return len(waited) >= 2

    await until(both_waited, timeout=15)
    release.touch()
    await made_once_by_its_holder(client, vendor, h, "live")


async def test_server_restart_does_not_take_over_a_live_holder(
    client: Client,
    workers: WorkerFactory,
    vendor: Vendor,
    nats_ready: EmbeddedServer,
    tmp_path: Path,
) -> None:
    """nats-server SIGKILLed and restarted on its store while a single-attempt write runs on
    a live worker, with another worker ready to take steps: the write is made once, ends
    ``ok``, and no loss is charged."""
    release = tmp_path / "release"
    holder = workers.start("holder", hold="call_tool.in_tool", release_file=release, env=LONG_LEASE)
    h = await client.send("tester", "restart", script([call("once", name="x")]))
    await holder.wait_for("fault.hold", point="call_tool.in_tool")
    other = workers.start("other", env=LONG_LEASE)
    await other.wait_for("worker.started")
    nats_ready.kill()
    await asyncio.sleep(0.3)
    nats_ready.start()
    await nats_ready.wait_jetstream()
    await holder.wait_for("nats.reconnected")
    await other.wait_for("nats.reconnected")
    await asyncio.sleep(1.0)  # time for any redelivery to reach the other worker
    release.touch()
    await made_once_by_its_holder(client, vendor, h, "restart")


async def test_a_holder_past_its_lease_but_beating_is_live(
    client: Client, workers: WorkerFactory, vendor: Vendor, tmp_path: Path
) -> None:
    """A single-attempt write that runs longer than the lease (2 s here): its heartbeats
    rewrite the claim, so another delivery of the step well past the claim's first write
    still finds the holder live and waits. The write is made once; no loss is charged."""
    release = tmp_path / "release"
    # One tool slot, busy with the held call: the copy can only go to the other worker.
    holder = workers.start(
        "holder",
        hold="call_tool.in_tool",
        release_file=release,
        env={"JETLOOP_TOOL_CONCURRENCY": "1"},
    )
    h = await client.send("tester", "beat", script([call("once", name="x")]))
    await holder.wait_for("fault.hold", point="call_tool.in_tool")
    other = workers.start("other")
    await other.wait_for("worker.started")
    await asyncio.sleep(3.0)  # past the 2 s lease: only the heartbeats keep the claim fresh
    rec = await client.call("beat", h.turn_id, 0, 0)
    assert rec is not None and rec.attempt is not None
    js = client.nc.jetstream()
    holds = await read_holds(js, rec.attempt.incarnation)
    [(stream, seq)] = [(s, q) for s, q in holds if s == topology.STEPS_STREAM]
    raw = await js.get_msg(stream, seq)
    assert raw.subject is not None and raw.data is not None
    hdrs = {k: v for k, v in (raw.headers or {}).items() if not k.startswith("Nats-")}
    await js.publish(raw.subject, raw.data, headers={**hdrs, "Nats-Msg-Id": f"copy.{seq}"})

    async def waited() -> bool:
        settled = other.find("call.recorded") + holder.find("call.recorded")
        assert settled == [], f"a copy settled the call its live holder runs: {settled}"
        return any(
            ln["event"] == "step.retry_later" and "is alive" in str(ln.get("reason"))
            for ln in other.lines()
        )

    await until(waited, timeout=10)
    release.touch()
    await made_once_by_its_holder(client, vendor, h, "beat")


async def test_a_worker_stopped_across_a_server_restart_keeps_its_step(
    client: Client,
    workers: WorkerFactory,
    vendor: Vendor,
    nats_ready: EmbeddedServer,
    tmp_path: Path,
) -> None:
    """A live worker runs a single-attempt write; it is stopped (SIGSTOP, for less than its
    lease) while nats-server is SIGKILLed and restarted, and a new worker starts meanwhile —
    as after a deploy, or on a busy machine where the holder is the last to connect again.
    The new worker's look at start, and the running worker's redelivery, find the holder
    silent and not connected; neither takes its step. Once resumed, it finishes: the write is
    made once, ends ``ok``, nothing is settled ``outcome_unknown``, no loss is charged."""
    lease = 10.0
    env = {"JETLOOP_LEASE_SECONDS": str(lease)}
    release = tmp_path / "release"
    holder = workers.start("holder", hold="call_tool.in_tool", release_file=release, env=env)
    h = await client.send("tester", "stopped", script([call("once", name="x")]))
    await holder.wait_for("fault.hold", point="call_tool.in_tool")
    other = workers.start("other", env=env)
    await other.wait_for("worker.started")
    stopped = time.monotonic()
    with paused(holder.pid):
        nats_ready.kill()
        await asyncio.sleep(0.3)
        nats_ready.start()
        await nats_ready.wait_jetstream()
        fresh = workers.start("fresh", env=env)
        await fresh.wait_for("worker.started", timeout=60)
        await asyncio.sleep(0.5)  # the fresh worker looks around while the holder is away
        stopped_for = time.monotonic() - stopped
    assert stopped_for < lease, f"stopped {stopped_for:.1f}s: past the lease, a takeover is due"
    await holder.wait_for("nats.reconnected")
    # The fresh worker's look at start is done (with the holder back) before the write ends.
    swept = await fresh.wait_for("worker.swept", timeout=30)
    release.touch()
    await made_once_by_its_holder(client, vendor, h, "stopped")
    assert swept["messages"] == 0, "the fresh worker handed on a live worker's step"
