"""A process whose clock is off cannot break sessions (``jetloop.streams.clock``).

A seal binds the writer's clock time, and readers compare it with the server's stored time.
A worker whose clock is off (here: really, under libfaketime) measures it against the
server's at start and then periodically; while it is off it seals nothing and serves no
steps and no control requests, says so in one line with the offset, and shows it as a
metric; a healthy worker beside it serves everything. A record refused for its time says
the likely cause (the clock) and both times.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from jetloop.schemas import SessionRecord
from jetloop.schemas.errors import TurnFailed
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.streams.clock import ClockGuard, ClockOff, Reading, measure, server_time
from jetloop.streams.connection import connect
from jetloop.streams.seal import SEAL_VERSION, Sealer, canonical, key_bytes
from jetloop.streams.state import StateStore, Versioned, session_key
from tests.conftest import SEAL_KEY, WorkerFactory, call, script, until

LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
needs_faketime = pytest.mark.skipif(
    LIBFAKETIME is None or shutil.which("faketime") is None,
    reason="libfaketime is not installed (Debian package faketime; .ci/run installs it)",
)


def skewed(shift: str | Path) -> dict[str, str]:
    """The environment of a process whose wall clock is off: ``shift`` (``+90s``), or a file
    holding it (re-read every second, so a test can set the clock right). The monotonic
    clock is left alone: the event loop's timers keep working."""
    env = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    if isinstance(shift, Path):
        env |= {"FAKETIME_TIMESTAMP_FILE": str(shift), "FAKETIME_CACHE_DURATION": "1"}
    else:
        env["FAKETIME"] = shift
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("jetloop_clock_"):
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


def test_a_record_refused_for_its_time_names_the_clock_and_both_times() -> None:
    """A record sealed 92 s after the server stored it can only come from a clock ahead;
    one sealed 92 s before is a clock behind or a replay: both say so, with both times."""
    now = 1_796_000_000.0
    data = {"status": "idle"}
    ahead = Sealer([key_bytes(SEAL_KEY)], clock=lambda: now + 92)
    why = ahead.verify("session.s1", {**data, "seal": ahead.seal("session.s1", data)}, now)
    assert why is not None
    assert "clock is likely 92 s ahead of the NATS server's" in why
    assert "sealed at 2026-11-30T" in why and "stored at 2026-11-30T" in why
    assert "92 s apart" in why and "not an older state put back" in why
    behind = Sealer([key_bytes(SEAL_KEY)], clock=lambda: now - 92)
    why = behind.verify("session.s1", {**data, "seal": behind.seal("session.s1", data)}, now)
    assert why is not None
    assert "clock is likely 92 s behind" in why and "an older state put back" in why


def test_a_sealer_refuses_while_its_clock_is_off() -> None:
    """Measured past half the tolerance (the error counts against it), the sealer raises
    ``ClockOff`` naming the offset instead of sealing; set right, it seals again; and a
    wall clock that jumps after the measurement is refused at once (the monotonic clock
    carries the measured offset forward)."""
    sealer = Sealer([key_bytes(SEAL_KEY)], tolerance=30)
    sealer.guard = ClockGuard(30)
    now, mono = time.time(), time.monotonic()
    sealer.guard.reading = Reading(offset=14.8, error=0.5, wall=now, mono=mono)
    with pytest.raises(ClockOff, match=r"14\.8 s ahead of the NATS server's"):
        sealer.seal_packed("session.s1", canonical({"a": 1}))
    sealer.guard.reading = Reading(offset=-3.0, error=0.5, wall=now, mono=mono)
    assert sealer.seal_packed("session.s1", canonical({"a": 1})).startswith(SEAL_VERSION)
    jumped = Reading(offset=0.0, error=0.5, wall=now - 20, mono=mono)  # 20 s since, by the wall
    sealer.guard.reading = jumped
    with pytest.raises(ClockOff, match=r"2\d\.\d s ahead"):
        sealer.seal_packed("session.s1", canonical({"a": 1}))


async def test_a_session_sealed_by_a_wrong_clock_fails_its_next_turn_with_the_reason(
    nats_ready: EmbeddedServer, workers: WorkerFactory, client: Client
) -> None:
    """A session record sealed by a clock 90 s ahead (written before its writer found out)
    does not wedge the session's callers: the next turn ends failed naming the clock and
    both times, the caller's wait returns, the turn's record says the same; once an
    operator deletes the record, the session takes turns again."""
    workers.start("healthy")
    await client.wait(await client.send("tester", "wedge", script(answer="first")), timeout=20)
    nc = await connect([nats_ready.url], "test-clock-ahead")
    try:
        ahead = await StateStore.open(
            nc, Sealer([key_bytes(SEAL_KEY)], clock=lambda: time.time() + 90)
        )

        async def moved_on() -> Versioned[SessionRecord] | None:
            # The turn's end is told before its step moves the session on: the session's
            # record is read once it has (written over before, the write would lose its CAS).
            found = await ahead.session("wedge")
            return found if found is not None and found.value.active is None else None

        cur = await until(moved_on, timeout=10)
        await ahead.write(session_key("wedge"), cur.value, cur.revision)
        h = await client.send("tester", "wedge", script(answer="second"))
        with pytest.raises(TurnFailed) as failed:
            await client.wait(h, timeout=20)
        error = failed.value.turn.error or ""
        assert "writer's clock is likely 9" in error and "ahead of the NATS server's" in error
        assert "sealed at" in error and "stored at" in error
        record = await client.turn("wedge", h.turn_id)
        assert record is not None and record.status == "failed" and record.error == error
        await (await nc.jetstream().key_value("jl_state")).delete(session_key("wedge"))
        again = await client.send("tester", "wedge", script(answer="third"))
        res = await client.wait(again, timeout=20)
        assert res.text is not None and res.text.startswith("third")
    finally:
        await nc.close()


