"""The gateway acts only in the token's namespaces (issue 32), against a real nats-server
started with the store's config (one account per namespace), real workers and projectors of
namespaces ``a`` and ``b``.

A request acts in the namespace its ``?namespace=`` names, else in the token's first
(``default`` when it holds it); one it does not hold is a 403 that says nothing of whether it
exists. The console adds the namespace chosen in its header to every request when the token
holds more than one (``console_assets/console.js``, ``inNamespace``); with one, it shows
that one's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError

from jetloop.services import namespaces
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.gateway.app import make_app
from jetloop.services.gateway.config import GatewayConfig, TokenGrant
from jetloop.services.gateway.state import NAMESPACES
from jetloop.services.natsauth import make_users, write_config
from jetloop.services.readmodel.projector import Projector
from jetloop.services.settings import Settings, load_settings
from jetloop.services.worker import Worker
from jetloop.streams.seal import Sealer, key_bytes
from tests.apps import app as test_app
from tests.conftest import LEASE, SEAL_KEY, script, until
from tests.test_gateway import WHSEC, ok, problem, standard_headers

Api = TestClient[web.Request, web.Application]

B_ONLY = {"Authorization": "Bearer b-only-token-0123456789"}
BOTH = {"Authorization": "Bearer both-token-0123456789"}
DEFAULT_AND_B = {"Authorization": "Bearer default-and-b-0123456789"}
DEFAULT_ONLY = {"Authorization": "Bearer default-only-0123456789"}
SEND = "/v1/agents/tester/sessions/{}/messages"


def make_config(tmp_path: Path, **over: Any) -> GatewayConfig:
    rw = ["read", "write"]
    return GatewayConfig.model_validate(
        {
            "tokens": {
                "b-only-token-0123456789": {"name": "bee", "scopes": rw, "namespaces": ["b"]},
                "both-token-0123456789": {"name": "ab", "scopes": rw, "namespaces": ["b", "a"]},
                "default-and-b-0123456789": {
                    "name": "db",
                    "scopes": rw,
                    "namespaces": ["b", "default"],
                },
                "default-only-0123456789": {"name": "dee", "scopes": rw},
            },
            "hooks": {
                "in-b": {
                    "agent": "tester",
                    "session": "hook-{payload.session}",
                    "secret": WHSEC,
                    "text": "{payload.text}",
                    "namespace": "b",
                },
            },
            "readmodel_db": tmp_path / "readmodel.sqlite",
            "sse_keepalive_seconds": 0.2,
            "nats_retry_seconds": 2.0,
            "sealer": Sealer([key_bytes(SEAL_KEY)]),
            **over,
        }
    )


@dataclass
class Tenants:
    """A server with namespaces ``a`` and ``b``, each served by a worker and a projector."""

    server: EmbeddedServer
    settings: Settings
    config: GatewayConfig

    def urls_for(self, namespace: str) -> list[str]:
        return self.settings.for_namespace(namespace).nats_urls

    async def client(self, namespace: str) -> Client:
        return await Client.connect(self.urls_for(namespace), namespace=namespace)


@pytest.fixture
async def tenants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Tenants]:
    monkeypatch.setenv("JETLOOP_VENDOR_DB", str(tmp_path / "vendor.sqlite"))  # the test tools'
    store = tmp_path / "store"
    namespaces.create(store, "a")
    namespaces.create(store, "b")
    config_file = write_config(store)
    server = EmbeddedServer(
        store,
        port=0,
        log_file=tmp_path / "nats.log",
        config_file=config_file,
        auth=("worker", make_users(store)["worker"]),
    )
    server.start()
    services: list[tuple[Worker | Projector, asyncio.Task[None]]] = []
    try:
        await server.wait_jetstream()
        settings = load_settings(
            nats_url=server.url, store_dir=store, lease_seconds=LEASE, drain_seconds=1.0
        )
        config = make_config(tmp_path)
        assert config.readmodel_db is not None
        for ns in ("a", "b"):
            worker = Worker(settings.for_namespace(ns), test_app, worker_id=f"w{ns}")
            services.append((worker, asyncio.create_task(worker.run())))
            await asyncio.wait_for(worker.wait_started(), 30)
            projector = Projector(
                settings.for_namespace(ns).nats_urls,
                namespaces.readmodel_path(config.readmodel_db, ns),
            )
            services.append((projector, asyncio.create_task(projector.run())))
        # The embedded server keeps each account's data apart, in a directory of its own.
        assert {"a", "b"} <= {p.name for p in (store / namespaces.JETSTREAM_DIR).iterdir()}
        yield Tenants(server, settings, config)
    finally:
        for service, _ in reversed(services):
            await service.stop()
        await asyncio.gather(*(task for _, task in services), return_exceptions=True)
        server.kill()


@pytest.fixture
async def api(tenants: Tenants) -> AsyncIterator[Api]:
    app = make_app(tenants.config, tenants.settings.nats_urls, urls_for=tenants.urls_for)
    async with TestClient(TestServer(app)) as c:
        yield c


async def listed(api: Api, headers: dict[str, str], query: str = "") -> list[str]:
    page = await ok(await api.get(f"/v1/sessions{query}", headers=headers))
    return sorted(s["session_id"] for s in page["sessions"])


async def listed_when(
    api: Api, headers: dict[str, str], query: str, pred: Callable[[list[str]], bool]
) -> list[str]:
    async def check() -> tuple[list[str]] | None:
        resp = await api.get(f"/v1/sessions{query}", headers=headers)
        if resp.status == 503:  # the projector has not written the read model yet
            resp.release()
            return None
        got = sorted(s["session_id"] for s in (await ok(resp))["sessions"])
        return (got,) if pred(got) else None

    found: tuple[list[str]] = await until(check, 20)
    return found[0]


async def first_event(api: Api, path: str, headers: dict[str, str]) -> dict[str, Any]:
    """The first event of a session's stream (from the start)."""
    async with asyncio.timeout(10):
        resp = await api.get(path, headers=headers)
        assert resp.status == 200, await resp.text()
        try:
            async for line in resp.content:
                if line.startswith(b"data: "):
                    event: dict[str, Any] = json.loads(line[len(b"data: ") :])
                    return event
        finally:
            resp.close()
    raise AssertionError("the stream ended")


