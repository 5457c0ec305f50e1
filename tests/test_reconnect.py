"""A server gone and back: a worker's connection tries it again every ``RECONNECT_WAIT``
(so a server restarted on the same machine is found again within about that), and its log
says so once per ``OUTAGE_WARN_EVERY``, not once per try."""

from __future__ import annotations

import asyncio
from pathlib import Path

from structlog.testing import capture_logs

from jetloop.services.embedded import EmbeddedServer
from jetloop.streams.connection import OUTAGE_WARN_EVERY, RECONNECT_WAIT, connect, finish
from tests.conftest import until


async def test_an_outage_is_tried_often_and_warned_of_once(tmp_path: Path) -> None:
    assert RECONNECT_WAIT < 0.5 and OUTAGE_WARN_EVERY > 2
    srv = EmbeddedServer(tmp_path / "store", port=0, log_file=tmp_path / "nats.log")
    srv.start()
    nc = await connect([srv.url], "test-reconnect")
    try:
        with capture_logs() as logs:
            srv.kill()
            await asyncio.sleep(2.0)
            tries = [e for e in logs if e["event"] == "nats.error"]
            warned = [e for e in tries if e["log_level"] == "warning"]
            # The connection's end and the first refused try are warnings; the tries after
            # it, within OUTAGE_WARN_EVERY, are debug lines. At 0.5 s between tries two
            # seconds would hold about four; at RECONNECT_WAIT, many more.
            assert 1 <= len(warned) <= 2, warned
            assert len(tries) - len(warned) >= 6, tries
            srv.start()

            async def linked() -> bool:
                return bool(nc.is_connected)

            await until(linked, timeout=10)
        # A later outage warns of its first failed try again.
        with capture_logs() as logs:
            srv.kill()
            await asyncio.sleep(0.6)
        warned = [e for e in logs if e["event"] == "nats.error" and e["log_level"] == "warning"]
        assert warned and "tries_since" not in warned[-1], logs
    finally:
        await finish(nc, timeout=2)
        srv.kill()
