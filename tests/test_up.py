"""`jetloop up`, the README's main command: embedded server, demo agent, clean stop, resume."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.client import Client
from services.embedded import free_port
from tests.conftest import until


def start_up(tmp_path: Path, port: int) -> subprocess.Popen[bytes]:
    with open(tmp_path / "up.log", "ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "up",
                "--port",
                str(port),
                "--store-dir",
                str(tmp_path / "store"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "JETLOOP_VENDOR_DB": str(tmp_path / "vendor.sqlite"),
                "JETLOOP_GATEWAY_PORT": "0",
            },
            start_new_session=True,
        )


def wait_ready(proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        if "jetloop.up" in log.read_text():
            return
        time.sleep(0.05)
    raise TimeoutError(log.read_text())


async def connect_when_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> Client:
    await asyncio.to_thread(wait_ready, proc, log)
    return await Client.connect(url)


async def test_up_runs_the_demo_and_stops_cleanly(tmp_path: Path) -> None:
    """Up answers a demo turn; Ctrl-C stops worker and server; up again keeps the state."""
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    proc = start_up(tmp_path, port)
    try:
        c = await connect_when_ready(url, proc, tmp_path / "up.log")
        h = await c.send("demo", "tour", "create ticket printer on fire; list tickets")
        res = await c.wait(h, timeout=30)
        assert res.text is not None and "T-1" in res.text
        await c.close()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        assert rc == 0, (rc, (tmp_path / "up.log").read_text()[-3000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "up.log").read_text()
    assert "worker.stopped" in log and "nats.stopped" in log

    proc = start_up(tmp_path, port)
    try:
        c = await connect_when_ready(url, proc, tmp_path / "up.log")

        async def done() -> bool:
            # The turn may have ended just before Ctrl-C, with the session's step to move
            # on still queued: the second `up` resumes it.
            snap = await c.snapshot("tour")
            return snap is not None and snap.turns_done == 1

        await until(done)
        await c.close()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        assert rc == 0, (rc, (tmp_path / "up.log").read_text()[-3000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
