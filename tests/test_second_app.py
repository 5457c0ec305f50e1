"""The README's own pattern: ``jetloop up`` and, beside it, ``jetloop worker --app myapp:app``.

Run as a user runs them: the CLI as subprocesses in one working directory, ``myapp.py`` taken
from the README itself, no key or path exported by hand. Each agent's turns reach only the
workers that serve it; the demo worker dead-letters nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jetloop.services.client import Client, UnknownAgent
from jetloop.services.embedded import free_port
from jetloop.services.natsauth import url_as
from jetloop.streams.seal import Sealer, key_bytes
from tests.conftest import until
from tests.test_readme import blocks

ROOT = Path(__file__).resolve().parent.parent
JETLOOP = [sys.executable, "-m", "jetloop.services.cli"]


def readme_app() -> str:
    """The ``# myapp.py`` block of the user docs (docs/agents.md), as a reader would copy it."""
    return blocks()[0]["myapp.py"]


class Here:
    """A working directory with its own ports, as a user's terminal would have."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.nats_port = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("JETLOOP_")},
            "JETLOOP_EMBEDDED_PORT": str(self.nats_port),
            "JETLOOP_NATS_URL": f"nats://127.0.0.1:{self.nats_port}",
            "JETLOOP_GATEWAY_PORT": str(free_port()),
            "PYTHONPATH": str(ROOT),
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return self.env["JETLOOP_NATS_URL"]

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.dir / f"{name}.log", "ab") as out:
            p = subprocess.Popen(
                [*JETLOOP, *args],
                cwd=self.dir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    async def client(self) -> Client:
        """A client in this test's process, sealing with the key `up` made in the store."""
        key = (self.dir / ".jetloop" / "seal.key").read_text()
        url = url_as(self.url, self.dir / ".jetloop")
        return await Client.connect(url, sealer=Sealer([key_bytes(key)]))

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*JETLOOP, *args],
            cwd=self.dir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def wait_log(self, name: str, needle: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.log(name):
            assert time.monotonic() < deadline, f"{needle!r} not in {name}.log:\n{self.log(name)}"
            for p in self.procs:
                assert p.poll() is None or p.returncode == 0, self.log(name)
            time.sleep(0.05)

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def here(tmp_path: Path) -> Iterator[Here]:
    h = Here(tmp_path)
    yield h
    h.close()


@pytest.mark.timeout(180)
async def test_second_app_beside_up(here: Here) -> None:
    """Turns for `demo` (up's worker) and `support` (the README's myapp.py beside it) both
    complete; nothing is dead-lettered; a request for `support` sent while its worker is
    down waits (snapshot: waiting_for_worker) and runs when it comes back."""
    (here.dir / "myapp.py").write_text(readme_app())
    here.start("up", "up")
    here.wait_log("up", "jetloop.up")
    worker = here.start("worker", "worker", "--app", "myapp:app")
    here.wait_log("worker", "worker.started")

    demo = here.run("send", "--agent", "demo", "--session", "d1", "create ticket a; list tickets")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "completed" in demo.stdout
    support = here.run("send", "--agent", "support", "--session", "c1", "refund order 42")
    assert support.returncode == 0, support.stdout + support.stderr
    assert "done:" in support.stdout and "'refunded': 500" in support.stdout

    # The support worker goes away; a message for it waits, visibly, and is not lost.
    os.killpg(worker.pid, signal.SIGINT)
    worker.wait(30)
    async with await here.client() as c:

        async def gone() -> bool:
            return await c.agent_status("support") == "offline"

        await until(gone, timeout=10)
        h = await c.send("support", "c2", "refund order 42")
        snap = await until(lambda: c.snapshot("c2"))
        assert snap.status == "waiting_for_worker" and snap.unaccepted == 1
        here.start("worker2", "worker", "--app", "myapp:app")
        res = await c.wait(h, timeout=60)
        assert res.text is not None and res.text.startswith("done:")
        assert await c.dead_letters() == []
    assert "unknown agent" not in here.log("up")


@pytest.mark.timeout(120)
async def test_unknown_agent_is_refused_at_once(here: Here) -> None:
    """A message for an agent no worker has ever served: one line from the CLI and a 404
    problem from the client, at once, instead of a wait until the timeout."""
    here.start("up", "up")
    here.wait_log("up", "jetloop.up")
    t0 = time.monotonic()
    out = here.run("send", "--agent", "nosuchagent", "--session", "u3", "--timeout", "30", "hi")
    assert out.returncode != 0
    assert time.monotonic() - t0 < 10
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "nosuchagent" in lines[0], lines
    async with await here.client() as c:
        with pytest.raises(UnknownAgent):
            await c.send("nosuchagent", "u3", "hi")
    # A deploy may declare an app before its first worker runs: then messages wait for it.
    (here.dir / "myapp.py").write_text(readme_app())
    declared = here.run("topology", "--app", "myapp:app")
    assert declared.returncode == 0 and "support" in declared.stdout, declared.stderr
    sent = here.run("send", "--agent", "support", "--session", "u4", "--no-wait", "refund")
    assert sent.returncode == 0, sent.stderr
    snap = here.run("snapshot", "u4", "--json")
    assert '"waiting_for_worker"' in snap.stdout, snap.stdout + snap.stderr
