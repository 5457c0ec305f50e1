"""Each identity of a namespace hears only its own reply inboxes (issue 51).

The answers to an identity's requests (its decisions, its direct gets, its consumers'
deliveries) arrive in its inboxes: with one prefix shared by every identity of a namespace,
one could hear another's. Each identity now has a prefix of its own, and the server lets it
subscribe under that prefix alone; the default namespace's ``client`` keeps ``_INBOX_client``.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetloop.services import namespaces
from jetloop.services.client import Client
from jetloop.services.namespaces import Credential
from jetloop.services.natsauth import PERMISSIONS, client_permissions
from jetloop.streams.connection import inbox_prefix
from tests.conftest import until
from tests.test_bus_attack import up as up  # the fixture: `jetloop up` with a gateway
from tests.test_seal_key import Up


def test_each_identity_has_an_inbox_prefix_of_its_own() -> None:
    """A named identity's connection makes its inboxes under ``_INBOX_client_<who>``, and
    its permissions let it subscribe there alone; the client credential keeps
    ``_INBOX_client`` (old clients of the default namespace go on working)."""
    assert inbox_prefix("client") == "_INBOX_client"
    assert inbox_prefix("acme.client") == "_INBOX_client"
    assert inbox_prefix("acme.alice") == "_INBOX_client_alice"
    assert inbox_prefix("default.alice") == "_INBOX_client_alice"
    assert inbox_prefix("acme.worker") == "_INBOX"
    assert inbox_prefix("operator") == "_INBOX_operator"
    assert inbox_prefix("acme.alice") != inbox_prefix("acme.bob")
    inboxes = {
        who: [s for s in client_permissions(who)["subscribe"]["allow"] if s.startswith("_INBOX")]
        for who in ("client", "alice", "bob")
    }
    assert inboxes == {
        "client": ["_INBOX_client.>"],
        "alice": ["_INBOX_client_alice.>"],
        "bob": ["_INBOX_client_bob.>"],
    }
    assert PERMISSIONS["client"] == client_permissions("client")


class Plain:
    """A plain nats-py connection as one credential, with its own inbox prefix, keeping the
    server's errors (a refused subscription is one)."""

    def __init__(self, url: str, user: str) -> None:
        self.url, self.user = url, user
        self.errors: list[str] = []
        self.heard: list[Msg] = []
        self.nc = NATS()

    async def __aenter__(self) -> Plain:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc).lower())

        self.nc = await nats.connect(
            self.url,
            inbox_prefix=inbox_prefix(self.user),
            error_cb=on_error,
            max_reconnect_attempts=0,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    async def subscribe(self, subject: str) -> None:
        async def hear(msg: Msg) -> None:
            self.heard.append(msg)

        await self.nc.subscribe(subject, cb=hear)
        await self.nc.flush()

    def refused(self, subject: str) -> bool:
        return any(
            "permissions violation" in e and f'subscription to "{subject.lower()}"' in e
            for e in self.errors
        )


def url_of(up: Up, cred: Credential) -> str:
    return f"nats://{cred.user}:{urllib.parse.quote(cred.password, safe='')}@127.0.0.1:{up.port}"


@pytest.fixture
async def people(
    up: Up, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[dict[str, Credential]]:
    """The default namespace's client credential and two named identities, alice and bob,
    once up lets both in; this process is a program elsewhere (no store, no seal key)."""
    monkeypatch.setenv("JETLOOP_STORE_DIR", str(tmp_path / "elsewhere" / ".jetloop"))
    monkeypatch.delenv("JETLOOP_SEAL_KEY", raising=False)
    store = up.cwd / ".jetloop"
    creds = {
        "client": namespaces.read_credential(store, namespaces.DEFAULT),
        "alice": namespaces.add_identity(store, namespaces.DEFAULT, "alice"),
        "bob": namespaces.add_identity(store, namespaces.DEFAULT, "bob"),
    }

    async def let_in() -> bool:
        for cred in creds.values():
            assert cred is not None
            try:
                nc = await nats.connect(url_of(up, cred), max_reconnect_attempts=0)
            except Exception:
                return False  # until up has reloaded the server's users
            await nc.close()
        return True

    await until(let_in)
    yield {who: c for who, c in creds.items() if c is not None}


async def test_an_identity_cannot_hear_another_identitys_inboxes(
    up: Up, people: dict[str, Credential]
) -> None:
    """Alice may subscribe under her prefix and is refused bob's and the client's; the
    client is refused alice's. Each still works with its own: alice sends a turn held for
    approval, bob approves it (recorded as his), alice waits for the answer; and the client,
    listening on every inbox it may, hears none of bob's or alice's answers."""
    prefix = {who: inbox_prefix(c.user) for who, c in people.items()}
    assert len(set(prefix.values())) == 3, prefix
    async with (
        Plain(url_of(up, people["alice"]), people["alice"].user) as alice,
        Plain(url_of(up, people["client"]), people["client"].user) as client,
    ):
        for other in ("bob", "client"):
            await alice.subscribe(f"{prefix[other]}.>")
        await alice.subscribe(f"{prefix['alice']}.>")
        await client.subscribe(f"{prefix['alice']}.>")
        await client.subscribe(f"{prefix['client']}.>")  # its own: every answer it may hear

        async def refusals_said() -> bool:
            return (
                alice.refused(f"{prefix['bob']}.>")
                and alice.refused(f"{prefix['client']}.>")
                and client.refused(f"{prefix['alice']}.>")
            )

        assert await until(refusals_said, timeout=10), (alice.errors, client.errors)
        assert not alice.refused(f"{prefix['alice']}.>"), alice.errors
        assert not client.refused(f"{prefix['client']}.>"), client.errors

        # Each identity works with its own inboxes.
        ja = await Client.connect(url_of(up, people["alice"]), verify=False, give_up_after=5)
        jb = await Client.connect(url_of(up, people["bob"]), verify=False, give_up_after=5)
        try:
            h = await ja.send("demo", "inboxes", "close T-1")

            async def held() -> str | None:
                snap = await jb.snapshot("inboxes")
                pending = [x for x in snap.approvals if x.status == "pending"] if snap else []
                return pending[0].approval_id if pending else None

            approval_id = await until(held)
            record = await jb.approve("inboxes", approval_id, by="mallory")
            assert record.decided_by == "default.bob", record
            res = await ja.wait(h, timeout=30)
            assert res.text is not None and "closed" in res.text, res
        finally:
            await ja.close()
            await jb.close()
        await client.nc.flush()
        overheard = [m.subject for m in client.heard if approval_id.encode() in m.data]
        assert overheard == [], overheard
