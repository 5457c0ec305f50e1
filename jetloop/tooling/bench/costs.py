"""What turns cost the machine, per turn: the messages the server took in and sent out, and
the CPU time of the server, of the worker processes and of the driving client.

Messages are the server's own per-connection counters (``/connz`` on its monitoring port:
``in_msgs`` are what a connection sent the server, ``out_msgs`` what the server sent it),
summed over every connection but the rig's probe (``Rig.probe``: the connection that asks
for consumer and stream state between batches, which is the bench's, not the system's).
CPU time is each process's user + system time from ``/proc/<pid>/stat`` (Linux; elsewhere
the CPU figures are absent), the driver's from ``time.process_time()``.

A ``Meter`` reads both before and after a batch (after the batch has gone quiet: every
trailing step acked), and the difference over the batch's turns is the batch's ``Cost``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROBE_NAME = "jetloop-bench-probe"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of the process ``pid`` (None: not Linux, or gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = raw.rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_of(pids: Sequence[int]) -> float | None:
    total = 0.0
    for pid in pids:
        got = cpu_seconds(pid)
        if got is None:
            return None
        total += got
    return total


@dataclass(frozen=True)
class Reading:
    in_msgs: int
    out_msgs: int
    server_cpu: float | None
    worker_cpu: float | None
    client_cpu: float


@dataclass
class Cost:
    """Totals over some turns; ``per_turn`` divides them."""

    turns: int = 0
    in_msgs: int = 0
    out_msgs: int = 0
    server_cpu: float | None = 0.0
    worker_cpu: float | None = 0.0
    client_cpu: float = 0.0

    def add(self, before: Reading, after: Reading, turns: int) -> None:
        self.turns += turns
        self.in_msgs += after.in_msgs - before.in_msgs
        self.out_msgs += after.out_msgs - before.out_msgs
        self.server_cpu = _plus(self.server_cpu, before.server_cpu, after.server_cpu)
        self.worker_cpu = _plus(self.worker_cpu, before.worker_cpu, after.worker_cpu)
        self.client_cpu += after.client_cpu - before.client_cpu

    def per_turn(self) -> dict[str, float | None]:
        n = max(1, self.turns)
        return {
            "in_msgs": self.in_msgs / n,
            "out_msgs": self.out_msgs / n,
            "server_cpu_ms": None if self.server_cpu is None else self.server_cpu * 1000 / n,
            "worker_cpu_ms": None if self.worker_cpu is None else self.worker_cpu * 1000 / n,
            "client_cpu_ms": self.client_cpu * 1000 / n,
        }


def _plus(total: float | None, before: float | None, after: float | None) -> float | None:
    if total is None or before is None or after is None:
        return None
    return total + after - before


class Meter:
    """Reads the server's message counters and the CPU time of the server, the workers (the
    pids ``workers`` names at the time of reading) and this process."""

    def __init__(self, monitor_port: int, server_pid: int, workers: Callable[[], list[int]]):
        self.monitor_port = monitor_port
        self.server_pid = server_pid
        self.workers = workers

    async def read(self) -> Reading:
        conns = [
            c
            for c in await connections(self.monitor_port)
            if not str(c.get("name", "")).startswith(PROBE_NAME)
        ]
        return Reading(
            in_msgs=sum(int(c.get("in_msgs", 0)) for c in conns),
            out_msgs=sum(int(c.get("out_msgs", 0)) for c in conns),
            server_cpu=cpu_seconds(self.server_pid),
            worker_cpu=_cpu_of(self.workers()),
            client_cpu=time.process_time(),
        )


async def connections(monitor_port: int) -> list[dict[str, Any]]:
    """Every client connection the server has, with its counters (``/connz``)."""
    url = f"http://127.0.0.1:{monitor_port}/connz?limit=4096"
    data = await asyncio.to_thread(_get_json, url)
    return list(data.get("connections", []))


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data
