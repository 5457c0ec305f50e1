"""``jetloop up``: the embedded default in one process tree.

Starts nats-server from the wheel on the store directory (unless ``--nats`` names servers),
applies the topology, and runs a worker for every pool with the given app. Ctrl-C stops
the worker (drain) and then the server. Running it again resumes what was in flight: the
state and the queues are in the store directory.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
from pathlib import Path

import structlog
from pydantic import SecretStr

from agents import load_app
from services.embedded import EmbeddedServer
from services.gateway import Gateway
from services.gateway_config import GatewayConfig
from services.projector import Projector
from services.settings import Settings
from services.worker import Worker

log = structlog.get_logger("jetloop.up")


def seal_key(store_dir: Path) -> str:
    """The embedded default's checkpoint key: made once, kept beside the store (0600)."""
    path = store_dir / "seal.key"
    if not path.exists():
        store_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path.read_text().strip()


async def run_up(settings: Settings, external: bool) -> None:
    server: EmbeddedServer | None = None
    if not external:
        server = EmbeddedServer(
            settings.store_dir,
            port=settings.embedded_port,
            log_file=settings.store_dir / "nats-server.log",
        )
        server.start()
        await server.wait_jetstream()
        settings = settings.model_copy(update={"nats_url": server.url})
        log.info("nats.started", url=server.url, store=str(settings.store_dir))
    os.environ.setdefault("JETLOOP_VENDOR_DB", str(settings.store_dir / "vendor.sqlite"))
    if settings.seal_key is None:
        settings = settings.model_copy(update={"seal_key": SecretStr(seal_key(settings.store_dir))})
        os.environ["JETLOOP_SEAL_KEY"] = settings.seal_key.get_secret_value()  # type: ignore[union-attr]
    gw_config = GatewayConfig.from_settings(settings)
    if settings.gateway_anonymous_scopes is None and not gw_config.tokens:
        # The embedded default listens on loopback only: a person at this machine may do all.
        gw_config = gw_config.model_copy(
            update={"anonymous_scopes": frozenset({"read", "write", "approve"})}
        )
    assert gw_config.readmodel_db is not None
    try:
        worker = Worker(settings, load_app(settings.app))
        gateway = Gateway(
            gw_config, settings.nats_urls, settings.gateway_host, settings.gateway_port
        )
        projector = Projector(settings.nats_urls, gw_config.readmodel_db)
        loop = asyncio.get_running_loop()

        def stop() -> None:
            gateway.stop_soon()
            worker.stop_soon()
            projector.stop_soon()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(worker.run())
            tg.create_task(gateway.run())
            tg.create_task(projector.run())
            await worker.wait_started()
            await gateway.wait_started()
            log.info(
                "jetloop.up",
                nats=settings.nats_url,
                gateway=gateway.url,
                hint="try: jetloop chat --agent demo",
            )
    finally:
        if server is not None:
            server.stop()
            log.info("nats.stopped")
