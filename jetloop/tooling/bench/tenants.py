"""Noisy neighbours (``jetloop bench tenants``): how much one namespace's flood of turns slows
another's turns on the same ``jetloop up``.

``jetloop up`` runs every namespace's workers in one process, so a namespace that sends
turns as fast as it can takes the CPU its neighbours' turns need. This runs ``up`` as a person
does (a subprocess on a store of its own, the benchmark app) with namespaces ``a`` and ``b``,
and measures ``a``'s sequential turns (send to answer, one at a time): quiet, while ``b``'s
client publishes turn requests as fast as it can for ``--flood`` seconds, and for
``--after`` seconds after. ``b``'s workers take its turns in at ``--turn-rate`` a second
(``b``'s namespace limit ``turn_rate``, which ``up`` gives its workers as
``JETLOOP_TURN_RATE``; 0: unlimited), what is over it waiting in ``b``'s stream; ``a`` has
no rate. Prints the p50s and their ratios to quiet; the goal is ``a``'s p50 during the flood
at most twice its quiet p50.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from jetloop.services import namespaces
from jetloop.services.client import Client
from jetloop.services.embedded import free_port, private_dir

APP = "jetloop.tooling.bench.app:app"
AGENT = "bench"
GOAL = 2.0  # a's p50 during b's flood, at most this many times its quiet p50
# Publishes of b's flood in flight at once: enough to keep its client busy.
FLOOD_IN_FLIGHT = 64


@dataclass
class TenantsResult:
    turn_rate: float  # b's turns taken in a second; 0: unlimited
    quiet_p50_ms: float
    during_p50_ms: float
    after_p50_ms: float
    flood_turns: int  # b's turn requests published during the flood
    flood_seconds: float
    turns_quiet: int
    turns_during: int
    turns_after: int

    @property
    def during_ratio(self) -> float:
        return self.during_p50_ms / self.quiet_p50_ms

    @property
    def after_ratio(self) -> float:
        return self.after_p50_ms / self.quiet_p50_ms


def _url(port: int, cred: namespaces.Credential) -> str:
    password = urllib.parse.quote(cred.password, safe="")
    return f"nats://{cred.user}:{password}@127.0.0.1:{port}"


def _start_up(cwd: Path, port: int) -> subprocess.Popen[bytes]:
    # Only the settings named here: none of the caller's (its store, its seal key).
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETLOOP_")}
    env |= {
        "JETLOOP_APP": APP,
        "JETLOOP_GATEWAY_PORT": str(free_port()),
        "JETLOOP_VENDOR_DB": str(cwd / "vendor.sqlite"),
    }
    with open(cwd / "up.log", "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "jetloop.services.cli", "up", "--port", str(port)],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


async def _served(url: str, proc: subprocess.Popen[bytes], log: Path) -> Client:
    """A client of the namespace once a worker serves the benchmark agent there."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jetloop up exited (its log: {log})")
        try:
            c = await Client.connect(url, verify=False, give_up_after=2)
        except Exception:
            await asyncio.sleep(0.2)
            continue
        try:
            workers = await (await c.registry()).workers()
        except Exception:
            workers = []
        if any(AGENT in w.agents for w in workers):
            return c
        await c.close()
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no worker served namespace's {AGENT!r} within 90 s (log: {log})")


async def _turns(client: Client, session: str, *, n: int = 0, until: float = 0.0) -> list[float]:
    """Sequential turns in ``session``, each from send to answer (ms): ``n`` of them, or as
    many as start before ``until`` (monotonic)."""
    out: list[float] = []
    i = 0
    while (n and i < n) or (until and time.monotonic() < until):
        began = time.perf_counter()
        h = await client.send(AGENT, session, f"turn {i}")
        await client.wait(h, timeout=300)
        out.append((time.perf_counter() - began) * 1000)
        i += 1
    return out


async def _flood(url: str, seconds: float) -> int:
    """Turn requests of many sessions, published as fast as a client of ``url`` can for
    ``seconds``; how many were published."""
    client = await Client.connect(url, verify=False)
    end = time.monotonic() + seconds
    sent = [0]

    async def one(lane: int) -> None:
        k = 0
        while time.monotonic() < end:
            await client.send(AGENT, f"flood-{lane}-{k}", "flood", will_wait=False)
            sent[0] += 1
            k += 1

    try:
        await asyncio.gather(*(one(lane) for lane in range(FLOOD_IN_FLIGHT)))
    finally:
        await client.close()
    return sent[0]