async def test_a_token_acts_only_in_its_namespaces(api: Api, tenants: Tenants) -> None:
    """Turns sent with a token run in its namespace; another namespace's sessions are neither
    listed nor found; naming a namespace the token does not hold is a 403, the same whether
    it exists or not; a token with several sees each with ?namespace=."""
    in_b = await ok(
        await api.post(
            SEND.format("sb") + "?wait=true",
            json={"text": script(answer="in b")},
            headers=B_ONLY,
        )
    )
    assert in_b["status"] == "completed" and in_b["text"].startswith("in b")
    in_a = await ok(
        await api.post(
            SEND.format("sa") + "?wait=true&namespace=a",
            json={"text": script(answer="in a")},
            headers=BOTH,
        )
    )
    assert in_a["status"] == "completed" and in_a["text"].startswith("in a")

    # The turn sent with b's token ran in b: its session is b's, not a's.
    a, b = await tenants.client("a"), await tenants.client("b")
    try:
        assert await b.snapshot("sb") is not None and await a.snapshot("sb") is None
        assert await a.snapshot("sa") is not None and await b.snapshot("sa") is None
    finally:
        await a.close()
        await b.close()

    assert await listed_when(api, B_ONLY, "", lambda s: "sb" in s) == ["sb"]
    assert await listed_when(api, BOTH, "?namespace=a", lambda s: "sa" in s) == ["sa"]
    assert await listed(api, BOTH, "?namespace=b") == ["sb"]
    assert await listed(api, BOTH) == ["sa"]  # no ?namespace=: the first by name
    assert (await ok(await api.get("/v1/sessions/sb", headers=B_ONLY)))["session_id"] == "sb"
    await problem(await api.get("/v1/sessions/sa", headers=B_ONLY), 404)
    await problem(await api.get("/v1/sessions/sa/turns", headers=B_ONLY), 404)
    snap = await ok(await api.get("/v1/sessions/sa?namespace=a", headers=BOTH))
    assert snap["session_id"] == "sa"
    await problem(await api.get("/v1/sessions/sa?namespace=b", headers=BOTH), 404)

    refused = await problem(await api.get("/v1/sessions?namespace=a", headers=B_ONLY), 403)
    unknown = await problem(await api.get("/v1/sessions?namespace=nosuch", headers=B_ONLY), 403)
    assert refused["title"] == unknown["title"] == "namespace not allowed"
    assert {k: v for k, v in refused.items() if k != "detail"} == {
        k: v for k, v in unknown.items() if k != "detail"
    }
    await problem(await api.get("/v1/sessions/sa?namespace=a", headers=B_ONLY), 403)
    await problem(
        await api.post(SEND.format("sneak") + "?namespace=a", json={"text": "x"}, headers=B_ONLY),
        403,
    )
    await problem(await api.get("/v1/sessions?namespace=a", headers=DEFAULT_ONLY), 403)
    for bad in ("Not-A-Name", "a.b", "-a", "x" * 41):
        got = await problem(await api.get(f"/v1/sessions?namespace={bad}", headers=BOTH), 422)
        assert got["errors"][0]["loc"] == ["namespace"]
    await problem(await api.get("/v1/sessions?namespace=a&namespace=b", headers=BOTH), 422)

    assert await ok(await api.get("/v1/namespaces", headers=BOTH)) == {
        "namespaces": ["a", "b"],
        "current": "a",
    }
    assert await ok(await api.get("/v1/namespaces?namespace=b", headers=DEFAULT_AND_B)) == {
        "namespaces": ["default", "b"],
        "current": "b",
    }
    assert (await ok(await api.get("/v1/namespaces", headers=B_ONLY)))["namespaces"] == ["b"]

    # The console's reads: the namespace's events, inbox and workers.
    event = await first_event(api, "/v1/sessions/sb/events", B_ONLY)
    assert event["session_id"] == "sb"
    event = await first_event(api, "/v1/sessions/sa/events?namespace=a", BOTH)
    assert event["session_id"] == "sa"
    ops_a = await ok(await api.get("/v1/operations?namespace=a", headers=BOTH))
    ops_b = await ok(await api.get("/v1/operations", headers=B_ONLY))
    assert [w["worker_id"] for w in ops_a["workers"]] == ["wa"]
    assert [w["worker_id"] for w in ops_b["workers"]] == ["wb"]
    inbox = await ok(await api.get("/v1/inbox", headers=B_ONLY))
    assert inbox["total"] == 0
    turn = in_b["turn_id"]

    async def timeline() -> Any:
        resp = await api.get(f"/v1/sessions/sb/turns/{turn}/timeline", headers=B_ONLY)
        return await ok(resp) if resp.status == 200 else resp.release()

    assert (await until(timeline, 10))["events"]
    await problem(
        await api.get(f"/v1/sessions/sb/turns/{turn}/timeline?namespace=a", headers=BOTH), 404
    )


