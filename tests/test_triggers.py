"""Delegation to a child session, and triggers (cron and one-off), on a real server."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from jetloop.agents import Trigger
from jetloop.consumers.delegation import child_session
from jetloop.demo.vendor import Vendor
from jetloop.schemas import call_key
from jetloop.services.client import Client
from tests.conftest import WorkerFactory, body, call, script, until


async def test_delegation_survives_the_parent_worker_dying(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A delegated task runs as one child turn; the worker dies while the child runs; the
    parent, waiting holding nothing, gets the child's answer: one child, one write."""
    victim = workers.start("victim", hold="call_tool.before_commit")
    child = script([call("write", name="child-write")], answer="child says hi")
    h = await client.send("tester", "par", script([call("delegate", agent="tester", task=child)]))
    await victim.wait_for("fault.hold", point="call_tool.before_commit")
    victim.kill()
    workers.start("survivor")
    res = await client.wait(h, timeout=60)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "ok" and seen["result"]["answer"].startswith("child says hi")
    kid = child_session(call_key("par", h.turn_id, 0, 0))
    assert seen["result"]["session"] == kid
    snap = await client.snapshot(kid)
    assert snap is not None and snap.turns_done == 1 and snap.turn is not None
    assert snap.turn.parent is not None and snap.turn.parent.turn_id == h.turn_id
    assert await vendor.effect_count("write") == 1


async def test_cron_trigger_fires_turns(client: Client, workers: WorkerFactory) -> None:
    """A cron trigger (a message schedule) starts a turn per fire, each with the trigger
    and its fire time as request id; removing it stops it."""
    workers.start()
    await client.add_trigger(
        "tester", Trigger(name="tick", schedule="@every 1s", text=script(answer="tick"))
    )

    async def two_done() -> bool:
        snap = await client.snapshot("cron-tick")
        return snap is not None and snap.turns_done >= 2

    await until(two_done, timeout=30)
    await client.remove_trigger("tester", "tick")
    ids = []
    async for ev in client.events("cron-tick"):
        if ev.type == "turn.accepted":
            ids.append(ev.data["request_id"])
        if len(ids) == 2:
            break
    assert all(i.startswith("tick@") for i in ids) and ids[0] != ids[1]


async def test_a_fire_delivered_twice_runs_once(client: Client, workers: WorkerFactory) -> None:
    """The worker dies after accepting a fire and before acking it; the redelivered fire
    names the same turn, so it runs once."""
    victim = workers.start("victim", hold="turn_request.after_accept")
    at = datetime.now(UTC) + timedelta(seconds=1)
    await client.add_trigger(
        "tester", Trigger(name="once", schedule="@every 1h", text=script(answer="hourly"))
    )
    h = await client.schedule_turn("tester", "fire", script(answer="fired"), at, "fire-1")
    await victim.wait_for("fault.hold", point="turn_request.after_accept")
    victim.kill()
    workers.start("survivor")
    res = await client.wait(h, timeout=30)
    assert res.text is not None and res.text.startswith("fired")
    again = await client.schedule_turn("tester", "fire", script(answer="fired"), at, "fire-1")
    assert again.turn_id == h.turn_id

    async def settled() -> object:
        snap = await client.snapshot("fire")
        return snap if snap is not None and snap.status == "idle" and snap.turns_done else None

    snap = await until(settled)
    assert snap.turns_done == 1 and not snap.queued
    await client.remove_trigger("tester", "once")


async def test_cancelling_a_parent_cancels_its_child(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A turn cancelled while its delegated child waits (here, for an approval) cancels the
    child turn too: the child's held call is closed cancelled and never made."""
    workers.start()
    child = script([call("guarded", name="held")], answer="never")
    h = await client.send("tester", "cp", script([call("delegate", agent="tester", task=child)]))
    kid = child_session(call_key("cp", h.turn_id, 0, 0))

    async def child_waits() -> bool:
        snap = await client.snapshot(kid)
        return snap is not None and bool(snap.approvals)

    await until(child_waits)
    await client.cancel("cp", h.turn_id, by="test")
    snap = await client.snapshot(kid)
    assert snap is not None and snap.turn is not None

    async def child_cancelled() -> bool:
        turn = await client.turn(kid, snap.turn.turn_id)  # type: ignore[union-attr]
        return turn is not None and turn.status == "cancelled"

    await until(child_cancelled)
    child_turn = await client.turn(kid, snap.turn.turn_id)
    assert child_turn is not None and "its parent turn cp/" in (child_turn.cancelled_by or "")
    held = await client.call(kid, child_turn.turn_id, 0, 0)

    async def closed() -> bool:
        rec = await client.call(kid, child_turn.turn_id, 0, 0)
        return rec is not None and rec.state == "cancelled"

    await until(closed)
    assert held is not None
    assert await vendor.effect_count("guarded") == 0
