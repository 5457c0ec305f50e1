"""`jetloop up` serves NATS with users and roles (jetloop.services.natsauth): the CLI beside it
finds the worker credentials in the store directory; a client credential starts and reads
turns, and decides (approve, cancel) through the workers' control API, but cannot write
state or publish a step; no credential is refused."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from jetloop.demo.vendor import Vendor
from jetloop.schemas import ApprovalRecord
from jetloop.schemas.errors import ControlError, NotAuthorized, SettingsError
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer, free_port
from jetloop.services.natsauth import make_users, url_as, write_config
from jetloop.services.settings import load_settings
from jetloop.sessions.snapshot import SessionSnapshot
from jetloop.streams.connection import inbox_prefix
from jetloop.streams.seal import Sealer, key_bytes
from jetloop.streams.topology import STATE_BUCKET, STEPS_STREAM
from jetloop.tooling.trials.harness import WorkerProcess
from tests.conftest import WorkerFactory, body, call, prepare, script, until
from tests.test_seal_key import Up, cancelled_then_next_completes, env_without_key, waiting_turn
from tests.test_up import wait_ready

NO_CREDENTIALS = ("JETLOOP_NATS_USER", "JETLOOP_NATS_PASSWORD")

# A refused publish or request gets no answer: it fails when its wait for one ends. The
# refusal itself is the server's permissions violation, which each check reads from the
# connection's errors; so the refused ones wait this long, not the reads' 2 s.
REFUSED_WAIT = 0.5


def forger(nc: NATS) -> KeyValue:
    """The state bucket, for a put that is to be refused (it gives up after REFUSED_WAIT)."""
    return KeyValue(
        name=STATE_BUCKET,
        stream=f"KV_{STATE_BUCKET}",
        pre=f"$KV.{STATE_BUCKET}.",
        js=nc.jetstream(timeout=REFUSED_WAIT),
        direct=True,
    )


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    u = Up(tmp_path)
    u.start()
    try:  # stopped also when it never became ready
        assert u.proc is not None
        wait_ready(u.proc, u.log)
        yield u
    finally:
        u.stop()


def cli(up: Up, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in env_without_key().items() if k not in NO_CREDENTIALS}
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-m", "jetloop.services.cli", *args, "--nats", up.url],
        cwd=up.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_roles_of_the_embedded_server(up: Up) -> None:
    store = up.cwd / ".jetloop"
    for name in ("nats-users.json", "nats-server.conf"):
        assert stat.S_IMODE((store / name).stat().st_mode) == 0o600, name

    # The README tour: the CLI in up's working directory connects with the store's credentials.
    out = await asyncio.to_thread(
        cli, up, "send", "--agent", "demo", "--session", "s1", "create ticket printer on fire"
    )
    assert out.returncode == 0, out.stderr
    assert "T-1" in out.stdout, out.stdout

    # A wrong password: one line that names the settings and shows no password.
    wrong = await asyncio.to_thread(
        cli,
        up,
        "events",
        "s1",
        "--no-follow",
        JETLOOP_NATS_USER="client",
        JETLOOP_NATS_PASSWORD="not-it",
    )
    assert wrong.returncode == 1, wrong
    lines = wrong.stderr.strip().splitlines()
    assert len(lines) == 1 and "JETLOOP_NATS_PASSWORD" in lines[0], wrong.stderr
    assert "not-it" not in wrong.stderr and "Traceback" not in wrong.stderr

    # No credentials: refused.
    anonymous = NATS()
    with pytest.raises(NatsError) as refused:
        await anonymous.connect(
            up.url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False
        )
    await anonymous.close()  # nats-py leaves the refused socket open otherwise
    assert "authorization" in str(refused.value).lower(), refused.value

    # The client role: starts a turn and reads its result.
    key = (store / "seal.key").read_text()
    client_url = url_as(up.url, store, "client")
    async with await Client.connect(client_url, sealer=Sealer([key_bytes(key)])) as c:
        h = await c.send("demo", "s2", "list tickets")
        res = await c.wait(h, timeout=30)
        assert res.text is not None and "T-1" in res.text, res

    # ... but cannot write state nor publish a step.
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        url_as(up.url, store, "client"),
        inbox_prefix=inbox_prefix("client"),  # the only inboxes this role may hear
        error_cb=on_error,
        max_reconnect_attempts=0,
    )
    try:
        js = nc.jetstream(timeout=2)
        kv = await js.key_value(STATE_BUCKET)
        steps_before = (await js.stream_info(STEPS_STREAM)).state.last_seq
        with pytest.raises(NatsError):
            await forger(nc).put("session.s1", b"forged")
        with pytest.raises(NatsError):
            await js.publish("jl.step.tool.demo.call.s1", b"forged", timeout=REFUSED_WAIT)
        await nc.flush()
        # (nats-py lowercases the server's error)
        violations = [e.lower() for e in errors if "permissions violation" in e.lower()]
        assert any(f"$kv.{STATE_BUCKET}.session.s1" in e for e in violations), errors
        assert any("jl.step.tool.demo.call.s1" in e for e in violations), errors
        assert (await js.stream_info(STEPS_STREAM)).state.last_seq == steps_before
        entry = None
        try:
            entry = await kv.get("session.s1")
        except KeyNotFoundError:
            pass
        assert entry is None or entry.value != b"forged"
    finally:
        await nc.close()

    # The operator role reads and writes nothing.
    errors.clear()
    nc = await nats.connect(
        url_as(up.url, store, "operator"),
        inbox_prefix=inbox_prefix("operator"),
        error_cb=on_error,
        max_reconnect_attempts=0,
    )
    try:
        js = nc.jetstream(timeout=2)
        assert (await js.stream_info(STEPS_STREAM)).config.name == STEPS_STREAM
        with pytest.raises(NatsError):
            await js.publish("jl.turn.demo.s3", b"{}", timeout=REFUSED_WAIT)
        await nc.flush()
        assert any("jl.turn.demo.s3" in e for e in errors), errors
    finally:
        await nc.close()

    # Not even a worker empties a state key's history (its first sealed state could then be
    # put back over revision 0): the purge API of the state bucket's stream is refused.
    errors.clear()
    nc = await nats.connect(url_as(up.url, store), error_cb=on_error, max_reconnect_attempts=0)
    try:
        js = nc.jetstream(timeout=2)
        before = (await js.stream_info(f"KV_{STATE_BUCKET}")).state.messages
        assert before > 0
        with pytest.raises(NatsError):
            await nc.jetstream(timeout=REFUSED_WAIT).purge_stream(
                f"KV_{STATE_BUCKET}", subject=f"$KV.{STATE_BUCKET}.session.s1"
            )
        await nc.flush()
        assert any(f"$js.api.stream.purge.kv_{STATE_BUCKET}" in e.lower() for e in errors), errors
        assert (await js.stream_info(f"KV_{STATE_BUCKET}")).state.messages >= before
    finally:
        await nc.close()


PLAIN_CLIENT = """
import asyncio, sys
import jetloop as jl

