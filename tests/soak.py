"""The soak of ``jetloop up`` (tests/test_up_soak.py), runnable on its own:
``python -m tests.soak DIR SECONDS``.

It starts ``up`` in ``DIR``, sends bursts of turns (one every few seconds, half through the
NATS client and half through the gateway) with idle gaps between them, samples the memory of
up's process tree around each gap, stops ``up`` with Ctrl-C and writes what it saw to
``DIR/result.json`` for the test to judge. It runs for at least ``SECONDS``, and on until
``DIR/stop`` exists: the test suite starts it when it collects the soak test and asks it to
stop when that test runs, so the soak lasts the whole suite and costs it no time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from jetloop.services.client import Client
from jetloop.services.embedded import die_with_parent, free_port
from jetloop.services.natsauth import url_as
from tests.test_up import events, field, up_command, up_env, wait_ready

BURST = 5  # turns in a burst
EVERY = 3.0  # seconds between the turns of a burst
IDLE = 25.0  # seconds of nothing between bursts
SETTLE = 4.0  # ... of which the first are not measured
LONGEST = 3600.0  # it stops by itself after this, asked or not


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def status_kb(pid: int, field: str) -> int:
    """One field of ``/proc/<pid>/status`` in kB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def is_nats_server(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "nats-server"
    except OSError:
        return False


def memory_mb(pid: int) -> tuple[float, float, float]:
    """Memory of the process tree of ``pid``, in MB: the whole tree's resident set, the
    anonymous memory (heap, not mapped files) of its Python processes, and nats-server's
    resident set."""
    tree_kb = python_kb = server_kb = 0
    for p in tree(pid):
        tree_kb += status_kb(p, "VmRSS")
        if is_nats_server(p):
            server_kb += status_kb(p, "VmRSS")
        else:
            python_kb += status_kb(p, "RssAnon")
    return tree_kb / 1024, python_kb / 1024, server_kb / 1024


def start_up(directory: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    """``up`` on free ports, in a session of its own, killed if this process dies."""
    nats_port, gateway_port = free_port(), free_port()
    with open(directory / "up.log", "ab") as out:
        proc = subprocess.Popen(
            up_command(directory, nats_port, "--gateway-port", str(gateway_port)),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=up_env(directory),
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
    return proc, nats_port, gateway_port


async def soak(directory: Path, seconds: float) -> dict[str, Any]:
    """Run the soak in ``directory``; what it saw (``result.json``'s content)."""
    log = directory / "up.log"
    stop = directory / "stop"
    proc, nats_port, gateway_port = start_up(directory)
    turns = answered = 0
    # Per idle gap: the turns so far, then memory_mb() before and after the gap.
    samples: list[tuple[int, tuple[float, float, float], tuple[float, float, float]]] = []
    failure = ""
    exit_code: int | None = None

    def done(began: float) -> bool:
        elapsed = time.monotonic() - began
        return elapsed >= LONGEST or (elapsed >= seconds and stop.exists())

    try:
        await asyncio.to_thread(wait_ready, proc, log)
        c = await Client.connect(url_as(f"nats://127.0.0.1:{nats_port}", directory / "store"))
        began = time.monotonic()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{gateway_port}") as http:
                while not done(began):
                    for _ in range(BURST):
                        session = f"s{turns % 4}"
                        text = f"create ticket soak {turns}; list tickets"
                        if turns % 2:
                            async with http.post(
                                f"/v1/agents/demo/sessions/{session}/messages",
                                params={"wait": "true"},
                                json={"text": text},
                            ) as resp:
                                got = await resp.json()
                            if resp.status != 200 or got.get("status") != "completed":
                                raise AssertionError(f"turn {turns}: {resp.status} {got}")
                            reply = got["text"]
                        else:
                            h = await c.send("demo", session, text)
                            reply = (await c.wait(h, timeout=60)).text
                        turns += 1
                        if not reply or "T-" not in reply:
                            raise AssertionError(f"turn {turns}: answered {reply!r}")
                        answered += 1
                        await asyncio.sleep(EVERY)  # the pace of a person typing
                    if proc.poll() is not None:
                        raise AssertionError(f"up exited ({proc.returncode})")
                    # Idle: the fetches come back empty. A gap ends early only when the soak
                    # is over (it was asked to stop and has run long enough). Its first
                    # seconds are left out of the measure: the burst's last turn is still
                    # being projected and its events read (the console, the client).
                    before = None
                    for tick in range(int(IDLE / 0.5)):  # the stop is a file: looked at
                        if done(began):
                            break
                        if tick == int(SETTLE / 0.5):
                            before = memory_mb(proc.pid)
                        await asyncio.sleep(0.5)
                    if before is not None:
                        samples.append((turns, before, memory_mb(proc.pid)))
        finally:
            await c.close()
        ran = time.monotonic() - began
        alive_at_end = proc.poll() is None
        server = int(field(events(log, "nats.started")[-1], "pid"))
        proc.send_signal(signal.SIGINT)
        exit_code = proc.wait(60)
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
        ran, alive_at_end, server, exit_code = 0.0, proc.poll() is None, 0, proc.poll()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {
        "failure": failure,
        "seconds": ran,
        "turns": turns,
        "answered": answered,
        "samples": samples,
        "alive_at_end": alive_at_end,
        "component_failed": events(log, "component.failed"),
        "exit_code": exit_code,
        "server_pid": server,
    }


def main() -> None:
    directory, seconds = Path(sys.argv[1]), float(sys.argv[2])
    result = asyncio.run(soak(directory, seconds))
    tmp = directory / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(directory / "result.json")


if __name__ == "__main__":
    main()