async def test_a_webhook_acts_in_its_triggers_namespace(api: Api, tenants: Tenants) -> None:
    """A trigger that names a namespace starts its turns there."""
    payload = json.dumps({"session": "h1", "text": script(answer="hooked")}).encode()
    got = await ok(
        await api.post(
            "/v1/hooks/in-b",
            data=payload,
            headers={
                **standard_headers("msg-1", payload, datetime.now(UTC)),
                "Content-Type": "application/json",
            },
        ),
        202,
    )
    assert got["session_id"] == "hook-h1"
    b, a = await tenants.client("b"), await tenants.client("a")
    try:

        async def ran() -> bool:
            snap = await b.snapshot("hook-h1")
            return snap is not None and snap.status == "idle"

        await until(ran, 20)
        assert await a.snapshot("hook-h1") is None
    finally:
        await a.close()
        await b.close()


async def test_a_closed_namespace_connection_is_made_again(api: Api) -> None:
    """A namespace's connection that closes is dropped and made again by the next request;
    the gateway and its default namespace stay."""
    assert await listed_when(api, B_ONLY, "", lambda s: True) == []
    held = api.server.app[NAMESPACES]
    first = await held.client("b")
    await first.nc.close()
    ops = await ok(await api.get("/v1/operations", headers=B_ONLY))
    assert [w["worker_id"] for w in ops["workers"]] == ["wb"]
    again = await held.client("b")
    assert again is not first and again.nc.is_connected
    assert (await api.get("/readyz")).status in (200, 503)  # the default's, unchanged
    assert (await api.get("/metrics")).status == 200


async def test_without_urls_for_only_the_default_is_served(tenants: Tenants) -> None:
    """A gateway given no way to reach other namespaces answers them 503; a request without a
    token acts in the default namespace alone."""
    config = make_config(tenants.server.store_dir.parent, anonymous_scopes=["read"])
    async with TestClient(TestServer(make_app(config, tenants.settings.nats_urls))) as c:
        got = await problem(await c.get("/v1/sessions?namespace=b", headers=BOTH), 503)
        assert got["title"] == "namespace not served here"
        await problem(await c.get("/v1/sessions/sb", headers=B_ONLY), 503)
        assert (await ok(await c.get("/v1/namespaces")))["namespaces"] == ["default"]
        await problem(await c.get("/v1/sessions?namespace=b"), 403)
        assert (await c.get("/readyz")).status in (200, 503)


def test_grants_name_namespaces() -> None:
    """A token's namespaces are names (422-worthy ones fail at start); none given: default.
    The first is `default` when held, else the first by name."""
    assert TokenGrant().namespaces == {"default"}
    assert TokenGrant(namespaces=frozenset({"b", "a"})).ordered() == ["a", "b"]
    assert TokenGrant(namespaces=frozenset({"b", "default"})).home == "default"
    for bad in (["Upper"], ["a b"], []):
        with pytest.raises(ValidationError):
            TokenGrant.model_validate({"namespaces": bad})
    hook = {"agent": "t", "session": "s", "secret": WHSEC, "namespace": "No"}
    with pytest.raises(ValidationError):
        make_config(Path("."), hooks={"h": hook})
