"""Upgrading jetloop under work in flight: the previous release, built from its commit, is
replaced by the current code on one store (issue 33).

The previous release (``jetloop.tooling.releases.PREVIOUS``) is built from this repository's
history and runs as its own processes. It leaves four kinds of work in flight: a call held for
approval, a message queued behind it, a timer due after the upgrade, and a turn whose tool
call is running (held at a fault point) when the old processes stop. Then the current code
takes over, two ways:

- **stop-start**: the previous release's ``jetloop up`` is stopped (SIGINT) and the current
  one started on its store. Its data moves from the server's global account to the default
  namespace's (``$G`` → ``default``) on the way.
- **rolling**: two workers of the previous release serve a server of their own; workers of
  the current release join and the old ones are stopped with SIGTERM, one by one, while the
  server runs on.

Either way the approval decided afterwards runs its tool once, the queued message runs, the
timer fires once, the running call is made once (it had not reached the vendor), and nothing
is dead-lettered.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from jetloop.demo.vendor import Vendor
from jetloop.schemas.codec import SCHEMA_VERSION
from jetloop.services.client import Client, TurnHandle
from jetloop.services.embedded import EmbeddedServer, free_port
from jetloop.services.namespaces import migrate_default
from jetloop.services.natsauth import make_users, url_as, write_config
from jetloop.services.settings import WATCH_USER, make_seal_key
from jetloop.sessions.snapshot import SessionSnapshot
from jetloop.streams.registry import this_release
from jetloop.streams.seal import Sealer, key_bytes
from jetloop.streams.topology import DEAD_STREAM
from jetloop.tooling.releases import BuiltRelease, ReleaseUnavailable, build
from jetloop.tooling.trials.harness import WorkerProcess
from tests.conftest import until
from tests.test_seal_key import Up, env_without_key

DEMO = "jetloop.demo.agent:app"
# Long enough to be due after either upgrade is over (asserted: it still waits then).
TIMER_SECONDS = 15
HOLD = "call_tool.in_tool"


def build_previous(dest: Path) -> BuiltRelease:
    """The previous release built under ``dest``; the test is skipped, saying why, in a
    shallow clone (nothing to build it from), and fails in any other case it cannot be."""
    try:
        return build(dest)
    except ReleaseUnavailable as exc:
        if exc.shallow:
            pytest.skip(str(exc))
        raise


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> BuiltRelease:
    return build_previous(tmp_path_factory.mktemp("releases"))


@dataclass
class Work:
    """What the previous release leaves in flight."""

    held: TurnHandle  # waits for a decision on ``approval_id`` (session m1)
    approval_id: str
    queued: TurnHandle  # queued behind it (m1)
    timed: TurnHandle  # waits on a timer (m2)
    running: TurnHandle  # its tool call is running when the old processes stop (m3)


async def pending_approval(c: Client, session: str) -> str | None:
    snap = await c.snapshot(session)
    pending = [a for a in snap.approvals if a.status == "pending"] if snap else []
    return pending[0].approval_id if pending else None


async def has_timer(c: Client, session: str) -> bool:
    snap = await c.snapshot(session)
    return snap is not None and bool(snap.timers)


async def done_in(c: Client, session: str) -> SessionSnapshot | None:
    """The session's snapshot once it counts a turn done."""
    snap = await c.snapshot(session)
    return snap if snap is not None and snap.turns_done >= 1 else None


async def leave_work(c: Client, release: Path, holds: Callable[[], int]) -> Work:
    """With the fault point open (``release`` exists), the waits; then, with it shut, a
    turn whose tool call stops at the point. ``holds`` counts the holds logged."""
    await asyncio.to_thread(release.touch)
    held = await c.send("demo", "m1", "close T-1")
    approval_id = await until(lambda: pending_approval(c, "m1"), timeout=60)
    queued = await c.send("demo", "m1", "create ticket queued behind the approval")
    timed = await c.send("demo", "m2", f"wait {TIMER_SECONDS} seconds")
    await until(lambda: has_timer(c, "m2"))
    await asyncio.to_thread(release.unlink)
    before = holds()
    running = await c.send("demo", "m3", "create ticket running across the upgrade")

    async def holding() -> bool:
        return holds() > before

    await until(holding, timeout=30)
    return Work(held, approval_id, queued, timed, running)


