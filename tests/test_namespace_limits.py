"""Namespace limits (issue 51): what one namespace may use of the server, enforced by it.

A namespace's client credential that publishes big turn requests for an agent nobody serves
fills its own storage limit, not the disk: past it the server refuses the namespace's writes
(the Python client and the gateway say which limit, and what to do), while another
namespace's turns complete. A limit changed while `up` runs is applied within seconds; the
CLI shows the limits and refuses a bad value in one line naming its flag.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from nats.errors import NoRespondersError
from nats.js.errors import APIError

from jetloop.schemas.errors import ControlError
from jetloop.services import namespaces
from jetloop.services.client import ACCOUNT_LIMIT_REACHED
from jetloop.services.embedded import free_port
from jetloop.services.natsauth import make_users, server_config
from jetloop.streams.connection import inbox_prefix
from jetloop.streams.topology import turn_subject
from tests.conftest import until
from tests.test_namespaces import cli, served, url_of
from tests.test_seal_key import Up
from tests.test_up import wait_ready

MiB = 1024 * 1024
# A turn request about as large as the server takes (its max_payload is 1 MiB).
BIG = b"x" * (900 * 1024)
TOKEN = secrets.token_urlsafe(32)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    """`jetloop up` with namespaces a and b (default limits), and a gateway token for both."""
    for ns in ("a", "b"):
        made = cli(tmp_path, "namespace", "create", ns)
        assert made.returncode == 0, made.stderr
    tokens = {TOKEN: {"name": "t", "scopes": ["read", "write"], "namespaces": ["a", "b"]}}
    u = Up(tmp_path, gateway_port=free_port(), env={"JETLOOP_GATEWAY_TOKENS": json.dumps(tokens)})
    u.start()
    try:  # stopped also when it never became ready
        assert u.proc is not None
        wait_ready(u.proc, u.log)
        yield u
    finally:
        u.stop()


async def account_limits(nc: Any) -> dict[str, Any]:
    """The account's JetStream limits as the server has them (``$JS.API.INFO``)."""
    info = json.loads((await nc.request("$JS.API.INFO", b"", timeout=5)).data)
    limits: dict[str, Any] = info["limits"]
    return limits


async def test_a_namespace_cannot_fill_anothers_disk(up: Up) -> None:
    """a's turn rate, set while `up` runs, makes a's workers again with it; b's storage
    limit, lowered while `up` runs, is applied within seconds; b's client
    credential flooding big turn requests for an agent nobody serves is refused at that
    limit (JetStream 10002), its next turn is refused by the client and the gateway with
    an error naming the limit and the command that raises it, and a's turns complete."""
    store = up.cwd / ".jetloop"
    a = namespaces.read_credential(store, "a")
    b = namespaces.read_credential(store, "b")
    assert a is not None and b is not None
    ca, cb = await served(up, a), await served(up, b)
    nb = await nats.connect(
        url_of(up, b), inbox_prefix=inbox_prefix(b.user), max_reconnect_attempts=0
    )
    try:
        # a's account has the defaults of a new namespace, and the topology fits in them.
        na = ca.nc
        got = await account_limits(na)
        assert got["max_storage"] == namespaces.Limits().max_file == 1024 * MiB, got
        assert got["max_streams"] == 32 and got["max_consumers"] == 1000, got

        # a's turn rate, set while `up` runs: a's workers are made again with it.
        rated = await asyncio.to_thread(
            cli, up.cwd, "namespace", "limits", "a", "--turn-rate", "50"
        )
        assert rated.returncode == 0, rated.stderr

        async def remade() -> bool:
            return any(
                "namespace.changed" in line and "namespace=a" in line and "50.0" in line
                for line in up.log.read_text().splitlines()
            )

        await until(remade, timeout=30)

        lowered = await asyncio.to_thread(
            cli, up.cwd, "namespace", "limits", "b", "--max-file", "4MiB"
        )
        assert lowered.returncode == 0, lowered.stderr

        async def applied() -> bool:
            try:
                return bool((await account_limits(nb))["max_storage"] == 4 * MiB)
            except NoRespondersError:
                # While the server takes the account's new claims, its JetStream API may
                # not answer for a moment (seen once in CI); the engine retries this too.
                return False

        await until(applied, timeout=30)

        # The flood, then ever smaller requests until not even a small one fits.
        js = nb.jetstream()
        refused: list[APIError] = []
        size, i = len(BIG), 0
        while size >= 16 and i < 200:
            i += 1
            try:
                await js.publish(turn_subject("nobody", f"flood{i}"), BIG[:size])
            except APIError as exc:
                refused.append(exc)
                size //= 2
        assert refused and {e.err_code for e in refused} == {ACCOUNT_LIMIT_REACHED}, refused

        with pytest.raises(ControlError) as caught:
            await cb.send("demo", "sb", "create ticket in b", will_wait=False)
        err = caught.value
        assert err.status == 507 and "'b' is at its storage limit (max_file)" in err.detail, err
        assert "of 4.0 MiB used" in err.detail and "namespace limits b --max-file" in err.detail

        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"http://127.0.0.1:{up.gateway_port}/v1/agents/demo/sessions/sb/messages"
                "?namespace=b",
                json={"text": "create ticket in b"},
                headers={"Authorization": f"Bearer {TOKEN}"},
            ) as resp:
                body = await resp.json(content_type=None)
                assert resp.status == 507, body
                assert resp.content_type == "application/problem+json", resp.content_type
        assert body["title"] == "namespace storage limit reached", body
        assert "max_file" in body["detail"] and "--max-file" in body["detail"], body

        # a is not touched: its turns complete.
        done = await ca.send("demo", "sa", "create ticket printer on fire")
        assert (await ca.wait(done, timeout=60)).text is not None

    finally:
        await nb.close()
        await ca.close()
        await cb.close()

    listed = json.loads(
        (await asyncio.to_thread(cli, up.cwd, "namespace", "list", "--json")).stdout
    )
    assert listed["b"]["limits"]["max_file"] == 4 * MiB, listed
    assert listed["a"]["limits"] == namespaces.Limits(turn_rate=50).model_dump()
    assert listed["default"]["limits"] == namespaces.NO_LIMITS.model_dump(), listed


