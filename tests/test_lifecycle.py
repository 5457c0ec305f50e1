"""Worker lifecycle: graceful stop drains in-flight steps and spends no extra attempt."""

from __future__ import annotations

import asyncio

from jetloop.demo.vendor import Vendor
from jetloop.schemas import CallState
from jetloop.services.client import Client
from jetloop.streams.pauses import Pauses
from tests.conftest import WorkerFactory, call, script, until


async def test_sigterm_finishes_in_flight_steps(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """SIGTERM: the worker stops fetching, finishes the running tool within the drain
    timeout, exits 0; what follows waits in the queue and runs as attempt 1 elsewhere."""
    w = workers.start(env={"JETLOOP_DRAIN_SECONDS": "10"})
    h = await client.send("tester", "gs", script([call("slow", name="s", seconds=1.5)]))

    async def running() -> bool:
        rec = await client.call("gs", h.turn_id, 0, 0)
        return rec is not None and rec.state == CallState.IN_DOUBT

    await until(running)
    assert w.terminate(timeout=30) == 0
    assert w.find("worker.stopped")
    rec = await client.call("gs", h.turn_id, 0, 0)
    assert rec is not None and rec.state == CallState.SUCCEEDED and rec.attempts == 1
    workers.start()
    await client.wait(h, timeout=30)
    turn = await client.turn("gs", h.turn_id)
    assert turn is not None and turn.attempts == 1  # model step 1 ran once, as attempt 1
    assert await vendor.effect_count("slow") == 1


async def test_drain_timeout_hands_the_step_back(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A step still running past the drain timeout is cancelled and handed back at once;
    the next worker makes the idempotent write again with the same key: the first attempt
    reached the vendor (its reply was slow), so the vendor sees two requests, one key. The
    drained worker stopped on purpose: the resume is audited as drained, and the turn counts
    no loss (deploys cannot use up a turn's losses)."""
    w = workers.start(env={"JETLOOP_DRAIN_SECONDS": "0.5"})
    h = await client.send("tester", "dt", script([call("slow_reply", name="s", seconds=3)]))

    async def reached_vendor() -> bool:
        return sum((await vendor.request_counts("slow_reply")).values()) == 1

    await until(reached_vendor)
    rec = await client.call("dt", h.turn_id, 0, 0)
    assert rec is not None and rec.state == CallState.IN_DOUBT and rec.attempts == 1
    turn = await client.turn("dt", h.turn_id)
    assert turn is not None
    planned = turn.calls[0].idempotency_key
    assert w.terminate(timeout=30) == 0
    workers.start()
    await client.wait(h, timeout=60)
    rec = await client.call("dt", h.turn_id, 0, 0)
    assert rec is not None and rec.state == CallState.SUCCEEDED and rec.attempts == 2
    [(key, requests)] = (await vendor.request_counts("slow_reply")).items()
    assert requests == 2, "both attempts reached the vendor"
    assert key == planned  # the key planned once, with the call
    assert await vendor.effect_count("slow_reply") == 1
    assert w.find("worker.drain_ran_out", steps=1)
    resumed = [
        e.data async for e in client.events("dt", ("agent.run.crash_resumed",), follow=False)
    ]
    assert [(r["drained"], r["losses"], r["lost_worker"]) for r in resumed] == [
        (True, 0, w.worker_id)
    ], resumed
    turn = await client.turn("dt", h.turn_id)
    assert turn is not None and turn.lost == [], turn.lost


async def test_a_lost_cancel_does_not_hang_a_stop() -> None:
    """A follower whose cancel was lost (Python 3.11's ``asyncio.wait_for`` drops one that
    comes as its wait ends) is cancelled again: ``Pauses.close`` returns (a worker's stop
    hung on it under load, until its supervisor gave up 60 s later)."""
    cancels: list[int] = []

    async def deaf() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels.append(1)
                if len(cancels) == 1:
                    continue  # the first one lost, as wait_for loses it
                raise

    pauses = Pauses()
    pauses._task = asyncio.create_task(deaf())
    await asyncio.sleep(0)
    await asyncio.wait_for(pauses.close(), 5)
    assert pauses._task.done() and len(cancels) == 2
