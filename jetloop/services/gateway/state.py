"""What the gateway's handlers share: the NATS client, the read model, the stop flag
(aiohttp ``AppKey``s, set up by ``jetloop.services.gateway.app``'s ``cleanup_ctx``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from jetloop.services.client import Client
from jetloop.services.gateway.http import Problem
from jetloop.services.readmodel.model import ReadModel, ReadModelMissing


class ReadModelReader:
    """The read model, opened on first use: the projector may not have written it yet."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._model: ReadModel | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> ReadModel:
        if self.path is None:
            raise Problem(503, "read model not configured", "set the read model's database")
        async with self._lock:
            if self._model is None:
                try:
                    self._model = await ReadModel.open(self.path, readonly=True)
                except ReadModelMissing:
                    raise Problem(
                        503, "read model not available yet", "no projector has written it"
                    ) from None
            return self._model

    async def close(self) -> None:
        if self._model is not None:
            await self._model.close()
            self._model = None


NATS_URLS: web.AppKey[tuple[str, ...]] = web.AppKey("nats_urls")
CLIENT = web.AppKey("client", Client)
READMODEL = web.AppKey("readmodel", ReadModelReader)
STOPPING = web.AppKey("stopping", asyncio.Event)
# Set when the NATS connection closes while the gateway is not stopping: it will not reopen.
NATS_CLOSED = web.AppKey("nats_closed", asyncio.Event)