async def finish_work(c: Client, work: Work, vendor_db: Path) -> None:
    """What the current release makes of the work the previous one left."""
    assert await has_timer(c, "m2"), "the timer was due before the upgrade was over"
    res = await c.wait(work.running, timeout=30)
    assert res.text is not None and "T-" in res.text, res
    record = await c.approve("m1", work.approval_id, by="after-the-upgrade")
    assert record.status == "approved"
    res = await c.wait(work.held, timeout=30)
    assert res.text is not None and "closed" in res.text, res
    res = await c.wait(work.queued, timeout=30)
    assert res.text is not None and "T-" in res.text, res
    res = await c.wait(work.timed, timeout=TIMER_SECONDS + 30)
    assert res.status.value == "completed", res
    # The session counts a turn done in a step of its own after the turn ended
    # (jetloop.consumers.session.session_moves_on): its snapshot may lag the turn's end.
    snap = await until(lambda: done_in(c, "m2"), timeout=30)
    assert snap.turns_done == 1 and not snap.timers, snap
    info = await c.js.stream_info(DEAD_STREAM)
    assert info.state.messages == 0, info.state
    vendor = Vendor(vendor_db)
    closes = await vendor.request_counts("close_ticket")
    assert list(closes.values()) == [1], closes
    # Two tickets (the running one and the queued one), each asked for once: the running
    # call was stopped before it reached the vendor and made once by the current release.
    creates = await vendor.request_counts("create_ticket")
    assert sorted(creates.values()) == [1, 1], creates


async def both_releases_present(c: Client) -> None:
    """The presences tell the releases apart: how a newer release knows an older one still
    serves the store (0.1.0 names no release and reads schema version 1)."""

    async def present() -> dict[str, tuple[str | None, int]]:
        workers = await (await c.registry()).workers()
        return {w.worker_id: (w.release, w.reads) for w in workers}

    want = {
        "old0": (None, 1),
        "old1": (None, 1),
        "new0": (this_release(), SCHEMA_VERSION),
    }
    await until(lambda: _equal(present, want), timeout=15)


async def _equal(
    read: Callable[[], Awaitable[dict[str, tuple[str | None, int]]]],
    want: dict[str, tuple[str | None, int]],
) -> bool:
    return await read() == want


async def test_stop_start_from_the_previous_release(previous: BuiltRelease, tmp_path: Path) -> None:
    """The previous release's `jetloop up` stopped with work in flight, the current one
    started on its store."""
    release = tmp_path / "release"
    old = Up(
        tmp_path,
        release=previous,
        env={
            "JETLOOP_FAULT_HOLD": HOLD,
            "JETLOOP_FAULT_RELEASE": str(release),
            "JETLOOP_DRAIN_SECONDS": "2",
        },
    )
    old.start()
    try:
        async with await old.client() as c:
            work = await leave_work(c, release, lambda: old.log.read_text().count("fault.hold"))
        assert old.proc is not None
        old.proc.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(old.proc.wait, 60) == 0, old.log.read_text()
    finally:
        old.stop()
    jetstream = tmp_path / ".jetloop" / "nats" / "jetstream"
    assert (jetstream / "$G" / "streams").exists()  # where 0.1.0 keeps its streams

    new = Up(tmp_path)
    new.port, new.url = old.port, old.url
    new.start()
    try:
        async with await new.client() as c:
            assert os.listdir(jetstream) == ["default"]
            await finish_work(c, work, tmp_path / "vendor.sqlite")
    finally:
        new.stop()