async def test_the_offset_is_measured_from_the_servers_own_time(
    nats_ready: EmbeddedServer,
) -> None:
    """The stream info's ``ts`` is the server's time: this process's clock and the server's
    are the same machine's, so the offset is within the measurement's error, and that
    error is half a round trip (small)."""
    assert server_time("2026-12-02T08:08:06.013254797Z") == pytest.approx(1796198886.013254797)
    nc = await connect([nats_ready.url], "test-clock")
    try:
        r = await measure(nc)
    finally:
        await nc.close()
    assert r.error < 0.5
    assert abs(r.offset) <= r.error + 0.01
    assert abs(r.server_time - time.time()) < 1


@needs_faketime
async def test_a_worker_90s_ahead_serves_nothing_and_breaks_no_session(
    nats_ready: EmbeddedServer, workers: WorkerFactory, client: Client
) -> None:
    """Issue 29, finding 3: a worker 90 s ahead beside a healthy one. Every turn completes
    (the healthy one serves it), the approvals asked over the control API (no seal key)
    are answered by the healthy one, the skewed one says "clock" with its offset and
    shows it as a metric, handles no step, and every session takes another turn after."""
    port = free_port()
    bad = workers.start("skewed", env={**skewed("+90s"), "JETLOOP_METRICS_PORT": str(port)})
    off = await bad.wait_for("worker.clock_off", timeout=20)
    assert 85 < off["offset"] < 95, off
    assert "clock is 9" in off["error"] and "ahead of the NATS server's" in off["error"]
    await bad.wait_for("worker.started")
    good = workers.start("healthy")
    await good.wait_for("worker.started")

    sessions = [f"ck{i}" for i in range(4)]
    handles = [
        await client.send("tester", sid, script([call("guarded", name=sid)])) for sid in sessions
    ]
    # Decided over jl.control (a client without the key): whichever worker answers seals.
    keyless = Client(client.nc, verify=False)
    for sid in sessions:

        async def held(sid: str = sid) -> str | None:
            snap = await client.snapshot(sid)
            pending = [a for a in snap.approvals if a.status == "pending"] if snap else []
            return pending[0].approval_id if pending else None

        await keyless.approve(sid, await until(held, timeout=20), by="alice")
    for h in handles:
        await client.wait(h, timeout=20)
    again = [await client.send("tester", sid, script(answer="again")) for sid in sessions]
    for h in again:
        res = await client.wait(h, timeout=20)
        assert res.text is not None and res.text.startswith("again"), res

    assert not bad.find("step.acked") and not bad.find("control.clock_off"), bad.tail()
    assert len(bad.find("worker.clock_off")) == 1, "said once, not in a loop"
    metrics = await asyncio.to_thread(scrape, port)
    assert 85 < metrics["jetloop_clock_offset_seconds"] < 95, metrics
    assert metrics["jetloop_clock_off"] == 1.0, metrics


@needs_faketime
async def test_a_worker_serves_again_once_its_clock_is_back(
    nats_ready: EmbeddedServer, workers: WorkerFactory, client: Client, tmp_path: Path
) -> None:
    """The only worker, started 90 s ahead, serves nothing; set right, it says so once and
    serves the waiting turn; put off again mid-run, it stops again (measured periodically)."""
    shift = tmp_path / "shift"
    shift.write_text("+90s\n")
    w = workers.start("drifting", env={**skewed(shift), "JETLOOP_CLOCK_CHECK_SECONDS": "0.5"})
    await w.wait_for("worker.clock_off", timeout=20)
    h = await client.send("tester", "back", script(answer="served"))
    with pytest.raises(TimeoutError):
        await client.wait(h, timeout=1.5)
    shift.write_text("+0s\n")
    back = await w.wait_for("worker.clock_back", timeout=20)
    assert abs(back["offset"]) < 5, back
    res = await client.wait(h, timeout=20)
    assert res.text is not None and res.text.startswith("served")
    shift.write_text("+90s\n")

    async def off_again() -> bool:
        return len(w.find("worker.clock_off")) == 2

    await until(off_again, timeout=20)


