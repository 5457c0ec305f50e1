"""A decision is described once (``jetloop.sessions.requests``): the client sends, the control
service parses and the gateway builds the same request model for every op, and the OpenAPI
document's decision bodies are derived from it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetloop.schemas.errors import ControlError
from jetloop.services import control
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.gateway.app import ROUTES, make_app
from jetloop.services.gateway.openapi import HTTP_DECISIONS, NOT_ON_HTTP, openapi_document
from jetloop.sessions.requests import DECISIONS
from jetloop.streams.connection import connect
from tests.test_gateway import ALL, make_config

Sent = list[tuple[str, dict[str, Any]]]

# A path parameter's request field, where the names differ.
PATH_FIELDS = {"session": "session_id"}

# What the Python client is asked, per op (every op, checked below).
CLIENT_CALLS: dict[str, Callable[[Client], Awaitable[Any]]] = {
    "approve": lambda c: c.approve("s1", "a1", by="ann", reason="fine"),
    "reject": lambda c: c.reject("s1", "a1", by="ann", reason="no"),
    "answer": lambda c: c.answer("s1", "q1", "blue", by="ann"),
    "cancel": lambda c: c.cancel("s1", "t1", by="ann"),
    "reconcile": lambda c: c.reconcile("s1.t1.0.0", True, by="ann", result={"n": 1}),
    "approval_policy": lambda c: c.set_approval("s1", "refund", None, agent="demo", by="ann"),
}

# What the gateway is sent, per op it serves: (path, body).
HTTP_CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "approve": ("/v1/sessions/s1/approvals/a1", {"approve": True, "reason": "fine"}),
    "reject": ("/v1/sessions/s1/approvals/a1", {"approve": False}),
    "answer": ("/v1/sessions/s1/questions/q1", {"answer": "blue"}),
    "cancel": ("/v1/sessions/s1/cancel", {"turn_id": "t1"}),
    "reconcile": ("/v1/calls/s1.t1.0.0/reconcile", {"succeeded": False, "error": "lost"}),
}


@pytest.fixture
async def sent(nats_ready: EmbeddedServer) -> AsyncIterator[Sent]:
    """Every control request, as a worker would receive it; each is refused (409), so no
    state is needed and the caller's refusal path runs."""
    got: Sent = []
    nc: NATS = await connect([nats_ready.url], "test-control-capture")

    async def on(msg: Msg) -> None:
        got.append((msg.subject, json.loads(msg.data)))
        error = {"status": 409, "title": "captured", "detail": msg.subject}
        await msg.respond(json.dumps({"ok": False, "error": error}).encode())

    await nc.subscribe("jl.control.>", cb=on)
    await nc.flush()
    yield got
    await nc.close()


def test_the_control_service_parses_every_decision_with_its_model() -> None:
    """``jl.control.<op>`` is parsed with the op's request model, for every decision, and a
    NATS caller that names nobody decides as ``nats``."""
    assert {op: control.REQUESTS[op] for op in DECISIONS} == DECISIONS
    assert set(control.REQUESTS) == {*DECISIONS, "snapshot"}
    for op, model in DECISIONS.items():
        assert model.op == op
        if "by" in model.model_fields:
            assert model.model_fields["by"].default == "nats"


async def test_the_client_sends_every_decision_as_its_model(
    nats_ready: EmbeddedServer, sent: Sent
) -> None:
    """Without the seal key, each client method sends its op's request model, whole, on
    ``jl.control.<op>``."""
    assert set(CLIENT_CALLS) == set(DECISIONS)
    async with Client(await connect([nats_ready.url], "test-client"), own=True, retry_for=5) as c:
        for op, ask in CLIENT_CALLS.items():
            with pytest.raises(ControlError, match="captured"):
                await ask(c)
            subject, body = sent.pop()
            assert subject == f"jl.control.{op}"
            req = DECISIONS[op].model_validate(body)
            assert body == req.model_dump(mode="json")
            assert body.get("by", "ann") == "ann"


async def test_the_gateway_builds_every_decision_as_its_model(
    nats_ready: EmbeddedServer, sent: Sent, tmp_path: Path
) -> None:
    """Each decision route's body is its op's model less the path's names and ``by``, the
    OpenAPI body is that body's schema, and the request sent on is the op's model with the
    token's name as ``by``. Every op is served, or said not to be."""
    assert set(HTTP_DECISIONS) | NOT_ON_HTTP == set(DECISIONS)
    assert not set(HTTP_DECISIONS) & NOT_ON_HTTP
    assert set(HTTP_CALLS) == set(HTTP_DECISIONS)
    routes = {r.name: r for r in ROUTES}
    doc = openapi_document()
    for op, (name, body) in HTTP_DECISIONS.items():
        route = routes[name]
        in_path = {PATH_FIELDS.get(p[1:-1], p[1:-1]) for p in route.path.split("/") if "{" in p}
        own = set(DECISIONS[op].model_fields) - {"by"}
        assert set(body.model_fields) - {"approve"} == own - in_path
        schema = doc["paths"][route.path]["post"]["requestBody"]["content"]["application/json"]
        want = body.model_json_schema()
        want.pop("title")
        assert schema["schema"] == want

    app = make_app(make_config(tmp_path, sealer=None), nats_ready.url)
    async with TestClient(TestServer(app)) as api:
        for op, (path, payload) in HTTP_CALLS.items():
            resp = await api.post(path, json=payload, headers=ALL)
            assert resp.status == 409, await resp.text()
            subject, sent_body = sent.pop()
            assert subject == f"jl.control.{op}"
            req = DECISIONS[op].model_validate(sent_body)
            assert sent_body == req.model_dump(mode="json")
            assert sent_body["by"] == "alice"
            assert {k: v for k, v in payload.items() if k != "approve"}.items() <= sent_body.items()