async def test_rolling_upgrade_from_the_previous_release(
    previous: BuiltRelease, tmp_path: Path
) -> None:
    """Workers of the previous release replaced one by one by the current release's, on a
    server that runs throughout (the current release's configuration)."""
    store = tmp_path / ".jetloop"
    store.mkdir(mode=0o700)
    key = make_seal_key(store)
    users = make_users(store)
    server = EmbeddedServer(
        store, port=free_port(), config_file=write_config(store), auth=("worker", users["worker"])
    )
    server.start()
    url = url_as(server.url, store)
    release = tmp_path / "release"
    vendor_db = tmp_path / "vendor.sqlite"
    env = {
        "JETLOOP_SEAL_KEY": key,
        "JETLOOP_VENDOR_DB": str(vendor_db),
        "JETLOOP_NATS_WATCH_PASSWORD": users[WATCH_USER],
        "JETLOOP_DRAIN_SECONDS": "2",
    }

    def worker(name: str, built: BuiltRelease | None) -> WorkerProcess:
        return WorkerProcess(
            url,
            DEMO,
            tmp_path / f"{name}.log",
            worker_id=name,
            env=env,
            hold=HOLD if built else None,
            release_file=release if built else None,
            release=built,
        ).start()

    workers = [worker("old0", previous), worker("old1", previous)]
    try:
        for w in workers:
            await w.wait_for("worker.started", timeout=60)
        async with await Client.connect(url, sealer=Sealer([key_bytes(key)])) as c:
            work = await leave_work(
                c, release, lambda: sum(len(w.find("fault.hold")) for w in workers[:2])
            )
            for i, old in enumerate(workers[:2]):
                new = worker(f"new{i}", None)
                workers.append(new)
                await new.wait_for("worker.started", timeout=60)
                if i == 0:
                    await both_releases_present(c)
                assert await asyncio.to_thread(old.terminate) == 0, old.tail()
            await finish_work(c, work, vendor_db)
    finally:
        for w in workers:
            w.kill()
        server.stop()


def test_the_store_moves_once_and_a_crash_midway_is_finished() -> None:
    """The move of the default namespace's data is one rename: done once, a no-op after,
    and a crash that left an empty global-account directory beside the moved one (the
    server of a failed start made it) is tidied, not taken for a second store."""
    with tempfile.TemporaryDirectory() as d:
        store = Path(d)
        jetstream = store / "nats" / "jetstream"
        (jetstream / "$G" / "streams" / "JL_TURNS").mkdir(parents=True)
        assert migrate_default(store) is True
        assert os.listdir(jetstream) == ["default"]
        assert (jetstream / "default" / "streams" / "JL_TURNS").is_dir()
        assert migrate_default(store) is False
        (jetstream / "$G").mkdir()
        assert migrate_default(store) is False
        assert os.listdir(jetstream) == ["default"]


def test_up_refuses_a_store_with_two_homes_in_one_line(tmp_path: Path) -> None:
    """Data under both the global account and the default namespace's: `jetloop up` will
    not choose which to serve; it says so in one line, naming both, and starts nothing."""
    jetstream = tmp_path / ".jetloop" / "nats" / "jetstream"
    for account in ("$G", "default"):
        (jetstream / account / "streams" / "JL_TURNS").mkdir(parents=True)
    proc = subprocess.run(
        # (Free ports: `up` checks its ports before the store, and nothing else of this test's
        # may be refused for a port another program holds.)
        [
            *(sys.executable, "-m", "jetloop.services.cli", "up"),
            *("--port", str(free_port()), "--gateway-port", "0"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=env_without_key(),
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "both hold data" in lines[0], proc.stderr
    assert ".jetloop/nats/jetstream/$G and .jetloop/nats/jetstream/default" in lines[0]
    assert sorted(os.listdir(jetstream)) == ["$G", "default"]