@needs_faketime
async def test_a_step_in_flight_when_the_clock_jumps_writes_nothing(
    workers: WorkerFactory, client: Client, tmp_path: Path
) -> None:
    """A worker whose clock jumps 90 s ahead while it runs a tool seals nothing more: the
    step is handed back (no failure counted), and a healthy worker finishes the turn."""
    shift, release = tmp_path / "shift", tmp_path / "release"
    shift.write_text("+0s\n")
    env = {**skewed(shift), "JETLOOP_CLOCK_CHECK_SECONDS": "0.5"}
    w = workers.start("jumping", hold="call_tool.in_tool", release_file=release, env=env)
    h = await client.send("tester", "jump", script([call("write", name="j")]))
    await w.wait_for("fault.hold", point="call_tool.in_tool")
    shift.write_text("+90s\n")
    await w.wait_for("worker.clock_off", timeout=20)
    release.touch()
    await w.wait_for("fault.released")
    workers.start("healthy")
    res = await client.wait(h, timeout=30)
    assert res.text is not None and res.text.startswith("done")
    after = w.lines()
    after = after[after.index(w.find("worker.clock_off")[0]) :]
    assert not [ln for ln in after if ln["event"] in ("step.acked", "call.recorded")], after
    assert [ln for ln in after if ln["event"] in ("step.handed_back", "step.taken_over")], after


@needs_faketime
async def test_the_cli_with_the_seal_key_refuses_to_decide_with_its_clock_off(
    nats_ready: EmbeddedServer, workers: WorkerFactory, client: Client
) -> None:
    """A CLI holding the seal key writes (seals) a decision itself: with its clock 90 s
    ahead it refuses in one line naming the clock, writes nothing, and a CLI with a right
    clock then decides."""
    workers.start("healthy")
    h = await client.send("tester", "cli1", script([call("guarded", name="c")]))

    async def held() -> str | None:
        snap = await client.snapshot("cli1")
        pending = [a for a in snap.approvals if a.status == "pending"] if snap else []
        return pending[0].approval_id if pending else None

    aid = await until(held, timeout=20)

    def approve(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        args = ["approve", "cli1", aid, "--by", "alice", "--nats", nats_ready.url]
        return subprocess.run(
            [sys.executable, "-m", "jetloop.services.cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )

    out = await asyncio.to_thread(approve, skewed("+90s"))
    assert out.returncode == 1, out
    assert "clock is 9" in out.stderr and "ahead of the NATS server's" in out.stderr, out.stderr
    assert await held() == aid, "nothing was decided"
    out = await asyncio.to_thread(approve, {})
    assert out.returncode == 0, out.stderr
    await client.wait(h, timeout=20)


@needs_faketime
async def test_a_gateway_with_its_clock_off_answers_503_and_decides_nothing(
    nats_ready: EmbeddedServer, workers: WorkerFactory, client: Client, tmp_path: Path
) -> None:
    """The gateway holds the seal key and writes a decision itself: with its clock 90 s ahead
    an approval gets 503 "clock off" (problem+json, Retry-After) naming the clock, and
    nothing is decided; the approval then goes through a gateway whose clock is right."""
    workers.start("healthy")
    h = await client.send("tester", "gw1", script([call("guarded", name="g")]))

    async def held() -> str | None:
        snap = await client.snapshot("gw1")
        pending = [a for a in snap.approvals if a.status == "pending"] if snap else []
        return pending[0].approval_id if pending else None

    aid = await until(held, timeout=20)
    token = "tok-clock-0123456789abcdef"

    async def approve_through(env: dict[str, str]) -> tuple[int, dict[str, str], str]:
        port = free_port()
        args = ["gateway", "--nats", nats_ready.url, "--port", str(port)]
        full = {
            **os.environ,
            "JETLOOP_GATEWAY_TOKENS": f'{{"{token}": {{"name": "alice", "scopes": ["approve"]}}}}',
            "JETLOOP_LOG_FORMAT": "console",
            **env,
        }
        log = tmp_path / f"gateway-{port}.log"
        proc = spawn([sys.executable, "-m", "jetloop.services.cli", *args], full, log)
        try:
            url = f"http://127.0.0.1:{port}/v1/sessions/gw1/approvals/{aid}"

            def post() -> tuple[int, dict[str, str], str] | None:
                req = urllib.request.Request(
                    url,
                    data=b'{"approve": true}',
                    method="POST",
                    headers={
                        "Authorization": f"Bearer {token}",
                        "Content-Type": "application/json",
                    },
                )
                try:
                    with urllib.request.urlopen(req, timeout=10) as r:
                        return r.status, dict(r.headers), r.read().decode()
                except urllib.error.HTTPError as e:
                    return e.code, dict(e.headers), e.read().decode()
                except OSError:
                    assert proc.poll() is None, log.read_text()
                    return None

            async def answered() -> tuple[int, dict[str, str], str] | None:
                return await asyncio.to_thread(post)

            return await until(answered, timeout=30)
        finally:
            proc.terminate()
            proc.wait(10)

    status, headers, body = await approve_through(skewed("+90s"))
    assert status == 503, body
    assert headers.get("Content-Type", "").startswith("application/problem+json")
    assert "Retry-After" in headers
    assert "clock off" in body and "ahead of the NATS server's" in body, body
    assert await held() == aid, "nothing was decided"
    status, _, body = await approve_through({})
    assert status == 200, body
    await client.wait(h, timeout=20)
