"""A floor worker of the bench (``jetloop.tooling.bench.floor``, ``floor_lever1``) on a
nats-server of its own that syncs before it acknowledges, for the tests of the patterns the
floors stand for."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from jetloop.services.embedded import EmbeddedServer
from jetloop.tooling.bench.rig import OpCounts, spawn_floor, stop_floor_process

# What each stored write and message of the floor weighs here (bytes).
SIZES = OpCounts(kv_writes=0, publishes=0, acks=0, kv_bytes=300, msg_bytes=200)


@asynccontextmanager
async def floor_on_a_server(
    tmp_path: Path,
    apply: Callable[[JetStreamContext], Awaitable[None]],
    module: str,
    entry: str,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Client]:
    """The server with the floor's topology (``apply``) and its worker (``module.entry``)
    running; yields a connection to the server."""
    conf = tmp_path / "server.conf"
    conf.write_text("jetstream { sync_interval: always }\n")
    server = EmbeddedServer(
        tmp_path / "store", port=0, log_file=tmp_path / "nats.log", config_file=conf
    )
    await asyncio.to_thread(server.start)
    try:
        await server.wait_jetstream()
        nc = await nats.connect(server.url)
        try:
            await apply(nc.jetstream())
            worker = await spawn_floor(module, entry, server.url, SIZES, env)
            try:
                yield nc
            finally:
                stop_floor_process(worker)
        finally:
            await nc.close()
    finally:
        await asyncio.to_thread(server.stop, 30.0)
        server.kill()
