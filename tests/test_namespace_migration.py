"""A store from before namespaces becomes the `default` namespace in place (issue 32).

The store is made as the previous release made it: its nats-server's config has the users
in the global account (an ``authorization`` block and the system account, nothing else), so
JetStream keeps its data under ``nats/jetstream/$G``. A worker leaves there a turn held for
approval with a message queued behind it, and a turn waiting on a timer due after the
upgrade. Then the current `jetloop up` starts on the store: the data has moved to the
``default`` account, the approval decided afterwards runs its tool once, the queued message
runs, the timer fires once, and nothing is dead-lettered.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from jetloop.demo.vendor import Vendor
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer, free_port
from jetloop.services.natsauth import ACCOUNT_ROLES, PERMISSIONS, make_users, system_account
from jetloop.services.settings import WATCH_USER, make_seal_key
from jetloop.streams.seal import Sealer, key_bytes
from jetloop.streams.topology import DEAD_STREAM
from tests.conftest import until
from tests.test_seal_key import Up, env_without_key
from tests.test_up import wait_ready


def previous_config(store: Path) -> Path:
    """The server config of the release before namespaces: one (global) account."""
    users = make_users(store)
    entries = [
        {"user": r, "password": users[r], "permissions": PERMISSIONS[r]} for r in ACCOUNT_ROLES
    ]
    path = store / "previous.conf"
    path.write_text(
        json.dumps({"authorization": {"users": entries}, **system_account(users[WATCH_USER])})
    )
    return path


def previous_worker(cwd: Path, url: str) -> subprocess.Popen[bytes]:
    """A worker beside the store (its credentials and key from the store directory)."""
    return subprocess.Popen(
        [sys.executable, "-m", "jetloop.services.cli", "worker", "--nats", url],
        cwd=cwd,
        env=env_without_key(JETLOOP_VENDOR_DB=str(cwd / "vendor.sqlite")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def pending_approval(c: Client, session: str) -> str | None:
    snap = await c.snapshot(session)
    pending = [a for a in snap.approvals if a.status == "pending"] if snap else []
    return pending[0].approval_id if pending else None


async def test_a_store_from_before_namespaces_becomes_the_default_namespace(
    tmp_path: Path,
) -> None:
    store = tmp_path / ".jetloop"
    store.mkdir(mode=0o700)
    key = make_seal_key(store)
    sealer = Sealer([key_bytes(key)])
    port = free_port()
    server = EmbeddedServer(
        store,
        port=port,
        config_file=previous_config(store),
        auth=("worker", make_users(store)["worker"]),
    )
    server.start()
    worker = previous_worker(tmp_path, server.url)
    try:
        url = f"nats://worker:{make_users(store)['worker']}@127.0.0.1:{port}"
        async with await Client.connect(url, sealer=sealer) as c:

            async def serving() -> bool:
                try:
                    workers = await (await c.registry()).workers()
                except Exception:
                    c._registry = None  # not made yet: bind again
                    return False
                return any("demo" in w.agents for w in workers)

            await until(serving, timeout=60)
            held = await c.send("demo", "m1", "close T-1")
            approval_id = await until(lambda: pending_approval(c, "m1"), timeout=60)
            queued = await c.send("demo", "m1", "create ticket queued behind the approval")
            timed = await c.send("demo", "m2", "wait 8 seconds")

            async def waits() -> bool:
                snap = await c.snapshot("m2")
                return snap is not None and bool(snap.timers)

            await until(waits)
    finally:
        worker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 30)
        server.stop()
    assert (store / "nats" / "jetstream" / "$G" / "streams").exists()

    up = Up(tmp_path)
    up.port, up.url = port, server.url
    up.start()
    try:
        assert up.proc is not None
        await asyncio.to_thread(wait_ready, up.proc, up.log)
        jetstream = store / "nats" / "jetstream"
        assert not (jetstream / "$G").exists() and (jetstream / "default" / "streams").exists()
        async with await up.client() as c:
            record = await c.approve("m1", approval_id, by="after-the-upgrade")
            assert record.status == "approved"
            res = await c.wait(held, timeout=30)
            assert res.text is not None and "closed" in res.text, res
            res = await c.wait(queued, timeout=30)
            assert res.text is not None and "T-" in res.text, res
            res = await c.wait(timed, timeout=30)
            assert res.status.value == "completed", res
            snap = await c.snapshot("m2")
            assert snap is not None and snap.turns_done == 1 and not snap.timers, snap
            info = await c.js.stream_info(DEAD_STREAM)
            assert info.state.messages == 0, info.state
        closes = await Vendor(tmp_path / "vendor.sqlite").request_counts("close_ticket")
        assert list(closes.values()) == [1], closes
    finally:
        up.stop()
    assert os.listdir(store / "nats" / "jetstream") == ["default"]
