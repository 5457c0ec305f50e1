"""A tenant reads its own sessions with its client credential alone (issue 51).

On its own machine a tenant has a credential of its namespace and nothing else: no store
directory, no seal key. `jetloop snapshot` asks the workers, who hold the key and verify
the records (`jl.control.snapshot.<who>`), and says so; the reads the workers do not serve
(`turns`, `turn`, the end of a `send`) are read directly and marked as not verified; with
no worker to answer, a snapshot is read directly too, and marked so.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jetloop.schemas.errors import ControlError
from jetloop.services import namespaces
from jetloop.services.cli.main import UNVERIFIED, VERIFIED_BY_WORKERS
from jetloop.services.client import NO_WORKER, Client
from jetloop.services.embedded import EmbeddedServer
from tests.conftest import WorkerFactory, call, script, until
from tests.test_bus_attack import up as up  # the fixture: `jetloop up` with a gateway
from tests.test_namespaces import as_user, cli, served, url_of
from tests.test_seal_key import Up, env_without_key


async def test_a_tenant_reads_its_sessions_with_its_client_credential_alone(
    up: Up, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With only JETLOOP_NATS_USER / JETLOOP_NATS_PASSWORD / JETLOOP_NAMESPACE (no store, no
    seal key): `snapshot` (text and JSON) shows the session as the workers verified it and
    says so; `turns`, `turn` and `send` work and say their records were not verified; the
    Python client without the key gets the workers' snapshot too."""
    monkeypatch.setenv("JETLOOP_STORE_DIR", str(tmp_path / "elsewhere" / ".jetloop"))
    monkeypatch.delenv("JETLOOP_SEAL_KEY", raising=False)
    cred = namespaces.create(up.cwd / ".jetloop", "t")
    setup = await served(up, cred)  # reads unverified: it only sets the sessions up
    try:
        held = await setup.send("demo", "ts", "close T-1")
        done = await setup.send("demo", "ts2", "create ticket printer on fire")
        assert (await setup.wait(done, timeout=30)).text is not None

        async def pending() -> str | None:
            snap = await setup.snapshot("ts")
            waiting = [x for x in snap.approvals if x.status == "pending"] if snap else []
            return waiting[0].approval_id if waiting else None

        approval_id = await until(pending)
    finally:
        await setup.close()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    tenant = {**as_user(cred), "JETLOOP_NAMESPACE": "t"}
    url = ["--nats", f"nats://127.0.0.1:{up.port}"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return cli(elsewhere, *args, *url, **tenant)

    text, as_json, turns, sent = await asyncio.gather(
        asyncio.to_thread(run, "snapshot", "ts"),
        asyncio.to_thread(run, "snapshot", "ts", "--json"),
        asyncio.to_thread(run, "turns", "ts2"),
        asyncio.to_thread(run, "send", "--agent", "demo", "--session", "ts3", "create ticket x"),
    )
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0] == f"[{VERIFIED_BY_WORKERS}]", text.stdout
    assert f"approval {approval_id}: " in text.stdout, text.stdout
    assert f"turn {held.turn_id}: " in text.stdout, text.stdout

    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["session_id"] == "ts"  # the JSON stays one document
    assert f"[{VERIFIED_BY_WORKERS}]" in as_json.stderr, as_json.stderr

    assert turns.returncode == 0, turns.stderr
    assert turns.stdout.splitlines()[0] == f"[{UNVERIFIED}]", turns.stdout
    assert f"{done.turn_id} request=" in turns.stdout, turns.stdout
    one = await asyncio.to_thread(run, "turn", "ts2", done.turn_id)
    assert one.returncode == 0, one.stderr
    assert one.stdout.splitlines()[0] == f"[{UNVERIFIED}]", one.stdout
    assert f"turn {done.turn_id} " in one.stdout, one.stdout

    assert sent.returncode == 0, sent.stderr
    assert "T-" in sent.stdout and f"[{UNVERIFIED}]" in sent.stderr, sent

    # The Python client without the key: the workers' verified snapshot, not a refusal.
    async with await Client.connect(url_of(up, cred), give_up_after=5) as keyless:
        assert keyless.sealer is None and keyless.verify
        snap = await keyless.snapshot("ts")
        assert snap is not None and [a.approval_id for a in snap.approvals] == [approval_id]
        assert await keyless.snapshot("nobody") is None


async def test_without_a_worker_a_snapshot_is_read_unverified_and_says_so(
    nats_ready: EmbeddedServer, workers: WorkerFactory, client: Client, tmp_path: Path
) -> None:
    """A client without the key asks the workers for a snapshot; with none running it gets
    ``ControlError`` (503, no worker), and `jetloop snapshot` then reads the session directly
    and says it is not verified, and why."""
    w = workers.start()
    h = await client.send("tester", "nw", script([call("read", name="a")]))
    await client.wait(h, timeout=30)
    keyless = Client(client.nc, retry_for=2)
    snap = await keyless.snapshot("nw")
    assert snap is not None and snap.turn is not None and snap.turn.turn_id == h.turn_id

    w.signal(signal.SIGKILL)

    async def gone() -> bool:
        try:
            await keyless.snapshot("nw")
        except ControlError as exc:
            return exc.status == 503 and exc.title == NO_WORKER
        return False

    assert await until(gone, timeout=30)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "jetloop.services.cli", "snapshot", "nw", "--nats", nats_ready.url],
        cwd=elsewhere,
        env=env_without_key(JETLOOP_STORE_DIR=str(elsewhere / ".jetloop")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first == f"[{UNVERIFIED}; no worker answered to verify them]", out.stdout
    assert f"turn {h.turn_id}: completed" in out.stdout, out.stdout
