"""A stalled worker: paused past its lease while it holds a step, then resumed.

The kills of every step kind are in ``tests/test_matrix.py``; this is the stall of
ARCHITECTURE.md's failure table: the resumed worker must write, publish and ack nothing.
"""

from __future__ import annotations

from demo.vendor import Vendor
from schemas import CallState
from services.client import Client
from tests.conftest import WorkerFactory, call, script


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
