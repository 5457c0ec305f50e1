"""`jetloop worker --processes N`: N worker processes under one parent (jetloop.services.processes).

Real processes on a real nats-server: the children serve turns under ids of their own, a
child killed with SIGKILL is started again, SIGTERM to the parent drains and stops them all,
and a wrong count is refused in one line naming the setting.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from jetloop.schemas import TurnStatus
from jetloop.services.client import Client
from jetloop.services.settings import load_settings
from jetloop.streams.registry import Registry
from tests.conftest import WorkerFactory, call, script, until
from tests.test_up import alive


async def present(client: Client) -> set[str]:
    """The worker ids in ``jl_workers``."""
    return {w.worker_id for w in await (await Registry.open(client.js)).workers()}


async def test_worker_processes_serve_restart_and_stop(
    client: Client, workers: WorkerFactory
) -> None:
    """Two children, `multi-1` and `multi-2`, both serve steps; one killed is started again
    under its id and serves on; SIGTERM stops the parent after both drained and withdrew."""
    w = workers.start("multi", processes=2)
    kids = {"multi-1", "multi-2"}
    for kid in sorted(kids):
        await w.wait_for("worker.started", worker=kid, timeout=30)

    async def both_present() -> bool:
        return kids <= await present(client)

    await until(both_present, 15)

    texts = [script([call("read", name=f"r{i}-{j}") for j in range(3)]) for i in range(8)]
    handles = [await client.send("tester", f"multi{i}", t) for i, t in enumerate(texts)]
    for h in handles:
        assert (await client.wait(h, timeout=30)).status == TurnStatus.COMPLETED
    served = {ln["worker"] for ln in w.find("step.acked")}
    assert served == kids, served

    [first] = w.find("worker.process_started", child="multi-2")
    os.kill(first["pid"], signal.SIGKILL)
    again = await w.wait_for(
        "worker.process_started", child="multi-2", where=lambda ln: ln["pid"] != first["pid"]
    )
    [failed] = w.find("component.failed", component="worker-2")
    assert "was killed by SIGKILL" in failed["error"], failed

    async def restarted() -> bool:
        return len(w.find("worker.started", worker="multi-2")) == 2

    await until(restarted, 30)
    h = await client.send("tester", "after", script([call("read", name="again")]))
    assert (await client.wait(h, timeout=30)).status == TurnStatus.COMPLETED

    assert w.terminate(timeout=30) == 0, w.tail()
    for kid in sorted(kids):
        assert w.find("worker.stopped", worker=kid), (kid, w.tail())
    stopped = {ln["child"] for ln in w.find("worker.process_stopped")}
    assert stopped == kids, w.tail()
    [survivor] = w.find("worker.process_started", child="multi-1")
    assert not alive(survivor["pid"]) and not alive(again["pid"])
    assert not kids & await present(client), "a clean stop withdraws the presence"


def run_worker(*args: str, **env: str) -> tuple[int, list[str]]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jetloop.services.cli",
            "worker",
            "--nats",
            "nats://127.0.0.1:1",
            *args,
        ],
        capture_output=True,
        env={**os.environ, **env},
        timeout=60,
    )
    return done.returncode, (done.stdout + done.stderr).decode().splitlines()


async def test_a_wrong_process_count_is_refused_naming_the_setting(tmp_path: Path) -> None:
    """0 processes, or a count that is no number, stops the command in one line naming
    the option or the variable."""
    rc, lines = await asyncio.to_thread(run_worker, "--processes", "0")
    assert rc == 2 and any("'--processes': 0 is not in the range" in ln for ln in lines), lines
    rc, lines = await asyncio.to_thread(run_worker, JETLOOP_WORKER_PROCESSES="many")
    assert rc == 1 and len(lines) == 1, lines
    assert "setting JETLOOP_WORKER_PROCESSES" in lines[0], lines


def test_a_child_reads_the_settings_its_parent_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Settings.as_env`` gives a child what the parent was given, copied in or read from
    options (`up` copies in the server's URL and password), and leaves defaults to the
    child's environment."""
    parent = load_settings(
        app="tests.apps:app", lease_seconds=3, gateway_allow_anonymous_remote=True
    ).model_copy(update={"nats_url": "nats://10.0.0.1:4333", "nats_password": SecretStr("pw")})
    env = parent.as_env(worker_processes=1, metrics_port=None)
    assert "JETLOOP_VENDOR_DB" not in env and "JETLOOP_METRICS_PORT" not in env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    child = load_settings()
    assert child.app == "tests.apps:app" and child.lease_seconds == 3
    assert child.nats_urls == parent.nats_urls and child.gateway_allow_anonymous_remote
    assert child.seal_key == parent.seal_key and child.worker_processes == 1
