"""A real server paused with SIGSTOP, for tests that need a request to stay unanswered.

``kill(SIGSTOP)`` returns before the process has stopped: the kernel stops each thread when
that thread next handles signals, and on a loaded machine a server thread already running
can answer a request sent right after the kill (a CI run saw a paused server answer a
commit within the test's 0.2 s). ``paused`` returns only once every thread reports
"stopped" in ``/proc``, so what the test sends next really waits.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _states(pid: int) -> list[str]:
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread ended meanwhile
            continue
        states.append(text.rsplit(")", 1)[1].split()[0])
    return states


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = _states(pid)
        if states and all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped after {timeout}s: {states}")
        time.sleep(0.001)


@contextmanager
def paused(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` and wait until it has stopped; SIGCONT it on the way out."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_stopped(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
