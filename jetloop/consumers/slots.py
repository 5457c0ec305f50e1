"""The tool pool's concurrency, counted in calls: how many calls of ``call_tools`` messages
a worker runs at once.

A message's calls take their slots together (``CallSlots.take``): as many as it has calls
(at most the whole pool), in the order the messages asked, so they start in the same pass of
the event loop and their reads of the turn, its session and their records go out as one
request (``StateStore._shared_last``). Taken one call at a time, as before, the calls of a
message started as slots freed one by one, each reading alone: under load about 1.7 reads
per message of five calls instead of one. Each call gives its slot back when it ends.
"""

from __future__ import annotations

import asyncio


class CallSlots:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free = asyncio.Semaphore(limit)
        self._taking = asyncio.Lock()  # one message takes its slots at a time: no deadlock

    async def take(self, n: int) -> int:
        """Wait for ``min(n, limit)`` slots, taken together; returns how many."""
        n = min(n, self.limit)
        async with self._taking:
            got = 0
            try:
                while got < n:
                    await self._free.acquire()
                    got += 1
            except BaseException:
                for _ in range(got):
                    self._free.release()
                raise
        return n

    async def one(self) -> None:
        """Wait for one slot (a call past the pool's size, of a message larger than it)."""
        async with self._taking:
            await self._free.acquire()

    def release(self) -> None:
        self._free.release()
