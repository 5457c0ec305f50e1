"""Namespaces (issue 32): two namespaces on one `jetloop up`, kept apart by the NATS server.

With `b`'s credentials nothing of `a` can be heard, listed, read, created or decided, and
the CLI aimed at `a` with them is refused in one line; with `a`'s credential the held
approval is decided, recorded as decided by `a`'s user (the credential's, not what the
message says), and the turn completes. Namespaces made while `up` runs are served at once.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from jetloop.services import namespaces
from jetloop.services.client import Client
from jetloop.services.namespaces import Credential
from jetloop.streams.connection import inbox_prefix
from jetloop.streams.topology import EVENTS_STREAM, STATE_BUCKET
from tests.conftest import until
from tests.test_bus_attack import up as up  # the fixture: `jetloop up` with a gateway
from tests.test_nats_auth import NO_CREDENTIALS
from tests.test_seal_key import Up, env_without_key


def url_of(up: Up, cred: Credential) -> str:
    return f"nats://{cred.user}:{urllib.parse.quote(cred.password, safe='')}@127.0.0.1:{up.port}"


def cli(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in env_without_key().items() if k not in NO_CREDENTIALS}
    return subprocess.run(
        [sys.executable, "-m", "jetloop.services.cli", *args],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def as_user(cred: Credential) -> dict[str, str]:
    return {"JETLOOP_NATS_USER": cred.user, "JETLOOP_NATS_PASSWORD": cred.password}


async def served(up: Up, cred: Credential) -> Client:
    """A client of the namespace once its worker serves the demo agent there."""

    async def ready() -> Client | None:
        try:
            c = await Client.connect(url_of(up, cred), verify=False, give_up_after=2)
        except Exception:
            return None
        try:
            workers = await (await c.registry()).workers()
        except Exception:
            workers = []
        if any("demo" in w.agents for w in workers):
            return c
        await c.close()
        return None

    return await until(ready, timeout=30)


async def test_two_namespaces_on_one_up_are_kept_apart(
    up: Up, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This process is a program elsewhere: no store directory, no seal key.
    monkeypatch.setenv("JETLOOP_STORE_DIR", str(tmp_path / "elsewhere" / ".jetloop"))
    monkeypatch.delenv("JETLOOP_SEAL_KEY", raising=False)
    store = up.cwd / ".jetloop"
    for ns in ("a", "b"):
        out = await asyncio.to_thread(cli, up.cwd, "namespace", "create", ns)
        assert out.returncode == 0, out.stderr
        path = store / "namespaces" / f"{ns}.json"
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        assert json.loads(path.read_text())["user"] == f"{ns}.client"
    a = namespaces.read_credential(store, "a")
    b = namespaces.read_credential(store, "b")
    b_worker = namespaces.read_credential(store, "b", namespaces.WORKER)
    assert a is not None and b is not None and b_worker is not None
    listed = await asyncio.to_thread(cli, up.cwd, "namespace", "list", "--json")
    assert list(json.loads(listed.stdout)) == ["default", "a", "b"], listed

    ca, cb = await served(up, a), await served(up, b)
    heard_by_b: list[Msg] = []

    async def hear(msg: Msg) -> None:
        heard_by_b.append(msg)

    # b's client hears what it may (its inboxes, live text); b's workers' credential may
    # hear everything of its account: neither hears anything of a.
    nb = await nats.connect(
        url_of(up, b), inbox_prefix=inbox_prefix(b.user), max_reconnect_attempts=0
    )
    nbw = await nats.connect(url_of(up, b_worker), max_reconnect_attempts=0)
    try:
        await nb.subscribe("jl.live.>", cb=hear)
        await nb.subscribe(f"{inbox_prefix(b.user)}.>", cb=hear)
        await nbw.subscribe(">", cb=hear)
        await nb.flush()
        await nbw.flush()

        h = await ca.send("demo", "sa", "close T-1")
        done = await ca.send("demo", "sa2", "create ticket printer on fire")
        assert (await ca.wait(done, timeout=30)).text is not None

        async def held() -> str | None:
            snap = await ca.snapshot("sa")
            pending = [x for x in snap.approvals if x.status == "pending"] if snap else []
            return pending[0].approval_id if pending else None

        approval_id = await until(held)
        mine = await cb.send("demo", "sb", "create ticket in b")
        assert (await cb.wait(mine, timeout=30)).text is not None
        await nbw.flush()
        assert heard_by_b, "b's own traffic is heard: the subscription works"
        leaked = [
            m.subject
            for m in heard_by_b
            if "sa" in m.subject.split(".") or b"sa2" in m.data or b"close T-1" in m.data
        ]
        assert leaked == [], leaked

        # KV key listing, direct gets and consumer creation show nothing of a.
        js = nbw.jetstream()
        kv = KeyValue(
            name=STATE_BUCKET,
            stream=f"KV_{STATE_BUCKET}",
            pre=f"$KV.{STATE_BUCKET}.",
            js=js,
            direct=True,
        )
        keys = await kv.keys()
        assert keys and not [k for k in keys if "sa" in k.split(".")], keys
        with pytest.raises(NotFoundError):
            await js.get_msg(
                f"KV_{STATE_BUCKET}", subject=f"$KV.{STATE_BUCKET}.session.sa", direct=True
            )
        info = await js.add_consumer(
            EVENTS_STREAM,
            api.ConsumerConfig(filter_subject="jl.event.sa.>", ack_policy=api.AckPolicy.NONE),
        )
        assert info.num_pending == 0, info
        names = await js.streams_info()
        assert all(s.config.name and not s.config.name.startswith("KV_a") for s in names)
    finally:
        await nb.close()
        await nbw.close()

    # The CLI with b's credential, aimed at a: refused in one line each.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    url = ["--nats", f"nats://127.0.0.1:{up.port}", "--namespace", "a"]
    refusals = (
        ["snapshot", "sa"],
        ["approve", "sa", approval_id],
        ["answer", "sa", "q1", "yes"],
        ["cancel", "sa"],
        ["send", "--agent", "demo", "--session", "sa", "hello"],
    )
    outs = await asyncio.gather(
        *(asyncio.to_thread(cli, elsewhere, *args, *url, **as_user(b)) for args in refusals)
    )
    for args, out in zip(refusals, outs, strict=True):
        assert out.returncode == 1, (args, out)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "namespace 'b', not 'a'" in lines[0], (args, out.stderr)
    # Without naming a, b's credential acts in b, where a's session is not.
    out = await asyncio.to_thread(
        cli, elsewhere, "snapshot", "sa", "--nats", f"nats://127.0.0.1:{up.port}", **as_user(b)
    )
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out
    assert await cb.snapshot("sa") is None

    # With a's credential the approval is decided, by a's user whatever the message says.
    record = await ca.approve("sa", approval_id, by="mallory")
    assert record.status == "approved" and record.decided_by == "a.client", record
    res = await ca.wait(h, timeout=30)
    assert res.text is not None and "closed" in res.text, res

    # A person of a decides as themself, with a credential of their own.
    made = await asyncio.to_thread(cli, up.cwd, "namespace", "credential", "a", "alice")
    assert made.returncode == 0, made.stderr
    alice = namespaces.read_credential(store, "a", "alice")
    assert alice is not None and alice.user == "a.alice"
    h2 = await ca.send("demo", "sa3", "close T-1")

    async def held2() -> str | None:
        snap = await ca.snapshot("sa3")
        pending = [x for x in snap.approvals if x.status == "pending"] if snap else []
        return pending[0].approval_id if pending else None

    approval2 = await until(held2)

    async def approved_by_alice() -> subprocess.CompletedProcess[str] | None:
        out = await asyncio.to_thread(
            cli,
            elsewhere,
            "approve",
            "sa3",
            approval2,
            "--by",
            "mallory",
            "--nats",
            f"nats://127.0.0.1:{up.port}",
            **as_user(alice),
        )
        return out if out.returncode == 0 else None  # until up has let alice in

    out = await until(approved_by_alice)
    assert out.stdout.strip() == f"{approval2}: approved by a.alice", out.stdout
    assert (await ca.wait(h2, timeout=30)).text is not None
    await ca.close()
    await cb.close()


def test_namespace_names_and_credentials(tmp_path: Path) -> None:
    """A name no account, user or file can hold is refused in one line; a namespace is made
    once; its credentials are 0600 and name their users; the default one is always there."""
    store = tmp_path / ".jetloop"
    bads = ("", "A", "a.b", "../x", "-a", "x" * 41, "a b")
    # Refused, so independent of one another: run side by side.
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda bad: cli(tmp_path, "namespace", "create", bad), bads))
    for bad, out in zip(bads, outs, strict=True):
        assert out.returncode != 0 and len(out.stderr.strip().splitlines()) >= 1, (bad, out)
        assert "Traceback" not in out.stderr, out.stderr
    made = cli(tmp_path, "namespace", "create", "acme")
    assert made.returncode == 0, made.stderr
    again = cli(tmp_path, "namespace", "create", "acme")
    assert again.returncode == 1 and again.stderr.strip() == "Error: namespace 'acme' exists"
    with ThreadPoolExecutor(2) as pool:
        reserved = pool.map(
            lambda who: cli(tmp_path, "namespace", "credential", "acme", who),
            ("worker", "operator"),
        )
        nope = pool.submit(cli, tmp_path, "namespace", "credential", "nope", "alice")
        for out in reserved:
            assert out.returncode == 1 and "reserved" in out.stderr, out
        out = nope.result()
    assert out.returncode == 1 and "no namespace 'nope'" in out.stderr, out
    assert cli(tmp_path, "namespace", "credential", "acme", "alice").returncode == 0
    for path in (store / "namespaces").glob("*.json"):
        assert oct(path.stat().st_mode & 0o777) == "0o600", path
    assert namespaces.names(store) == ["default", "acme"]
    assert namespaces.identities(store, "acme") == ["alice", "client"]
    listed = json.loads(cli(tmp_path, "namespace", "list", "--json").stdout)
    assert listed["acme"]["users"] == ["acme.alice", "acme.client"]
    # The CLI refuses a namespace that is not one before it connects anywhere.
    out = cli(tmp_path, "--namespace", "Bad!", "snapshot", "s1")
    assert out.returncode == 2 and "is not a name" in out.stderr, out


def test_a_name_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    """A name followed by a newline is no name (a regex's ``$`` matches before one): refused
    as a namespace, an identity and by the CLI, and a file named so is no namespace; `up`
    would otherwise meet an account it cannot start with."""
    store = tmp_path / ".jetloop"
    for bad in ("a\n", "a\r\n", "\na"):
        with pytest.raises(namespaces.NamespaceError, match="is not a name"):
            namespaces.check_name(bad)
        with pytest.raises(namespaces.NamespaceError, match="is not a name"):
            namespaces.create(store, bad)
    with pytest.raises(namespaces.NamespaceError, match="is not a name"):
        namespaces.check_identity("bob\n")
    out = cli(tmp_path, "namespace", "create", "a\n")
    assert out.returncode == 1 and "is not a name" in out.stderr, out
    assert namespaces.create(store, "a").user == "a.client"
    with pytest.raises(namespaces.NamespaceError, match="is not a name"):
        namespaces.add_identity(store, "a", "bob\n")
    # Made by hand: neither a namespace nor an identity.
    (store / "namespaces" / "x\n.worker.json").write_text("{}")
    (store / "namespaces" / "a.bob\n.json").write_text("{}")
    assert namespaces.names(store) == ["default", "a"]
    assert namespaces.identities(store, "a") == ["client"]


def test_deleting_a_namespace_says_what_it_removes(tmp_path: Path) -> None:
    """Deleting is explicit (asked, or --yes), refused while an `up` holds the store, and
    removes the namespace's data and every credential in it; the default one stays."""
    store = tmp_path / ".jetloop"
    assert cli(tmp_path, "namespace", "create", "gone").returncode == 0
    assert cli(tmp_path, "namespace", "credential", "gone", "bob").returncode == 0
    data = store / namespaces.JETSTREAM_DIR / "gone" / "streams"
    data.mkdir(parents=True)
    asked = cli(tmp_path, "namespace", "delete", "gone")  # no --yes, no answer: nothing goes
    assert asked.returncode == 1 and "Aborted" in asked.stderr, asked
    assert "gone.bob" in asked.stdout and data.exists()
    from jetloop.services.up import lock_store, release_store

    lock = lock_store(store)
    try:
        held = cli(tmp_path, "namespace", "delete", "gone", "--yes")
        assert held.returncode == 1 and "stop it first" in held.stderr, held
    finally:
        release_store(lock)
    done = cli(tmp_path, "namespace", "delete", "gone", "--yes")
    assert done.returncode == 0, done.stderr
    assert not data.parent.exists() and not list((store / "namespaces").glob("gone*"))
    assert namespaces.names(store) == ["default"]
    out = cli(tmp_path, "namespace", "delete", "default", "--yes")
    assert out.returncode == 1 and "cannot be deleted" in out.stderr, out


def test_create_beside_an_up_on_servers_of_the_users_own_does_not_wait(tmp_path: Path) -> None:
    """An `up` that dials the user's servers (`JETLOOP_NATS_URL`) cannot make them know a new
    account: `namespace create` says what serves it and returns at once, instead of waiting
    30 s to fail. An address file of an older `up` (no "embedded") is one that runs its
    server, as every `up` before did."""
    from jetloop.services import listening

    store = tmp_path / ".jetloop"
    store.mkdir()
    # This test's process stands for the running `up` (its pid is alive).
    listening.record(store, "nats://127.0.0.1:1", None, embedded=False)
    out = cli(tmp_path, "namespace", "create", "acme")
    assert out.returncode == 0, out.stderr
    assert "serves it once your NATS servers know its account" in out.stdout, out.stdout
    found = listening.running(store)
    assert found is not None and not found.embedded
    body = json.loads((store / listening.LISTENING_FILE).read_text())
    del body["embedded"]
    (store / listening.LISTENING_FILE).write_text(json.dumps(body))
    older = listening.running(store)
    assert older is not None and older.embedded
