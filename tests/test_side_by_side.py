"""``side_by_side``: both ended whatever happens, the second's error wins, cancel reaches both."""

from __future__ import annotations

import asyncio

import pytest

from jetloop.consumers.side_by_side import side_by_side


async def test_both_answers_and_both_errors_in_their_order() -> None:
    async def value(v: int, delay: float = 0.0) -> int:
        await asyncio.sleep(delay)
        return v

    async def fails(why: str, delay: float = 0.0) -> int:
        await asyncio.sleep(delay)
        raise ValueError(why)

    assert await side_by_side(value(1, 0.02), value(2)) == (1, 2)
    with pytest.raises(ValueError, match="second"):
        await side_by_side(fails("first"), fails("second", 0.02))
    with pytest.raises(ValueError, match="first"):
        await side_by_side(fails("first", 0.02), value(2))
    ended: list[str] = []

    async def slow_side() -> int:
        await asyncio.sleep(0.05)
        ended.append("side")
        return 1

    with pytest.raises(ValueError, match="second"):
        await side_by_side(slow_side(), fails("second"))
    assert ended == ["side"]  # waited for, not left running


async def test_a_cancelled_step_cancels_its_side() -> None:
    side_cancelled = asyncio.Event()

    async def side() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            side_cancelled.set()
            raise

    task = asyncio.ensure_future(side_by_side(side(), asyncio.sleep(10)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert side_cancelled.is_set()
