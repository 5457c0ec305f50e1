"""The running event loop, without a system call.

On Python 3.11 every ``asyncio.get_running_loop()`` — and so every ``ensure_future`` of a
coroutine, ``current_task()``, ``Future()`` made without a loop — calls ``getpid()`` to
check that the loop was not inherited across a fork; a worker asks dozens of times per
step, and in its profile those system calls were 3 % of its time (docs/performance.md).
Only one loop runs in a thread at a time, so a loop remembered for this thread that is
still running is the running loop; a fork forgets them all (jetloop starts processes with
exec, but a user's code may fork).
"""

from __future__ import annotations

import asyncio
import os
import threading

_BY_THREAD: dict[int, asyncio.AbstractEventLoop] = {}

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_BY_THREAD.clear)


def running_loop() -> asyncio.AbstractEventLoop:
    """``asyncio.get_running_loop()``: the loop running in this thread (``RuntimeError``
    when none is)."""
    thread = threading.get_ident()
    loop = _BY_THREAD.get(thread)
    if loop is None or not loop.is_running():
        loop = _BY_THREAD[thread] = asyncio.get_running_loop()
    return loop
