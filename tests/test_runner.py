"""How a worker process runs (``jetloop.services.runner``): on uvloop unless turned off, with its
start-up objects frozen out of the collector's sight and the collector's threshold set."""

from __future__ import annotations

import asyncio
import gc

from jetloop.services.client import Client
from jetloop.services.runner import loop_factory, loop_name, run, settle_heap
from jetloop.services.settings import DEFAULT_GC_THRESHOLD
from tests.conftest import WorkerFactory, script


def test_uvloop_where_asked_and_the_standard_loop_otherwise() -> None:
    """The loop a coroutine runs on follows the setting."""
    seen: list[str] = []

    async def which() -> None:
        seen.append(loop_name())

    run(which(), use_uvloop=True)
    run(which(), use_uvloop=False)
    assert seen == ["uvloop", "asyncio"]
    assert loop_factory(False) is None


def test_settle_heap_freezes_start_up_and_sets_the_threshold() -> None:
    """What is alive at settle time is frozen; generation 0's threshold is the one given, the
    older generations keep theirs."""
    before = gc.get_threshold()
    try:
        settle_heap(1234)
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (1234, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


async def test_worker_runs_on_uvloop_unless_turned_off(
    client: Client, workers: WorkerFactory
) -> None:
    """A worker says its loop when it starts and settles its heap after; one on uvloop and
    one on the standard loop both serve turns."""
    fast = workers.start()
    plain = workers.start(env={"JETLOOP_UVLOOP": "false", "JETLOOP_GC_THRESHOLD": "700"})
    assert (await fast.wait_for("worker.started"))["loop"] == "uvloop"
    assert (await plain.wait_for("worker.started"))["loop"] == "asyncio"
    settled = await fast.wait_for("runner.heap_settled")
    assert settled["gc_threshold"] == DEFAULT_GC_THRESHOLD and settled["frozen"] > 0
    assert (await plain.wait_for("runner.heap_settled"))["gc_threshold"] == 700
    handles = [await client.send("tester", f"loop{i}", script()) for i in range(6)]
    await asyncio.gather(*(client.wait(h, timeout=30) for h in handles))
