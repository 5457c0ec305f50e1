"""The long variant of the matrix: workers killed at random moments, many rounds.

Marked ``slow``; CI runs it at a reduced count (``JETLOOP_SOAK_ROUNDS``, default 2). For a
long run: ``JETLOOP_SOAK_ROUNDS=50 .venv/bin/pytest -m slow``. ``JETLOOP_KILL_SEED`` fixes
the kill timings.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from jetloop.demo.vendor import Vendor
from jetloop.schemas import CallState
from jetloop.services.client import Client
from tests.conftest import WorkerFactory, body, call, script, until

ROUNDS = int(os.environ.get("JETLOOP_SOAK_ROUNDS", "2"))
SEED = int(os.environ.get("JETLOOP_KILL_SEED", str(random.randrange(1 << 30))))


@pytest.mark.slow
async def test_random_worker_kills(client: Client, workers: WorkerFactory, vendor: Vendor) -> None:
    """Each round kills the worker at a random moment while it has a call of a turn in flight
    (the turn mixes reads, idempotent and single-attempt writes, a slow write and a task); no
    turn is lost, no write doubles, and the kill cost the turn an attempt (it is audited)."""
    rng = random.Random(SEED)
    print(f"JETLOOP_KILL_SEED={SEED}")
    for r in range(ROUNDS):
        # The victim is the only worker up until it dies: what is in flight is its own.
        victim = workers.start(f"victim{r}")
        await victim.wait_for("worker.started")
        text = script(
            [
                call("write", name=f"w{r}"),
                call("read", name=f"r{r}"),
                call("once", name=f"o{r}"),
                call("slow", name=f"s{r}", seconds=2.0),
            ],
            [call("export", name=f"e{r}", polls=2), call("write", name=f"w{r}b")],
        )
        h = await client.send("tester", f"soak{r}", text)

        async def in_flight(session: str = f"soak{r}") -> bool:
            snap = await client.snapshot(session)
            return snap is not None and any(
                c.state in (CallState.IN_DOUBT, CallState.RUNNING) for c in snap.calls
            )

        await until(in_flight)
        await asyncio.sleep(rng.uniform(0.0, 0.8))  # the random kill moment is the point
        assert await in_flight(), "the slow write is still running at the kill"
        victim.kill()
        survivor = workers.start(f"survivor{r}")
        res = await client.wait(h, timeout=60)
        seen = body(res.text)["seen"]
        assert len(seen) == 6
        assert all(s["status"] in ("ok", "outcome_unknown") for s in seen), seen
        kinds = []
        async for e in client.events(f"soak{r}"):
            kinds.append(e.type)
            if e.type == "turn.completed":
                break
        assert "agent.run.crash_resumed" in kinds, "the kill cost no attempt: nothing was lost"
        assert survivor.alive()
        survivor.kill()  # idle now: the next round's victim must be alone again
    # Every idempotent write was made (a lost one is made again), once per key.
    for op, made in (("write", 2 * ROUNDS), ("slow", ROUNDS), ("task_start", ROUNDS)):
        assert await vendor.effect_count(op) == made, f"{op}: not every call was made"
        assert len(await vendor.request_counts(op)) == made, f"{op}: one key per call"
    once = await vendor.request_counts("once")
    assert all(n == 1 for n in once.values()), f"a single-attempt write ran twice: {once}"
