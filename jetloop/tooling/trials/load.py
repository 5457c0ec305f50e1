"""Busy processes beside a trial: a machine with other work on it.

A kill trial on a quiet machine says little about a user's host, a shared CI runner or a
laptop compiling something: there a live worker is slow, and its beats, its reconnects and
its answers come late. ``busy(n)`` runs ``n`` processes that only spin on the CPU (one core
each) for as long as the block runs, and kills them on the way out, whatever happens. Two
of them on two cores put the 1-minute load near 3 with the trial's own processes. Used by
``jetloop.tooling.trials.run`` (``jetloop trials --load N``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SPIN = "while True: pass"


@contextmanager
def busy(n: int) -> Iterator[list[int]]:
    """Run ``n`` CPU-bound processes for the block; yields their pids."""
    if n < 0:
        raise ValueError(f"load must be 0 or more busy processes, not {n}")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", SPIN],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
