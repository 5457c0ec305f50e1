"""Tenants on one `jetloop up` (issue 51): ids are unique only within a namespace.

Two namespaces may use the same session id and request id, and so have the same turn id;
their calls still reach a vendor under two idempotency keys, and each tool is told its
namespace. A namespace may be served by an app of its own (JETLOOP_NAMESPACE_APPS) while the
others keep JETLOOP_APP; the demo keeps each namespace's tickets apart. The seal key never
reaches a child's environment: nats-server starts without any JETLOOP_* variable, and a
child worker of `up --workers 2` reads the key from the store directory.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jetloop.services import namespaces
from jetloop.services.client import Client
from jetloop.services.embedded import free_port
from jetloop.services.natsauth import url_as
from jetloop.streams.seal import Sealer, key_bytes
from tests.conftest import call, script, until
from tests.test_namespaces import cli, url_of
from tests.test_seal_key import Up, env_without_key
from tests.test_up import events, field, wait_ready

ROOT = Path(__file__).resolve().parent.parent
# The key a user set in up's environment (the tenants' `up`).
USERS_KEY = "5a" * 32
TENANT_APP = "tests.apps:tenant_app"


def environ_of(pid: int) -> dict[str, str]:
    """The environment a process was started with (``/proc/<pid>/environ``)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(): v.decode(errors="replace") for k, _, v in pairs}