async def main() -> None:
    async with await jl.Client.connect(sys.argv[1]) as c:
        h = await c.send("demo", "p1", "list tickets")
        print((await c.wait(h, timeout=30)).status)

asyncio.run(main())
"""


async def test_a_program_beside_up_connects_with_a_plain_url(up: Up) -> None:
    """The README's client.py: a program run in up's directory gives a URL without a user and
    connects as the store's worker user; one whose credentials the server refuses is told so
    at once (before: both waited for ever, retrying in silence)."""
    env = {k: v for k, v in env_without_key().items() if k not in NO_CREDENTIALS}
    ran = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", PLAIN_CLIENT, up.url],
        cwd=up.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "completed", ran.stdout

    wrong = up.url.replace("nats://", "nats://client:not-it@")
    with pytest.raises(NotAuthorized) as refused:
        await asyncio.wait_for(Client.connect(wrong), 10)
    assert "JETLOOP_NATS_PASSWORD" in str(refused.value)


def cli_elsewhere(
    url: str, cwd: Path, *args: str, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    """The CLI where no store directory is, with no seal key in its environment."""
    assert not (cwd / ".jetloop").exists()
    env = {k: v for k, v in env_without_key().items() if k not in NO_CREDENTIALS}
    return subprocess.run(
        [sys.executable, "-m", "jetloop.services.cli", *args, "--nats", url],
        cwd=cwd,
        env={**env, **extra_env},
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_a_client_without_the_seal_key_decides_through_the_workers(
    up: Up, tmp_path: Path
) -> None:
    """Issue 13, finding 4: a program elsewhere with the `client` credential and no seal
    key approves and cancels with the CLI (the workers' control API does the writes and
    seals them; the decider is the `--by` it names), and still cannot put to `jl_state`."""
    store = up.cwd / ".jetloop"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    as_client = {
        "JETLOOP_NATS_USER": "client",
        "JETLOOP_NATS_PASSWORD": make_users(store)["client"],
    }
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    nc = await nats.connect(
        url_as(up.url, store, "client"),
        inbox_prefix=inbox_prefix("client"),  # the only inboxes this role may hear
        error_cb=on_error,
        max_reconnect_attempts=0,
    )
    c = Client(nc, verify=False)  # no sealer: a program without the key reads unchecked
    try:
        h = await c.send("demo", "ap", "close T-1")

        async def held() -> str | None:
            snap = await c.snapshot("ap")
            pending = [a for a in snap.approvals if a.status == "pending"] if snap else []
            return pending[0].approval_id if pending else None

        approval_id = await until(held, timeout=10)  # a snapshot waits out no timeout
        out = await asyncio.to_thread(
            cli_elsewhere,
            up.url,
            elsewhere,
            "approve",
            "ap",
            approval_id,
            "--by",
            "carol",
            **as_client,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"{approval_id}: approved by client", out.stdout
        res = await c.wait(h, timeout=30)
        assert res.text is not None and "closed" in res.text, res
        closes = await Vendor(up.cwd / "vendor.sqlite").request_counts("close_ticket")
        assert list(closes.values()) == [1], closes  # the approved tool ran once

        # A refusal is the control path's error, in one line.
        out = await asyncio.to_thread(
            cli_elsewhere, up.url, elsewhere, "approve", "ap", "nope", **as_client
        )
        assert out.returncode == 1, out
        assert out.stderr.strip().splitlines() == ["Error: no such approval: ap/nope"], out.stderr

        turn_id = await waiting_turn(c, "cx")
        out = await asyncio.to_thread(cli_elsewhere, up.url, elsewhere, "cancel", "cx", **as_client)
        assert out.returncode == 0, out.stderr
        assert f"turn {turn_id}: cancelled" in out.stdout, out.stdout
        await cancelled_then_next_completes(c, "cx", turn_id)

        # The same credential still cannot write state itself.
        with pytest.raises(NatsError):
            await forger(nc).put("session.ap", b"forged")
        await nc.flush()
        assert any(
            "permissions violation" in e and f"$kv.{STATE_BUCKET}.session.ap" in e for e in errors
        ), errors
    finally:
        await nc.close()


async def test_no_worker_to_decide_is_one_line(nats_ready: EmbeddedServer, tmp_path: Path) -> None:
    """Without the seal key and with no worker serving jl.control.*, a decision is one
    line that says to start one, never a traceback."""
    out = await asyncio.to_thread(cli_elsewhere, nats_ready.url, tmp_path, "approve", "s1", "a1")
    assert out.returncode == 1, out
    assert out.stderr.strip().splitlines() == [
        "Error: no worker serves the control API: start one (jetloop up, or jetloop worker "
        "with the session pool); nobody answered jl.control.approve"
    ], out.stderr


async def test_every_decision_goes_through_the_workers_without_the_key(
    client: Client, workers: WorkerFactory
) -> None:
    """A Python client without a sealer asks the workers for every decision (reject, answer,
    approval policy, cancel, reconcile): the records they write verify under the workers'
    key, the decider is the one the request names, and a refusal is the direct path's
    ControlError (status, title, detail)."""
    workers.start()
    bare = Client(client.nc)  # the same connection, no seal key

    policy = await bare.set_approval("kp", "pay", True, agent="tester")
    assert policy.approval_overrides == {"pay": True}

    h = await client.send("tester", "kr", script([call("guarded", name="g")]))
    snap = await until(lambda: held(client, "kr", "approvals"))
    rejected = await bare.reject("kr", snap.approvals[0].approval_id, by="dave", reason="no")
    assert (rejected.status, rejected.decided_by, rejected.reason) == ("rejected", "dave", "no")
    res = await client.wait(h, timeout=30)
    assert body(res.text)["seen"][0]["status"] == "denied", res.text

    h = await client.send("tester", "kq", script([call("ask_user", question="Which?")]))
    snap = await until(lambda: held(client, "kq", "questions"))
    answered = await bare.answer("kq", snap.questions[0].question_id, "blue", by="erin")
    assert (answered.answer, answered.answered_by) == ("blue", "erin")
    res = await client.wait(h, timeout=30)
    assert body(res.text)["seen"][0]["result"] == {"answer": "blue"}, res.text

    for session in ("kp", "kr", "kq"):  # what the workers wrote verifies under their key
        snap = await client.snapshot(session)
        assert snap is not None and snap.untrusted == [], snap

    with pytest.raises(ControlError) as refused:
        await bare.cancel("kr")
    assert (refused.value.status, refused.value.title) == (409, "no running turn")
    with pytest.raises(ControlError) as refused:
        await bare.reconcile("kr.t.1.0", True, result={"ok": 1})
    assert (refused.value.status, refused.value.title) == (404, "no such call")


async def test_a_busy_worker_is_asked_again(client: Client) -> None:
    """A worker that could not reach the servers just then answers 503: the client repeats
    the (idempotent) request while it may, then says so as the control path's error. Here
    the test answers in the workers' place on a server without permissions."""
    asked: list[dict[str, Any]] = []
    record = {
        "approval_id": "a1",
        "session_id": "s1",
        "turn_id": "t1",
        "model_step": 1,
        "call_index": 0,
        "call_key": "s1.t1.1.0",
        "tool": "guarded",
        "status": "approved",
        "requested_at": 1.0,
        "decided_by": "gil",
    }
    busy = {"ok": False, "error": {"status": 503, "title": "NATS unavailable", "detail": "x"}}

    async def answer(msg: Msg) -> None:
        asked.append(json.loads(msg.data))
        reply = (
            busy if len(asked) == 1 or asked[-1]["by"] == "hal" else {"ok": True, "result": record}
        )
        await msg.respond(json.dumps(reply).encode())

    sub = await client.nc.subscribe("jl.control.approve", cb=answer)
    try:
        got = await Client(client.nc).approve("s1", "a1", by="gil")
        assert got == ApprovalRecord.model_validate(record)
        assert [a["by"] for a in asked] == ["gil", "gil"]
        with pytest.raises(ControlError) as refused:
            await Client(client.nc, retry_for=0.5).approve("s1", "a1", by="hal")
        assert (refused.value.status, refused.value.title) == (503, "NATS unavailable")
    finally:
        await sub.unsubscribe()


