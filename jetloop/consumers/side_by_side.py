"""Two awaitables at once, with one task fewer than ``asyncio.gather``.

A step that waits for two independent answers (a read and another read, a publish and the
join's read) runs the first in a task of its own and the second in its own task: ``gather``
would make a task of each. Unlike ``gather``, both have ended when this returns or raises,
and the second's error wins: a step reports what its main line found (a takeover found by
the join, say) over what the side found.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from jetloop.streams.loops import running_loop

A = TypeVar("A")
B = TypeVar("B")


async def side_by_side(first: Awaitable[A], second: Awaitable[B]) -> tuple[A, B]:
    """Run ``first`` (started first, in a task) and ``second`` (here) at the same time."""
    task = asyncio.ensure_future(first, loop=running_loop())
    try:
        b = await second
    except BaseException as exc:
        if isinstance(exc, asyncio.CancelledError):
            task.cancel()  # this step is being cancelled: so is its side
        with contextlib.suppress(BaseException):
            await task
        raise
    return await task, b
