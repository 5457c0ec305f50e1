"""`jetloop up`, the README's main command: embedded server, demo agent, clean stop, resume;
one supervised process tree (a failing part is restarted, nothing outlives `up`), and the
refusals a person meets (another `up` on the store, a port in use, a bad app) in one line."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from jetloop.services.client import Client
from jetloop.services.embedded import free_port
from jetloop.services.lifecycle import Service
from jetloop.services.natsauth import url_as
from jetloop.services.supervisor import Component, GaveUp, Supervisor
from tests.conftest import until


def up_command(tmp_path: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jetloop.services.cli",
        "up",
        "--nats-port",
        str(port),
        "--store-dir",
        str(tmp_path / "store"),
        *extra,
    ]


def up_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "JETLOOP_VENDOR_DB": str(tmp_path / "vendor.sqlite"),
        "JETLOOP_GATEWAY_PORT": "0",
        **extra,
    }


# Where each started `up` began writing its (shared, appended) log: its own lines follow.
_log_starts: dict[int, int] = {}


def start_up(
    tmp_path: Path, port: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with open(tmp_path / "up.log", "ab") as out:
        start = out.tell()
        proc = subprocess.Popen(
            up_command(tmp_path, port, *extra),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=up_env(tmp_path, **(env or {})),
            start_new_session=True,
        )
        _log_starts[proc.pid] = start
        return proc


def wait_ready(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until this `up` has said it is up (its signal handlers are in place by then)."""
    start = _log_starts.get(proc.pid, 0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        if b"jetloop.up" in log.read_bytes()[start:]:
            return
        time.sleep(0.05)
    raise TimeoutError(log.read_text())


async def connect_when_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> Client:
    await asyncio.to_thread(wait_ready, proc, log)
    return await Client.connect(url_as(url, log.parent / "store"))


def events(log: Path, event: str, **fields: str) -> list[str]:
    """The console log lines of ``event`` whose fields have the given values."""
    found = []
    for line in log.read_text().splitlines():
        words = line.split()
        if event in words and all(f"{k}={v}" in words for k, v in fields.items()):
            found.append(line)
    return found


def field(line: str, name: str) -> str:
    m = re.search(rf"\b{name}=(\S+)", line)
    assert m, (name, line)
    return m.group(1)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to read its status counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Ctrl-C and a clean exit within 30 s (else the log's tail says what it waited for)."""
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        # Killed, so no process outlives the test; the log says where the stop waited.
        proc.kill()
        proc.wait()
        text = log.read_text()
        slow = [ln for ln in text.splitlines() if "stopping_slowly" in ln]
        raise AssertionError(("no exit 30 s after Ctrl-C", slow, text[-3000:])) from None
    assert rc == 0, (rc, log.read_text()[-3000:])


@pytest.fixture
def up_procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_once(tmp_path: Path, port: int, *extra: str) -> tuple[int, list[str]]:
    """`jetloop up` that is expected to refuse: its exit code and every line it printed."""
    done = subprocess.run(
        up_command(tmp_path, port, *extra),
        capture_output=True,
        env=up_env(tmp_path),
        timeout=60,
    )
    out = (done.stdout + done.stderr).decode()
    return done.returncode, out.splitlines()


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
        stop(proc, tmp_path / "up.log")
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
        stop(proc, tmp_path / "up.log")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# --- one process tree, supervised ------------------------------------------------------------


async def test_kill_9_of_up_leaves_no_server(
    tmp_path: Path, up_procs: list[subprocess.Popen[bytes]]
) -> None:
    """`kill -9` of up takes its nats-server with it; the next up gets the store and the port."""
    port = free_port()
    log = tmp_path / "up.log"
    proc = start_up(tmp_path, port)
    up_procs.append(proc)
    await asyncio.to_thread(wait_ready, proc, log)
    server = int(field(events(log, "nats.started")[-1], "pid"))
    assert alive(server)
    try:
        proc.kill()
        proc.wait()

        async def gone() -> bool:
            return not alive(server)

        await until(gone, 10)
    finally:
        if alive(server):  # without the fix: do not leave it to the next test
            os.kill(server, signal.SIGKILL)
    again = start_up(tmp_path, port)
    up_procs.append(again)
    await asyncio.to_thread(wait_ready, again, log)
    stop(again, log)


async def test_second_up_on_the_store_refuses_in_one_line(
    tmp_path: Path, up_procs: list[subprocess.Popen[bytes]]
) -> None:
    """A second up on the same store exits non-zero with one line naming the first."""
    log = tmp_path / "up.log"
    first = start_up(tmp_path, free_port())
    up_procs.append(first)
    await asyncio.to_thread(wait_ready, first, log)
    rc, lines = await asyncio.to_thread(run_once, tmp_path, free_port())
    assert rc != 0
    assert len(lines) == 1, lines
    assert "another `jetloop up` is using store" in lines[0], lines
    assert f"(pid {first.pid})" in lines[0], lines
    assert first.poll() is None
    stop(first, log)


@pytest.mark.parametrize("flag", ["--nats-port", "--port", "--gateway-port"])
async def test_port_in_use_is_one_line(tmp_path: Path, flag: str) -> None:
    """A port in use (the embedded server's, the gateway's) is one line naming its setting."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        rc, lines = await asyncio.to_thread(run_once, tmp_path, free_port(), flag, str(busy))
    assert rc != 0
    assert len(lines) == 1, lines
    setting = (
        "JETLOOP_GATEWAY_PORT / --gateway-port"
        if flag == "--gateway-port"
        else "JETLOOP_EMBEDDED_PORT / --nats-port"
    )
    assert setting in lines[0] and str(busy) in lines[0], lines


async def test_bad_app_is_one_line(tmp_path: Path) -> None:
    """An app that does not load is one line naming JETLOOP_APP / --app, no traceback."""
    rc, lines = await asyncio.to_thread(run_once, tmp_path, free_port(), "--app", "bad.path:x")
    assert rc != 0
    assert len(lines) == 1, lines
    assert "JETLOOP_APP / --app" in lines[0] and "bad.path:x" in lines[0], lines


async def test_up_with_two_workers(tmp_path: Path, up_procs: list[subprocess.Popen[bytes]]) -> None:
    """`up --workers 2`: its own worker and a child process named after it (`<id>-2`) are
    both live; a turn runs; Ctrl-C stops the child too, cleanly."""
    port = free_port()
    log = tmp_path / "up.log"
    proc = start_up(tmp_path, port, "--workers", "2")
    up_procs.append(proc)
    c = await connect_when_ready(f"nats://127.0.0.1:{port}", proc, log)
    own = f"{socket.gethostname()}-{proc.pid}"
    try:

        async def both() -> bool:
            live = {w.worker_id for w in await (await c.registry()).workers()}
            return {own, f"{own}-2"} <= live

        await until(both, 30)
        h = await c.send("demo", "pair", "create ticket printer on fire; list tickets")
        assert "T-1" in ((await c.wait(h, timeout=30)).text or "")
    finally:
        await c.close()
    [started] = events(log, "worker.process_started", child=f"{own}-2")
    child = int(field(started, "pid"))
    assert alive(child)
    stop(proc, log)
    assert not alive(child)
    [stopped] = events(log, "worker.process_stopped", child=f"{own}-2")
    assert "exited with status 0" in stopped, stopped
    assert not events(log, "component.failed"), log.read_text()[-3000:]


async def test_nats_server_killed_is_restarted(
    tmp_path: Path, up_procs: list[subprocess.Popen[bytes]]
) -> None:
    """Up's nats-server killed: up logs it, starts it again on the same store, and serves."""
    port = free_port()
    log = tmp_path / "up.log"
    proc = start_up(tmp_path, port)
    up_procs.append(proc)
    c = await connect_when_ready(f"nats://127.0.0.1:{port}", proc, log)
    try:
        h = await c.send("demo", "before", "create ticket printer on fire")
        assert "T-1" in ((await c.wait(h, timeout=30)).text or "")
        server = int(field(events(log, "nats.started")[-1], "pid"))
        os.kill(server, signal.SIGKILL)

        async def restarted() -> bool:
            return bool(events(log, "component.failed", component="nats-server")) and (
                len(events(log, "nats.started")) == 2
            )

        await until(restarted, 30)
        assert int(field(events(log, "nats.started")[-1], "pid")) != server
        h = await c.send("demo", "after", "look up T-1")
        res = await c.wait(h, timeout=60)
        assert res.text is not None and "T-1" in res.text
    finally:
        await c.close()
    assert proc.poll() is None
    stop(proc, log)


async def test_projector_broken_at_runtime_is_restarted(
    tmp_path: Path, up_procs: list[subprocess.Popen[bytes]]
) -> None:
    """Another process holds a write lock on the read model: the projector fails (SQLite's
    busy timeout), up logs it and keeps serving turns and the gateway; once the lock is gone
    the restarted projector catches up."""
    port = free_port()
    log = tmp_path / "up.log"
    proc = start_up(tmp_path, port)
    up_procs.append(proc)
    c = await connect_when_ready(f"nats://127.0.0.1:{port}", proc, log)
    gateway = field(events(log, "jetloop.up")[-1], "gateway")
    try:
        async with aiohttp.ClientSession(gateway) as http:

            async def listed(session: str) -> bool:
                async with http.get("/v1/sessions") as resp:
                    if resp.status != 200:
                        return False
                    rows = (await resp.json())["sessions"]
                    return session in {r["session_id"] for r in rows}

            h = await c.send("demo", "before", "list tickets")
            await c.wait(h, timeout=30)
            await until(lambda: listed("before"), 30)

            db = sqlite3.connect(tmp_path / "store" / "readmodel.sqlite", isolation_level=None)
            try:
                db.execute("BEGIN IMMEDIATE")
                h = await c.send("demo", "during", "create ticket printer on fire")
                res = await c.wait(h, timeout=30)
                assert res.text is not None and "T-1" in res.text

                async def failed() -> bool:
                    return bool(events(log, "component.failed", component="projector"))

                await until(failed, 30)
                assert await listed("before")  # the gateway reads the model meanwhile
            finally:
                db.execute("ROLLBACK")
                db.close()

            async def restarted() -> bool:
                return len(events(log, "projector.started")) >= 2

            await until(restarted, 30)
            await until(lambda: listed("during"), 30)
    finally:
        await c.close()
    assert proc.poll() is None
    stop(proc, log)


# --- the supervisor itself (in process, no NATS) ---------------------------------------------


class Part(Service):
    """Starts, then fails at once (``fails``) or runs until asked to stop."""

    def __init__(self, name: str, trail: list[str], fails: BaseException | None = None) -> None:
        super().__init__()
        self.name = name
        self.trail = trail
        self.fails = fails

    async def run(self) -> None:
        self.trail.append(f"{self.name}.run")
        self._started.set()
        await asyncio.sleep(0)
        if self.fails is not None:
            raise self.fails
        await self._stopping.wait()
        self.trail.append(f"{self.name}.stopped")


def quick(stages: Sequence[Sequence[Component]], **kw: Any) -> Supervisor:
    return Supervisor(stages, backoff=0.01, max_backoff=0.04, **kw)


async def test_supervisor_restarts_a_failed_component_with_a_new_instance() -> None:
    """A component that fails is logged with its name and reason and built again; the
    others keep running; stop() stops the stages in reverse order."""
    trail: list[str] = []
    built: list[Part] = []

    def flaky() -> Part:
        part = Part("flaky", trail, RuntimeError("boom") if len(built) < 2 else None)
        built.append(part)
        return part

    sup = quick(
        [[Component("base", lambda: Part("base", trail))], [Component("flaky", flaky)]],
        window=0.001,
    )
    with capture_logs() as logs:
        task = asyncio.create_task(sup.run())
        await asyncio.wait_for(sup.wait_started(), 10)

        async def third() -> bool:
            return len(built) == 3 and sup.instance("flaky") is built[2]

        await until(third, 10)
        sup.stop_soon()
        await asyncio.wait_for(task, 10)
    assert len({id(p) for p in built}) == 3
    failed = [e for e in logs if e["event"] == "component.failed"]
    assert [(e["component"], e["error"]) for e in failed] == [
        ("flaky", "RuntimeError: boom"),
        ("flaky", "RuntimeError: boom"),
    ]
    assert trail.count("base.run") == 1
    assert trail[-2:] == ["flaky.stopped", "base.stopped"]


async def test_supervisor_gives_up_on_a_crash_loop_and_on_a_fatal_error() -> None:
    """Failing right at start over and over, or with an error a restart repeats, ends the
    supervisor with one line naming the component, after the others stopped."""
    trail: list[str] = []
    loop = quick(
        [
            [Component("base", lambda: Part("base", trail))],
            [Component("loop", lambda: Part("loop", trail, RuntimeError("no")))],
        ],
        give_up_after=3,
        window=10.0,
    )
    with pytest.raises(GaveUp, match=r"loop failed 3 times in \d+ s; last: RuntimeError: no"):
        await asyncio.wait_for(loop.run(), 10)
    assert trail.count("loop.run") == 3 and trail[-1] == "base.stopped"

    in_use = OSError(errno.EADDRINUSE, "address in use")
    fatal = quick(
        [
            [
                Component(
                    "gateway",
                    lambda: Part("gateway", trail, in_use),
                    lambda exc: "gateway port in use: set X" if exc is in_use else None,
                )
            ]
        ]
    )
    with pytest.raises(GaveUp, match=r"^gateway port in use: set X$") as info:
        await asyncio.wait_for(fatal.run(), 10)
    assert info.value.component == "gateway"


async def test_a_stop_that_hangs_says_where_it_waits() -> None:
    """A component still stopping after ``slow_stop`` is logged once with where every task
    waits (its own among them); past ``stop_timeout`` it is cancelled and the rest stop."""
    trail: list[str] = []

    class Stuck(Part):
        async def run(self) -> None:
            self._started.set()
            await self._stopping.wait()
            await asyncio.Event().wait()  # a drain that never ends

    sup = quick(
        [
            [Component("base", lambda: Part("base", trail))],
            [Component("stuck", lambda: Stuck("s", trail))],
        ],
        slow_stop=0.2,
        stop_timeout=0.6,
    )
    with capture_logs() as logs:
        task = asyncio.create_task(sup.run())
        await asyncio.wait_for(sup.wait_started(), 10)
        sup.stop_soon()
        await asyncio.wait_for(task, 10)
    slow = [e for e in logs if e["event"] == "component.stopping_slowly"]
    assert len(slow) == 1 and slow[0]["components"] == ["component:stuck"]
    stuck = [w for w in slow[0]["waiting"] if w.startswith("component:stuck: ")]
    assert len(stuck) == 1, slow[0]["waiting"]
    assert (
        " > tests/test_up.py:" in stuck[0]
        and "asyncio/locks.py:" in stuck[0]
        and stuck[0].endswith(" wait")
    ), stuck
    assert [e["component"] for e in logs if e["event"] == "component.stop_timeout"] == [
        "component:stuck"
    ]
    assert trail[-1] == "base.stopped"