def test_limits_are_shown_set_and_refused_in_one_line(tmp_path: Path) -> None:
    """`namespace create` and `namespace limits` take each limit as a flag (sizes with
    units, none for no limit), `namespace list` shows them, a bad value is one line naming
    its flag (and makes nothing), and the server's config gives each namespace's account
    its limits; a limits change changes what `up` compares to reload the server."""
    store = tmp_path / ".jetloop"
    bad = (
        (["create", "x", "--max-file", "12XB"], "--max-file '12XB'"),
        (["create", "x", "--max-consumers", "0"], "--max-consumers '0'"),
        (["create", "x", "--turn-rate", "fast"], "--turn-rate 'fast'"),
        (["create", "x", "--max-payload", "2MiB"], "--max-payload '2MiB'"),
        (["limits", "nope", "--max-file", "1GiB"], "no namespace 'nope'"),
    )
    for args, said in bad:
        out = cli(tmp_path, "namespace", *args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1 and said in lines[0], (args, out.stderr)
    assert namespaces.names(store) == ["default"]

    made = cli(tmp_path, "namespace", "create", "x", "--max-file", "512MiB", "--turn-rate", "2")
    assert made.returncode == 0, made.stderr
    assert "max-file=512MiB" in made.stdout and "turn-rate=2.0" in made.stdout, made.stdout
    path = namespaces.limits_path(store, "x")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    got = namespaces.read_limits(store, "x")
    assert got == namespaces.Limits(max_file=512 * MiB, turn_rate=2.0), got
    assert namespaces.identities(store, "x") == ["client"]  # the limits file is no identity
    assert cli(tmp_path, "namespace", "credential", "x", "limits").returncode == 1

    before = namespaces.listing(store)
    changed = cli(tmp_path, "namespace", "limits", "x", "--max-mem", "none", "--max-streams", "12")
    assert changed.returncode == 0, changed.stderr
    assert "max-mem\tnone" in changed.stdout and "max-streams\t12" in changed.stdout
    assert "max-file\t512MiB" in changed.stdout, changed.stdout
    assert namespaces.listing(store) != before
    listed = cli(tmp_path, "namespace", "list").stdout.splitlines()
    assert listed[0] == "default\tclient, operator\tno limits", listed
    assert listed[1].startswith("x\tx.client\tmax-file=512MiB max-streams=12 "), listed

    config = json.loads(server_config(make_users(store), store))
    account = config["accounts"]["x"]
    assert account["jetstream"] == {
        "max_file": 512 * MiB,
        "max_mem": -1,
        "max_streams": 12,
        "max_consumers": 1000,
    }, account
    assert account["limits"] == {"max_connections": 256, "max_subscriptions": 10_000}, account
    assert config["accounts"]["default"]["jetstream"] == "enabled"


def test_a_limits_file_that_is_not_one_is_refused_in_one_line(tmp_path: Path) -> None:
    """A hand-edited limits file that holds no limits is named with what is wrong in it."""
    store = tmp_path / ".jetloop"
    assert cli(tmp_path, "namespace", "create", "x").returncode == 0
    namespaces.limits_path(store, "x").write_text('{"max_file": "lots"}')
    with pytest.raises(
        namespaces.NamespaceError, match=r"x\.limits\.json holds no limits: max_file"
    ):
        namespaces.read_limits(store, "x")
    out = cli(tmp_path, "namespace", "list")
    assert out.returncode == 1 and "holds no limits" in out.stderr, out