async def held(c: Client, session: str, what: str) -> SessionSnapshot | None:
    snap = await c.snapshot(session)
    return snap if snap is not None and getattr(snap, what) else None


def test_a_user_without_a_password_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"JETLOOP_NATS_PASSWORD: .*JETLOOP_NATS_USER"):
        load_settings(store_dir=tmp_path, nats_user="client")


def test_credentials_come_from_the_settings_else_the_store(tmp_path: Path) -> None:
    """Auth goes into the URLs only when there are credentials (a harness server has none)."""
    assert load_settings(store_dir=tmp_path, nats_url="nats://h:1").nats_urls == ["nats://h:1"]
    worker = make_users(tmp_path)["worker"]
    s = load_settings(store_dir=tmp_path, nats_url="nats://h:1,nats://g:2")
    assert s.nats_urls == [f"nats://worker:{worker}@h:1", f"nats://worker:{worker}@g:2"]
    assert s.nats_url == "nats://h:1,nats://g:2"  # what logs may show
    s = load_settings(
        store_dir=tmp_path, nats_user="client", nats_password="p/w", nats_url="nats://h:1"
    )
    assert s.nats_urls == ["nats://client:p%2Fw@h:1"]


async def test_credentials_for_servers_started_elsewhere(tmp_path: Path) -> None:
    """`jetloop credentials` (what compose.yaml runs first) makes the seal key and the users
    once (0600; a second run keeps them) and writes the config a node starts with
    (`--config`, as in compose.yaml): no credential is refused, a
    process with JETLOOP_STORE_DIR connects as worker, and the client role cannot write state."""
    store = tmp_path / "secrets"
    env = {k: v for k, v in env_without_key().items() if k not in NO_CREDENTIALS}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "jetloop.services.cli",
                "credentials",
                "--store-dir",
                str(store),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    first = await asyncio.to_thread(run)
    assert first.returncode == 0, first.stderr
    users = make_users(store)
    key = (store / "seal.key").read_text()
    second = await asyncio.to_thread(run)
    assert second.returncode == 0, second.stderr
    assert make_users(store) == users and (store / "seal.key").read_text() == key
    for name in ("seal.key", "nats-users.json", "nats-server.conf"):
        assert stat.S_IMODE((store / name).stat().st_mode) == 0o600, name
    for secret in (key, *users.values()):
        assert secret not in first.stdout + first.stderr

    server = EmbeddedServer(  # a server started with --config, as each compose node is
        tmp_path / "node1",
        port=free_port(),
        name="node1",
        config_file=store / "nats-server.conf",
        auth=("worker", users["worker"]),
    )
    server.start()
    try:
        anonymous = NATS()
        with pytest.raises(NatsError, match=r"(?i)authorization"):
            await anonymous.connect(
                server.url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False
            )
        await anonymous.close()
        s = load_settings(nats_url=server.url, store_dir=store)
        assert s.nats_user in (None, "worker") and s.nats_password is not None
        worker = await nats.connect(s.nats_urls[0], max_reconnect_attempts=0)
        try:
            await prepare(worker, load_settings().topology())
        finally:
            await worker.close()
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        client_nc = await nats.connect(
            url_as(server.url, store, "client"),
            inbox_prefix=inbox_prefix("client"),
            error_cb=on_error,
            max_reconnect_attempts=0,
        )
        try:
            with pytest.raises(NatsError):
                await forger(client_nc).put("session.s1", b"forged")
            await client_nc.flush()
            assert any(
                "permissions violation" in e and f"$kv.{STATE_BUCKET}.session.s1" in e
                for e in errors
            ), errors
        finally:
            await client_nc.close()
    finally:
        server.stop()