def children_of(pid: int) -> dict[int, str]:
    """The live child processes of ``pid``, by pid, with their command lines."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(stat.parent.name)] = cmdline
    return out


def nats_server_of(up: Up) -> int:
    assert up.proc is not None
    [pid] = [p for p, cmd in children_of(up.proc.pid).items() if "nats-server" in cmd]
    return pid


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """One `up` (the user set its seal key) serving the default namespace and `c` with the
    demo, and `a` and `b` with the tenant app."""
    cwd = tmp_path_factory.mktemp("tenants")
    u = Up(
        cwd,
        gateway_port=free_port(),
        env={
            "JETLOOP_SEAL_KEY": USERS_KEY,
            "JETLOOP_NAMESPACE_APPS": f"a={TENANT_APP},b={TENANT_APP}",
            "PYTHONPATH": str(ROOT),
        },
    )
    u.start()
    try:
        assert u.proc is not None
        wait_ready(u.proc, u.log)
        for ns in ("a", "b", "c"):
            out = cli(cwd, "namespace", "create", ns)
            assert out.returncode == 0, out.stderr
        yield u
    finally:
        u.stop()


async def client_of(up: Up, namespace: str, agent: str) -> Client:
    """A client of ``namespace`` (verifying under the user's key) once ``agent`` is served
    there."""
    store = up.cwd / ".jetloop"
    if namespace == namespaces.DEFAULT:
        url = url_as(up.url, store)
    else:
        cred = namespaces.read_credential(store, namespace)
        assert cred is not None
        url = url_of(up, cred)

    async def ready() -> Client | None:
        try:
            c = await Client.connect(url, sealer=Sealer([key_bytes(USERS_KEY)]), give_up_after=2)
        except Exception:
            return None
        try:
            workers = await (await c.registry()).workers()
        except Exception:
            workers = []
        if any(agent in w.agents for w in workers):
            return c
        await c.close()
        return None

    c: Client = await until(ready, timeout=60)
    return c


def seen_results(text: str | None) -> list[object]:
    """The tool results the test model saw, from its answer (``tests.apps.script``)."""
    assert text is not None
    return [s["result"] for s in json.loads(text.split("\n", 1)[1])["seen"]]


def vendor_rows(up: Up, op: str) -> list[tuple[str, str]]:
    """(idempotency key, payload) of every request of ``op`` the shared vendor received."""
    with sqlite3.connect(up.cwd / "vendor.sqlite") as db:
        rows = db.execute(
            "SELECT idem_key, payload FROM requests WHERE op = ? ORDER BY id", (op,)
        ).fetchall()
    return [(str(k), str(p)) for k, p in rows]


async def test_same_ids_in_two_namespaces_reach_a_vendor_as_two_keys(tenants: Up) -> None:
    """`a` and `b` send the same session id and request id: the same turn id in each, but the
    deduping vendor gets two keys, applies both writes, and each tenant gets its own result
    (not the other's)."""
    ca, cb = await client_of(tenants, "a", "tenant"), await client_of(tenants, "b", "tenant")
    try:
        handles = {}
        for ns, c in (("a", ca), ("b", cb)):
            text = script([call("tenant_write", name=f"order of {ns}")])
            handles[ns] = (c, await c.send("tenant", "same", text, request_id="r-1"))
        assert handles["a"][1].turn_id == handles["b"][1].turn_id
        for ns, (c, h) in handles.items():
            done = await c.wait(h, timeout=60)
            assert seen_results(done.text) == [
                {"op": "tenant_write", "name": f"order of {ns}", "namespace": ns}
            ], done.text
    finally:
        await ca.close()
        await cb.close()
    rows = [r for r in vendor_rows(tenants, "tenant_write") if "order of" in r[1]]
    keys = {k for k, _ in rows}
    assert len(keys) == 2, rows


async def test_a_tool_sees_its_namespace(tenants: Up) -> None:
    """The tool context names the namespace the call's session lives in."""
    c = await client_of(tenants, "b", "tenant")
    try:
        h = await c.send("tenant", "who", script([call("tenant_write", name="who am i")]))
        assert (await c.wait(h, timeout=60)).text is not None
    finally:
        await c.close()
    payloads = [json.loads(p) for _, p in vendor_rows(tenants, "tenant_write")]
    assert [p["namespace"] for p in payloads if p["name"] == "who am i"] == ["b"]


async def test_a_namespace_served_by_its_own_app(tenants: Up) -> None:
    """`a` is served by the app JETLOOP_NAMESPACE_APPS names for it, `c` (named nowhere) and
    the default namespace by JETLOOP_APP (the demo)."""
    for ns, agent, other in (("a", "tenant", "demo"), ("c", "demo", "tenant")):
        c = await client_of(tenants, ns, agent)
        try:
            served = {a for w in await (await c.registry()).workers() for a in w.agents}
            assert agent in served and other not in served, (ns, served)
        finally:
            await c.close()
    d = await client_of(tenants, namespaces.DEFAULT, "demo")
    try:
        served = {a for w in await (await d.registry()).workers() for a in w.agents}
        assert served == {"demo"}, served
    finally:
        await d.close()


async def test_the_demo_keeps_each_namespaces_tickets_apart(tenants: Up) -> None:
    """A ticket made in the default namespace is not listed in `c`, whose first ticket is its
    own T-1."""
    d = await client_of(tenants, namespaces.DEFAULT, "demo")
    c = await client_of(tenants, "c", "demo")
    try:
        h = await d.send("demo", "mine", "create ticket default secret")
        assert "default secret" in ((await d.wait(h, timeout=60)).text or "")
        h = await c.send("demo", "theirs", "list tickets; create ticket c's own")
        text = (await c.wait(h, timeout=60)).text or ""
        assert "default secret" not in text, text
        assert '"id": "T-1", "status": "open", "title": "c\'s own"' in text, text
    finally:
        await d.close()
        await c.close()


def test_users_seal_key_is_not_given_to_nats_server(tenants: Up) -> None:
    """A seal key the user put in up's environment is not in nats-server's."""
    assert tenants.proc is not None
    assert environ_of(tenants.proc.pid)["JETLOOP_SEAL_KEY"] == USERS_KEY
    env = environ_of(nats_server_of(tenants))
    assert not [k for k in env if k.startswith("JETLOOP_")], sorted(env)


async def test_seal_key_stays_out_of_childrens_environment(tmp_path: Path) -> None:
    """`up --workers 2` with the key it keeps: neither nats-server nor the child worker has
    it in its environment; the child reads it from the store directory (it never warns that
    it writes unsealed) and serves, and turns complete under a client that verifies."""
    up = Up(tmp_path, gateway_port=free_port(), env={"JETLOOP_WORKER_PROCESSES": "2"})
    up.start()
    try:
        c = await up.client()
        assert up.proc is not None
        own = f"{socket.gethostname()}-{up.proc.pid}"
        try:

            async def both() -> bool:
                live = {w.worker_id for w in await (await c.registry()).workers()}
                return {own, f"{own}-2"} <= live

            await until(both, 60)
            handles = [await c.send("demo", f"s{i}", "create ticket sealed") for i in range(6)]
            for h in handles:
                assert "T-" in ((await c.wait(h, timeout=60)).text or "")
        finally:
            await c.close()
        [started] = events(up.log, "worker.process_started", child=f"{own}-2")
        child = int(field(started, "pid"))
        # (Up's own /proc environ is what it was started with: not what it set since.)
        for pid in (child, nats_server_of(up)):
            assert "JETLOOP_SEAL_KEY" not in environ_of(pid), pid
        assert not events(up.log, "worker.unsealed"), up.log.read_text()[-3000:]
    finally:
        up.stop()


def test_a_namespace_app_that_does_not_load_is_named(tmp_path: Path) -> None:
    """`up --namespace-app b=…` whose app does not load: up refuses to start, in one line
    naming the setting and the namespace."""
    port = free_port()
    out = subprocess.run(
        [
            *(sys.executable, "-m", "jetloop.services.cli", "up", "--port", str(port)),
            *("--namespace-app", "b=no_such_module:app"),
        ],
        cwd=tmp_path,
        env=env_without_key(JETLOOP_GATEWAY_PORT="0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "JETLOOP_NAMESPACE_APPS / --namespace-app b=no_such_module:app" in out.stderr, out
