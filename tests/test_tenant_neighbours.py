"""Tenants on one `jetloop up` do not slow each other down (issue 51).

Fake disconnects: a namespace's client that opens and closes connections named like
workers' (``jetloop-worker-<id>#<incarnation>``) sets no worker rescuing — not its own
namespace's, not another's — and the other namespace's turns keep their pace. A close of a
namespace's own worker user is still heard and handed on.

Turn rate: a worker given ``JETLOOP_TURN_RATE`` takes in no more turn requests a second than
that; the rest wait in ``JL_TURNS`` and are all served, none lost.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import statistics
import sys
import time
from pathlib import Path

import nats
import pytest

from jetloop.schemas import EventType
from jetloop.services import namespaces
from jetloop.services.client import Client
from jetloop.services.rescue import connection_name
from tests.conftest import WorkerFactory, script, until
from tests.test_bus_attack import up as up  # the fixture: `jetloop up` with a gateway
from tests.test_namespaces import cli, served, url_of
from tests.test_seal_key import Up

# Opens and closes connections named like workers', at a bounded pace and count, printing
# each name's incarnation; a process of its own, so the test's loop measures only turns.
STORM = """
import asyncio, sys, time, nats
url, count, rate, tag = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
async def quiet(exc):
    pass
async def main():
    began = time.monotonic()
    for i in range(count):
        nc = await nats.connect(url, name=f"jetloop-worker-x#{tag}{i}", error_cb=quiet,
                                max_reconnect_attempts=0)
        await nc.close()
        wait = began + (i + 1) / rate - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
    print(count, flush=True)
asyncio.run(main())
"""
STORM_CONNECTIONS = 1500
STORM_RATE = 100.0  # connections a second: 15 s, longer than the turns measured during it
TURNS = 20


async def turn_ms(client: Client, session: str, n: int) -> list[float]:
    """``n`` sequential turns of the demo agent in ``session``, each from send to answer."""
    out = []
    for i in range(n):
        began = time.perf_counter()
        h = await client.send("demo", session, f"hello {i}")
        assert (await client.wait(h, timeout=60)).text is not None
        out.append((time.perf_counter() - began) * 1000)
    return out


def rescue_lines(log: Path) -> list[str]:
    return [ln for ln in log.read_text(errors="replace").splitlines() if "rescue." in ln]


async def test_fake_worker_disconnects_of_a_neighbour_set_off_no_rescue(
    up: Up, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b's client opening and closing connections named like workers' makes no worker of
    any namespace rescue anything, and a's turns during that storm stay within twice their
    quiet median; a close of a's own worker user is still handed on."""
    monkeypatch.setenv("JETLOOP_STORE_DIR", str(tmp_path / "elsewhere" / ".jetloop"))
    monkeypatch.delenv("JETLOOP_SEAL_KEY", raising=False)
    store = up.cwd / ".jetloop"
    for ns in ("a", "b"):
        out = await asyncio.to_thread(cli, up.cwd, "namespace", "create", ns)
        assert out.returncode == 0, out.stderr
    a = namespaces.read_credential(store, "a")
    b = namespaces.read_credential(store, "b")
    a_worker = namespaces.read_credential(store, "a", namespaces.WORKER)
    assert a is not None and b is not None and a_worker is not None
    ca = await served(up, a)
    try:
        await turn_ms(ca, "warm", 3)
        quiet_turns = await turn_ms(ca, "quiet", TURNS)

        tag = secrets.token_hex(4)
        storm = await asyncio.create_subprocess_exec(
            *(sys.executable, "-c", STORM, url_of(up, b), str(STORM_CONNECTIONS)),
            *(str(STORM_RATE), tag),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            during = statistics.median(await turn_ms(ca, "storm", TURNS))
            still = storm.returncode is None  # the storm outlasted the turns measured in it
            out, err = await asyncio.wait_for(storm.communicate(), timeout=120)
        finally:
            if storm.returncode is None:
                storm.kill()
                await storm.wait()
        assert storm.returncode == 0, err.decode()
        assert out.decode().strip() == str(STORM_CONNECTIONS)
        assert still, "the storm ended before the turns measured during it"

        # a's own worker user closing a connection named like a worker's is heard (and,
        # asked and silent, handed on): once a's rescuer said so, it heard the storm before.
        marker = "marker" + secrets.token_hex(4)
        nc = await nats.connect(
            url_of(up, a_worker), name=connection_name("x", marker), max_reconnect_attempts=0
        )
        await nc.close()

        async def handed_on() -> bool:
            return any(marker in ln and "rescue.handed_on" in ln for ln in rescue_lines(up.log))

        await until(handed_on, timeout=30)
        # Quiet is measured before and after the storm: other work on the machine (the rest
        # of the suite) moves a's pace more than a single quiet spell shows.
        quiet = statistics.median(quiet_turns + await turn_ms(ca, "quiet", TURNS))
        faked = [ln for ln in rescue_lines(up.log) if re.search(rf"\b{tag}\d+\b", ln)]
        assert not faked, f"{len(faked)} rescue lines for b's fake workers, such as {faked[0]}"
        assert during <= 2 * quiet, f"a's p50 {during:.0f} ms during b's storm, {quiet:.0f} quiet"
    finally:
        await ca.close()


RATE = 4.0
RATE_TURNS = 24


async def test_a_worker_takes_in_turns_at_its_turn_rate(
    client: Client, workers: WorkerFactory
) -> None:
    """A worker with JETLOOP_TURN_RATE=4 accepts 24 turn requests published at once no
    faster than 4 a second (plus its burst of one), and serves every one of them."""
    workers.start(env={"JETLOOP_TURN_RATE": str(RATE)})
    sessions = [f"rate{i}" for i in range(RATE_TURNS)]
    handles = [await client.send("tester", sid, script(answer="ok")) for sid in sessions]
    for h in handles:
        assert (await client.wait(h, timeout=60)).text is not None

    async def accepted_at(sid: str) -> float:
        at = [
            ev.at
            async for ev in client.events(sid, follow=False)
            if ev.type == EventType.TURN_ACCEPTED
        ]
        assert len(at) == 1, f"{len(at)} turn.accepted in {sid}"
        return at[0]

    times = sorted([await accepted_at(sid) for sid in sessions])
    span = times[-1] - times[0]
    # 24 at 4 a second after a burst of one: 23 waits of a quarter second (some slack for a
    # clock read per accept), where unlimited they come in well under a second.
    assert span >= (RATE_TURNS - 2) / RATE * 0.85, f"24 turns taken in within {span:.2f} s"
    # No second took in more than the rate and its burst (with one more for where a
    # window's edges fall).
    most = max(sum(1 for t in times if s <= t < s + 1.0) for s in times)
    assert most <= RATE + 2, f"{most} turns taken in within one second"
