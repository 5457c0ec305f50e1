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

from demo.vendor import Vendor
from services.client import Client
from tests.conftest import WorkerFactory, body, call, script

ROUNDS = int(os.environ.get("JETLOOP_SOAK_ROUNDS", "2"))
SEED = int(os.environ.get("JETLOOP_KILL_SEED", str(random.randrange(1 << 30))))


@pytest.mark.slow
async def test_random_worker_kills(client: Client, workers: WorkerFactory, vendor: Vendor) -> None:
    """Each round kills the running worker at a random moment of a turn that mixes reads,
    idempotent and single-attempt writes and a task; no turn is lost, no write doubles."""
    rng = random.Random(SEED)
    print(f"JETLOOP_KILL_SEED={SEED}")
    survivor = workers.start("survivor")
    for r in range(ROUNDS):
        victim = workers.start(f"victim{r}")
        await victim.wait_for("worker.started")
        text = script(
            [call("write", name=f"w{r}"), call("read", name=f"r{r}"), call("once", name=f"o{r}")],
            [call("export", name=f"e{r}", polls=2), call("write", name=f"w{r}b")],
        )
        h = await client.send("tester", f"soak{r}", text)
        await asyncio.sleep(rng.uniform(0.0, 1.5))  # the random kill moment is the point
        victim.kill()
        res = await client.wait(h, timeout=60)
        seen = body(res.text)["seen"]
        assert len(seen) == 5
        assert all(s["status"] in ("ok", "outcome_unknown") for s in seen), seen
    assert survivor.alive()
    for op in ("write", "task_start"):
        effects = await vendor.effect_count(op)
        assert effects == len(await vendor.request_counts(op)), f"{op} applied twice for a key"
    once = await vendor.request_counts("once")
    assert all(n == 1 for n in once.values()), f"a single-attempt write ran twice: {once}"
