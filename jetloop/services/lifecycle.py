"""The lifecycle the long-lived services share (docs/design.md, convention 3): ``run()``
until ``stop()``.

``stop()`` is idempotent and only asks: ``run()`` then stops intake, drains and closes in its
own order. ``async with`` stops on the way out.
"""

from __future__ import annotations

import asyncio
from typing import Self


class Service:
    def __init__(self) -> None:
        self._stopping = asyncio.Event()
        self._started = asyncio.Event()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_started(self) -> None:
        await self._started.wait()

    def stop_soon(self) -> None:
        self._stopping.set()

    async def stop(self) -> None:
        self._stopping.set()