async def _flood_process(url: str, seconds: float) -> int:
    """``_flood`` in a process of its own, as b's client is a program of its own: the loop
    that times a's turns does not also publish b's."""
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "jetloop.tooling.bench.tenants", url, str(seconds)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"b's flood failed: {err.decode()[-500:]}")
    return int(out.decode().strip())


async def noisy_neighbours(
    work_dir: Path,
    turn_rate: float,
    *,
    quiet_turns: int = 40,
    flood_seconds: float = 10.0,
    after_seconds: float = 30.0,
) -> TenantsResult:
    """``up`` with namespaces a and b in ``work_dir``; a's p50 quiet, during b's flood and
    after it."""
    store = work_dir / ".jetloop"
    private_dir(store)
    limits = namespaces.Limits(turn_rate=turn_rate or None)
    a = namespaces.create(store, "a")
    b = namespaces.create(store, "b", limits)
    port = free_port()
    proc = _start_up(work_dir, port)
    try:
        ca = await _served(_url(port, a), proc, work_dir / "up.log")
        cb = await _served(_url(port, b), proc, work_dir / "up.log")
        await cb.close()
        try:
            await _turns(ca, "warm", n=10)
            quiet = await _turns(ca, "quiet", n=quiet_turns)
            began = time.monotonic()
            flood = asyncio.ensure_future(_flood_process(_url(port, b), flood_seconds))
            during = await _turns(ca, "during", until=began + flood_seconds)
            flooded = await flood
            took = time.monotonic() - began
            after = await _turns(ca, "after", until=time.monotonic() + after_seconds)
        finally:
            await ca.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return TenantsResult(
        turn_rate=turn_rate,
        quiet_p50_ms=round(statistics.median(quiet), 1),
        during_p50_ms=round(statistics.median(during), 1),
        after_p50_ms=round(statistics.median(after), 1),
        flood_turns=flooded,
        flood_seconds=round(took, 1),
        turns_quiet=len(quiet),
        turns_during=len(during),
        turns_after=len(after),
    )


def format_tenants(res: TenantsResult) -> str:
    rate = f"{res.turn_rate:g}/s" if res.turn_rate else "unlimited"
    return "\n".join(
        [
            f"### Noisy neighbours: a's sequential turns while b floods (b's turn rate {rate})",
            "",
            "| a's turns | n | p50 | ratio to quiet |",
            "|---|---:|---:|---:|",
            f"| quiet | {res.turns_quiet} | {res.quiet_p50_ms:.1f} ms | 1.00 |",
            f"| during b's flood ({res.flood_turns} turns in {res.flood_seconds:g} s) | "
            f"{res.turns_during} | {res.during_p50_ms:.1f} ms | {res.during_ratio:.2f} |",
            f"| after the flood | {res.turns_after} | {res.after_p50_ms:.1f} ms | "
            f"{res.after_ratio:.2f} |",
            "",
            f"goal: during / quiet <= {GOAL:g}: "
            + ("met" if res.during_ratio <= GOAL else "not met"),
        ]
    )


def main(
    turn_rate: float,
    flood_seconds: float = 10.0,
    after_seconds: float = 30.0,
    keep: Path | None = None,
) -> int:
    """What ``jetloop bench tenants`` runs: prints the table; 0 if the goal is met, 1 if not,
    2 if the benchmark could not run."""
    from jetloop.services.logs import configure

    configure("console", "warning")
    work = keep if keep is not None else Path(tempfile.mkdtemp(prefix="jetloop-tenants-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        res = asyncio.run(
            noisy_neighbours(
                work, turn_rate, flood_seconds=flood_seconds, after_seconds=after_seconds
            )
        )
    except KeyboardInterrupt:
        print("jetloop bench tenants: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # every failure of the run is reported the same way
        print(f"jetloop bench tenants: failed: {exc} (logs in {work})", file=sys.stderr)
        return 2
    print(format_tenants(res))
    if keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if res.during_ratio <= GOAL else 1


if __name__ == "__main__":  # b's flood (``_flood_process``): <url> <seconds>
    print(asyncio.run(_flood(sys.argv[1], float(sys.argv[2]))))