async def test_a_worker_whose_connection_closes_exits(tmp_path: Path) -> None:
    """Issue 13, finding 1: nats-py never reopens a connection the server closed with an
    error (here: the worker's password was rotated and the server reloaded its config, so it
    drops the connection with 'Authorization Violation'). The worker must not stay up doing
    nothing: it logs why and exits non-zero, so its supervisor starts a fresh one."""
    store = tmp_path / "store"
    store.mkdir()
    conf = tmp_path / "reloadable.conf"

    def write_reloadable() -> None:
        # nats-server reloads a config only if it names the server as the command line does.
        config = json.loads(write_config(store).read_text())
        conf.write_text(json.dumps({**config, "server_name": "jetloop"}))

    write_reloadable()
    users = make_users(store)
    server = EmbeddedServer(
        tmp_path / "srv", port=free_port(), config_file=conf, auth=("worker", users["worker"])
    )
    server.start()
    try:
        nc = await nats.connect(url_as(server.url, store), max_reconnect_attempts=0)
        try:
            await prepare(nc, load_settings().topology())
        finally:
            await nc.close()
        env = {k: v for k, v in env_without_key().items() if k not in NO_CREDENTIALS}
        w = WorkerProcess(
            server.url,
            "tests.apps:app",
            tmp_path / "w.log",
            worker_id="wc",
            env={**env, "JETLOOP_STORE_DIR": str(store), "JETLOOP_SEAL_KEY": "0f" * 32},
        ).start()
        await w.wait_for("worker.started", timeout=30)

        rotated = {**users, "worker": "rotated-" + users["worker"]}
        (store / "nats-users.json").write_text(json.dumps(rotated))
        write_reloadable()
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGHUP)  # reload: the old password is no longer valid

        async def exited() -> bool:
            return not w.alive()

        await until(exited, timeout=20)
        assert w.proc is not None and w.proc.returncode not in (0, None), w.tail()
        assert w.find("worker.connection_closed"), w.tail()
    finally:
        server.stop()
