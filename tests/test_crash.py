"""Worker kills and stalls at named points of a step, on real processes and a real server.

Each test stops a worker on purpose at a point (``JETLOOP_FAULT_HOLD``), kills or pauses it,
lets a fresh worker take over after the lease, and judges the result from state and from
the vendor's log: the turn completes, a model step already answered is not asked again, a
write is applied once and carries the same idempotency key on every attempt.
"""

from __future__ import annotations

import json

import pytest

from demo.vendor import Vendor
from schemas import CallState, EventType
from services.client import Client
from tests.conftest import WorkerFactory, call, script


def steps_asked(counts: dict[str, int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for payload, n in counts.items():
        k = json.loads(payload)["step"]
        out[k] = out.get(k, 0) + n
    return out


async def resumed_events(client: Client, session: str) -> list[str]:
    out = []
    async for ev in client.events(session):
        if ev.type == EventType.CRASH_RESUMED:
            out.append(ev.data["step"])
        if ev.type == EventType.TURN_COMPLETED:
            return out
    return out


KILL_POINTS = [
    # point, how often model step 0 is asked, write requests seen by the vendor
    pytest.param("run_model.in_call", 1, 1, id="run_model-while-model-called"),
    pytest.param("run_model.before_commit", 2, 1, id="run_model-output-not-committed"),
    pytest.param("run_model.after_commit", 1, 1, id="run_model-after-output-committed"),
    pytest.param("call_tool.before_mark", 1, 1, id="idempotent_write-before-in-doubt-mark"),
    pytest.param("call_tool.in_tool", 1, 1, id="idempotent_write-while-tool-runs"),
    pytest.param("call_tool.before_commit", 1, 2, id="idempotent_write-applied-not-committed"),
]


@pytest.mark.parametrize(("point", "asked_step0", "write_requests"), KILL_POINTS)
async def test_worker_kill(
    client: Client,
    workers: WorkerFactory,
    vendor: Vendor,
    point: str,
    asked_step0: int,
    write_requests: int,
) -> None:
    """SIGKILL a worker at ``point``; a new worker finishes the turn, repeating nothing else."""
    victim = workers.start("victim", hold=point)
    h = await client.send("tester", "k1", script([call("write", name="x"), call("read", name="y")]))
    await victim.wait_for("fault.hold", point=point)
    victim.kill()
    workers.start("survivor")
    res = await client.wait(h, timeout=30)
    assert res.text is not None and res.text.startswith("done")

    asked = steps_asked(await vendor.payload_counts("model_call"))
    assert asked == {0: asked_step0, 1: 1}
    writes = await vendor.request_counts("write")
    assert len(writes) == 1, f"one idempotency key on every attempt, got {writes}"
    assert list(writes.values()) == [write_requests]
    assert await vendor.effect_count("write") == 1

    rec = await client.call("k1", h.turn_id, 0, 0)
    assert rec is not None and rec.state == CallState.SUCCEEDED
    if point.startswith("call_tool") and point != "call_tool.before_mark":
        assert rec.attempts == 2
    if point in ("run_model.in_call", "run_model.before_commit"):
        assert await resumed_events(client, "k1") == [f"k1.{h.turn_id}.m0"]


async def test_stalled_worker_writes_and_acks_nothing(
    client: Client, workers: WorkerFactory, vendor: Vendor, tmp_path: object
) -> None:
    """A worker paused past its lease and resumed after a takeover writes and acks nothing."""
    from pathlib import Path

    release = Path(str(tmp_path)) / "release"
    stalled = workers.start("stalled", hold="call_tool.in_tool", release_file=release)
    h = await client.send("tester", "st1", script([call("write", name="x")]))
    held = await stalled.wait_for("fault.hold", point="call_tool.in_tool")
    step = held["step"]
    stalled.pause()
    workers.start("taker")
    await client.wait(h, timeout=30)
    before = await client.call("st1", h.turn_id, 0, 0)
    assert before is not None and before.state == CallState.SUCCEEDED

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


def before_key(rec: object) -> str:
    from schemas import idempotency_key

    parts = rec.key.split(".")  # type: ignore[attr-defined]
    return idempotency_key(parts[0], parts[1], int(parts[2]), int(parts[3]))


async def test_read_killed_after_it_ran_runs_again(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """CallTool for a read, killed while it runs: the call runs again."""
    victim = workers.start("victim", hold="call_tool.before_commit")
    h = await client.send("tester", "kr", script([call("read", name="r")]))
    await victim.wait_for("fault.hold", point="call_tool.before_commit")
    victim.kill()
    workers.start("survivor")
    await client.wait(h, timeout=30)
    assert sum((await vendor.request_counts("read")).values()) == 2


@pytest.mark.parametrize(
    ("tool", "state"),
    [
        pytest.param("read", "failed", id="read"),
        pytest.param("write", "outcome_unknown", id="write"),
    ],
)
async def test_every_attempt_lost(
    client: Client, workers: WorkerFactory, tool: str, state: str
) -> None:
    """Every attempt killed while the tool runs: after the last, a read records failed and
    a write records outcome_unknown."""
    h = await client.send("tester", f"ea{tool}", script([call(tool, name="x")]))
    for n in range(3):
        victim = workers.start(f"victim{n}", hold="call_tool.before_commit")
        await victim.wait_for("fault.hold", point="call_tool.before_commit")
        victim.kill()
    workers.start("survivor")
    await client.wait(h, timeout=60)
    rec = await client.call(f"ea{tool}", h.turn_id, 0, 0)
    assert rec is not None and rec.state == state and rec.attempts == 3
    assert rec.settlement == "attempts_exhausted"


async def test_queued_step_uses_no_attempt(client: Client, workers: WorkerFactory) -> None:
    """A turn sent while no worker runs waits in the queue and runs as attempt 1."""
    h = await client.send("tester", "qd", script([call("write", name="w")]))
    workers.start()
    await client.wait(h, timeout=30)
    turn = await client.turn("qd", h.turn_id)
    rec = await client.call("qd", h.turn_id, 0, 0)
    assert turn is not None and turn.attempts == 1
    assert rec is not None and rec.attempts == 1


async def test_kill_after_approval_while_moving_on(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Killed after the approval, while its handler moves the turn on: the handler runs
    again, the recorded approval is read, not asked again."""
    victim = workers.start("victim", hold="call_tool.in_tool")
    h = await client.send("tester", "ka", script([call("guarded", name="g")]))

    async def pending() -> list[object]:
        snap = await client.snapshot("ka")
        return snap.approvals if snap else []  # type: ignore[return-value]

    from tests.conftest import until

    [ap] = await until(pending)
    await client.approve("ka", ap.approval_id, by="ivan")  # type: ignore[attr-defined]
    await victim.wait_for("fault.hold", point="call_tool.in_tool")
    victim.kill()
    workers.start("survivor")
    await client.wait(h, timeout=30)
    assert await vendor.effect_count("guarded") == 1
    approval_events = []
    async for ev in client.events("ka"):
        if ev.type in ("approval.requested", "approval.decided"):
            approval_events.append(ev.type.value)
        if ev.type == "turn.completed":
            break
    assert approval_events == ["approval.requested", "approval.decided"]
