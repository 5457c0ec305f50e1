"""``running_loop`` is ``asyncio.get_running_loop`` without the system call: the same loop,
in every thread and for each new loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from jetloop.streams.loops import running_loop


async def _both() -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
    return running_loop(), asyncio.get_running_loop()


def test_each_loop_in_turn_and_in_each_thread_is_the_running_one() -> None:
    for _ in range(3):  # a loop closed and a new one made: the new one
        mine, theirs = asyncio.run(_both())
        assert mine is theirs
    other: list[tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]] = []
    t = threading.Thread(target=lambda: other.append(asyncio.run(_both())))
    t.start()
    t.join()
    assert other[0][0] is other[0][1]


def test_outside_a_loop_there_is_none() -> None:
    asyncio.run(_both())  # one remembered, and closed now
    with pytest.raises(RuntimeError):
        running_loop()
