"""The HTTP gateway (issue 6), in-process against a real nats-server and real workers."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from standardwebhooks.webhooks import Webhook

from jetloop.schemas.errors import SettingsError
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.gateway.app import ROUTES, Gateway, make_app
from jetloop.services.gateway.config import GatewayConfig
from jetloop.services.gateway.openapi import openapi_document
from jetloop.services.readmodel.model import ReadModel
from jetloop.services.readmodel.projector import Projector
from jetloop.services.settings import describe_errors, fingerprint, load_settings
from jetloop.streams.seal import Sealer, key_bytes
from tests.conftest import SEAL_KEY, WorkerFactory, body, call, script, until

Api = TestClient[web.Request, web.Application]

WHSEC = "whsec_" + base64.b64encode(b"standard-webhooks-test-key!").decode()
GH_SECRET = "github-test-secret"
ALL = {"Authorization": "Bearer all-token-0123456789"}
READ = {"Authorization": "Bearer read-token-0123456789"}
WRITE = {"Authorization": "Bearer write-token-0123456789"}
PROBLEM = "application/problem+json"


def make_config(tmp_path: Path, **over: Any) -> GatewayConfig:
    return GatewayConfig.model_validate(
        {
            "tokens": {
                "all-token-0123456789": {"name": "alice", "scopes": ["read", "write", "approve"]},
                "read-token-0123456789": ["read"],
                "write-token-0123456789": {"name": "wally", "scopes": ["read", "write"]},
            },
            "hooks": {
                "std": {
                    "agent": "tester",
                    "session": "hook-{payload.session}",
                    "secret": WHSEC,
                    "text": "{payload.text}",
                },
                "gh": {
                    "agent": "tester",
                    "session": "gh-{payload.repository.name}",
                    "secret": GH_SECRET,
                    "scheme": "github",
                    "text": "{payload.text}",
                },
            },
            "max_body_bytes": 4096,
            "readmodel_db": tmp_path / "readmodel.sqlite",
            "sse_keepalive_seconds": 0.2,
            "nats_retry_seconds": 2.0,
            # Decisions and answers are state records: sealed, as the workers verify them.
            "sealer": Sealer([key_bytes(SEAL_KEY)]),
            **over,
        }
    )


@pytest.fixture
def config(tmp_path: Path) -> GatewayConfig:
    return make_config(tmp_path)


@pytest.fixture
async def api(nats_ready: EmbeddedServer, config: GatewayConfig) -> AsyncIterator[Api]:
    async with TestClient(TestServer(make_app(config, nats_ready.url))) as c:
        yield c


async def ok(resp: Any, status: int = 200) -> Any:
    """The JSON body of a response that must have this status."""
    text = await resp.text()
    assert resp.status == status, text
    return json.loads(text)


async def problem(resp: Any, status: int) -> dict[str, Any]:
    """The problem+json body of an error response with this status."""
    text = await resp.text()
    assert resp.status == status, text
    assert resp.content_type == PROBLEM
    got: dict[str, Any] = json.loads(text)
    assert got["status"] == status and got["title"]
    return got


async def snapshot_when(api: Api, session: str, pred: Callable[[Any], Any]) -> Any:
    async def check() -> Any:
        resp = await api.get(f"/v1/sessions/{session}", headers=READ)
        if resp.status == 404:
            resp.release()
            return None
        snap = await ok(resp)
        return snap if pred(snap) else None

    return await until(check, 30)


# --- messages, snapshot, list ------------------------------------------------------------


async def test_send_with_idempotency_key_snapshot_and_list(
    api: Api, workers: WorkerFactory, nats_ready: EmbeddedServer, config: GatewayConfig
) -> None:
    """An Idempotency-Key sent twice makes one turn; ?wait=true returns its answer; the
    snapshot pages history; the list and search come from the read model."""
    workers.start()
    url = "/v1/agents/tester/sessions/s1/messages"
    msg = {"text": script([call("write", name="w")], answer="written")}
    first = await ok(
        await api.post(url, json=msg, headers={**WRITE, "Idempotency-Key": "k-1"}), 202
    )
    again = await ok(
        await api.post(url, json=msg, headers={**WRITE, "Idempotency-Key": "k-1"}), 202
    )
    assert first["turn_id"] == again["turn_id"] and first["request_id"] == "k-1"
    assert (first["duplicate"], again["duplicate"]) == (False, True)
    waited = await ok(
        await api.post(
            url, params={"wait": "true"}, json=msg, headers={**WRITE, "Idempotency-Key": "k-1"}
        )
    )
    assert waited["status"] == "completed" and waited["turn_id"] == first["turn_id"]
    assert body(waited["text"])["seen"][0]["status"] == "ok"
    # A repeat of an ended turn is told from its record: a duplicate, with the turn's status.
    late = await ok(await api.post(url, json=msg, headers={**WRITE, "Idempotency-Key": "k-1"}), 202)
    assert (late["duplicate"], late["status"], late["turn_id"]) == (
        True,
        "completed",
        first["turn_id"],
    )

    # The turn's end is told before the session moves on: wait for the session too.
    # (The snapshot says idle once the turn ended; turns_done follows when the session moved.)
    await snapshot_when(api, "s1", lambda s: s["status"] == "idle" and s["turns_done"] == 1)
    snap = await ok(await api.get("/v1/sessions/s1", params={"history_limit": "1"}, headers=READ))
    assert snap["turns_done"] == 1
    assert len(snap["history"]) == 1 and snap["history_total"] >= 3
    await problem(await api.get("/v1/sessions/nobody", headers=READ), 404)

    # The list reads the read model: unavailable until a projector has written it.
    await problem(await api.get("/v1/sessions", headers=READ), 503)
    await ok(
        await api.post(
            "/v1/agents/tester/sessions/other/messages",
            params={"wait": "true"},
            json={"text": script(answer="zebra crossing")},
            headers=WRITE,
        )
    )
    assert config.readmodel_db is not None
    await Projector([nats_ready.url], config.readmodel_db, burst=True, batch=16).run()
    listed = await ok(await api.get("/v1/sessions", headers=READ))
    assert listed["total"] == 2
    assert {s["session_id"] for s in listed["sessions"]} == {"s1", "other"}
    found = await ok(await api.get("/v1/sessions", params={"q": "zebra"}, headers=READ))
    assert [s["session_id"] for s in found["sessions"]] == ["other"]
    row = found["sessions"][0]
    assert row["status"] == "idle" and row["turns_completed"] == 1 and row["agent"] == "tester"
    await problem(await api.get("/v1/sessions", params={"limit": "0"}, headers=READ), 422)


# --- approvals, questions, cancel, reconcile -------------------------------------------------


async def test_unknown_agent_is_404_at_once(api: Api) -> None:
    """A message for an agent no worker has ever served is refused with a 404 problem at
    once (with ?wait=true too), instead of a 202 for a turn that nobody will run."""
    url = "/v1/agents/nosuchagent/sessions/s1/messages"
    for query in ("", "?wait=true&timeout=30"):
        t0 = time.monotonic()
        got = await problem(await api.post(url + query, json={"text": "hi"}, headers=WRITE), 404)
        assert time.monotonic() - t0 < 5
        assert got["title"] == "no such agent" and "nosuchagent" in got["detail"]


async def test_approve_answer_cancel_reconcile(api: Api, workers: WorkerFactory) -> None:
    """Approvals need the approve scope; answers and cancels need write; control errors
    keep their status (404, 409) as problems: the same decision again returns the recorded
    one, another is 409."""
    workers.start()
    post = "/v1/agents/tester/sessions/{}/messages"
    g = await ok(
        await api.post(
            post.format("ap"), json={"text": script([call("guarded", name="g")])}, headers=WRITE
        ),
        202,
    )
    snap = await snapshot_when(api, "ap", lambda s: s["approvals"] and s["status"] == "waiting")
    aid = snap["approvals"][0]["approval_id"]
    decide = f"/v1/sessions/ap/approvals/{aid}"
    await problem(await api.post(decide, json={"approve": True}, headers=WRITE), 403)
    await problem(await api.post(decide, json={"approve": "yes"}, headers=ALL), 422)
    await problem(
        await api.post("/v1/sessions/ap/approvals/a0000", json={"approve": True}, headers=ALL),
        404,
    )
    # Who decides comes from the token, never from the body (issue 13, finding 7).
    forged = {"approve": True, "by": "someone-else", "reason": "fine"}
    refused = await problem(await api.post(decide, json=forged, headers=ALL), 422)
    assert "`by` is not accepted" in refused["errors"][0]["msg"]
    rec = await ok(await api.post(decide, json={"approve": True, "reason": "fine"}, headers=ALL))
    assert rec["status"] == "approved" and rec["decided_by"] == "alice"
    again = await ok(await api.post(decide, json={"approve": True}, headers=ALL))
    assert again["status"] == "approved" and again["decided_by"] == "alice"
    other = await problem(await api.post(decide, json={"approve": False}, headers=ALL), 409)
    assert other["title"] == "already approved" and "by alice" in other["detail"], other
    await snapshot_when(api, "ap", lambda s: s["status"] == "idle")

    # The guarded call succeeded: reconciling it is a conflict; an unknown call is not found.
    key = f"ap.{g['turn_id']}.0.0"
    reconcile = {"succeeded": True, "result": {"ok": 1}}
    await problem(await api.post(f"/v1/calls/{key}/reconcile", json=reconcile, headers=WRITE), 403)
    await problem(await api.post(f"/v1/calls/{key}/reconcile", json=reconcile, headers=ALL), 409)
    missing = f"ap.{g['turn_id']}.7.7"
    await problem(
        await api.post(f"/v1/calls/{missing}/reconcile", json=reconcile, headers=ALL), 404
    )
    await problem(await api.post("/v1/calls/not-a-key/reconcile", json=reconcile, headers=ALL), 422)

    q = await ok(
        await api.post(
            post.format("qa"),
            params={"wait": "false"},
            json={"text": script([call("ask_user", question="Which color?")])},
            headers=WRITE,
        ),
        202,
    )
    snap = await snapshot_when(api, "qa", lambda s: s["questions"])
    qid = snap["questions"][0]["question_id"]
    await problem(await api.post(f"/v1/sessions/qa/questions/{qid}", json={}, headers=WRITE), 422)
    ans = await ok(
        await api.post(f"/v1/sessions/qa/questions/{qid}", json={"answer": "blue"}, headers=WRITE)
    )
    assert ans["answer"] == "blue" and ans["answered_by"] == "wally"
    answer = f"/v1/sessions/qa/questions/{qid}"
    await ok(await api.post(answer, json={"answer": "blue"}, headers=WRITE))
    await problem(await api.post(answer, json={"answer": "red"}, headers=WRITE), 409)
    snap = await snapshot_when(api, "qa", lambda s: s["status"] == "idle")
    assert snap["turn"]["turn_id"] == q["turn_id"] and snap["turn"]["status"] == "completed"

    await ok(
        await api.post(
            post.format("cx"),
            json={"text": script([call("patient", name="p", seconds=30)])},
            headers=WRITE,
        ),
        202,
    )
    await snapshot_when(api, "cx", lambda s: s["calls"] and s["calls"][0]["state"] == "in_doubt")
    await problem(await api.post("/v1/sessions/cx/cancel", headers=READ), 403)
    await problem(await api.post("/v1/sessions/cx/cancel", json={"by": "x"}, headers=WRITE), 422)
    turn = await ok(await api.post("/v1/sessions/cx/cancel", headers=WRITE))
    assert turn["status"] == "cancelled" and turn["cancelled_by"] == "wally"
    await snapshot_when(api, "cx", lambda s: s["status"] == "idle")
    # No running turn (the session is idle, or was never seen): a conflict.
    await problem(await api.post("/v1/sessions/nobody/cancel", json={}, headers=WRITE), 409)


# --- auth, problems, limits, health, metrics, OpenAPI ---------------------------------------


async def test_auth_problems_limits_health_metrics(api: Api) -> None:
    """401 without or with a wrong token, 403 without the scope, aiohttp's 404/405/413 and
    validation errors all as problem+json; health, readiness and metrics answer."""
    no_token = await problem(await api.get("/v1/sessions/s1"), 401)
    assert no_token["title"] == "authentication required"
    assert no_token["type"] == "urn:jetloop:problem:authentication-required"
    resp = await api.get("/v1/sessions/s1", headers={"Authorization": "Bearer wrong"})
    assert 'error="invalid_token"' in resp.headers["WWW-Authenticate"]
    await problem(resp, 401)
    await problem(await api.get("/v1/sessions/s1", headers={"Authorization": "Basic x"}), 401)
    resp = await api.post(
        "/v1/agents/tester/sessions/s1/messages", json={"text": "hi"}, headers=READ
    )
    assert 'scope="write"' in resp.headers["WWW-Authenticate"]
    assert (await problem(resp, 403))["title"] == "insufficient scope"

    not_found = await problem(await api.get("/v1/nothing/here"), 404)
    assert (not_found["title"], not_found["type"]) == ("Not Found", "about:blank")
    resp = await api.get("/v1/sessions/s1/cancel", headers=ALL)
    assert resp.headers["Allow"] == "POST"
    assert (await problem(resp, 405))["title"] == "Method Not Allowed"
    big = {"text": "x" * 5000}
    too_big = await problem(
        await api.post("/v1/agents/tester/sessions/s1/messages", json=big, headers=ALL), 413
    )
    assert "4096" in too_big["detail"]

    msgs = "/v1/agents/tester/sessions/{}/messages"
    bad = await problem(await api.post(msgs.format("s1"), json={"text": 5}, headers=ALL), 422)
    assert bad["errors"][0]["loc"] == ["text"]
    as_json = {**ALL, "Content-Type": "application/json"}
    await problem(await api.post(msgs.format("s1"), data=b"{not json", headers=as_json), 422)
    await problem(await api.post(msgs.format("bad.name"), json={"text": "x"}, headers=ALL), 422)
    await problem(
        await api.post(
            msgs.format("s1"), json={"text": "x"}, headers={**ALL, "Idempotency-Key": "has space"}
        ),
        422,
    )
    await problem(
        await api.post(
            msgs.format("s1"), params={"timeout": "-1"}, json={"text": "x"}, headers=ALL
        ),
        422,
    )
    await problem(
        await api.get("/v1/sessions/s1/events", headers={**READ, "Last-Event-ID": "x"}), 400
    )

    assert await ok(await api.get("/healthz")) == {"status": "ok"}
    assert (await ok(await api.get("/readyz")))["status"] == "ready"
    metrics = await api.get("/metrics")
    text = await metrics.text()
    assert metrics.status == 200 and metrics.content_type == "text/plain"
    assert (
        'jetloop_gateway_requests_total{method="GET",route="/v1/sessions/{session}",status="401"}'
        " 3.0" in text
    )
    assert 'jetloop_gateway_requests_total{method="GET",route="unmatched",status="404"}' in text
    assert "jetloop_gateway_request_duration_seconds_bucket" in text


async def test_gateway_service_serves_until_stopped(
    nats_ready: EmbeddedServer, config: GatewayConfig
) -> None:
    """``Gateway`` listens on a real port (0: any free one) and stops on ``stop()``."""
    gateway = Gateway(config, nats_ready.url, port=0)
    task = asyncio.create_task(gateway.run())
    await asyncio.wait_for(gateway.wait_started(), 10)
    async with ClientSession() as http, http.get(f"{gateway.url}/readyz") as resp:
        assert resp.status == 200
    await gateway.stop()
    await asyncio.wait_for(task, 10)


def test_config_validates_at_start() -> None:
    """Token shorthands expand; a Standard Webhooks secret that is not whsec_<base64> and
    an unknown scope fail when the configuration is read, not on the first delivery."""
    cfg = GatewayConfig.model_validate({"tokens": {"tok-xyzzy-0123456789": ["read"]}})
    assert cfg.tokens["tok-xyzzy-0123456789"].scopes == {"read"} and "xyzzy" not in repr(cfg)
    hook = {"agent": "a", "session": "s", "secret": "whsec_!!not base64!!"}
    with pytest.raises(ValueError, match="whsec_<base64>"):
        GatewayConfig.model_validate({"hooks": {"h": hook}})
    with pytest.raises(ValueError, match="scopes"):
        GatewayConfig.model_validate({"tokens": {"tok-0123456789abcdef": ["admin"]}})


def test_config_errors_name_the_setting_never_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad scope of a token and a bad webhook secret fail at start with the setting's
    name and the token's fingerprint; neither the token nor the secret is in the message
    (issue 13, finding 8), whether it comes from the settings or from the gateway's config."""
    token, secret = "tok-very-secret-1234", "whsec_!!not-base64-SECRETVALUE"
    monkeypatch.setenv(
        "JETLOOP_GATEWAY_TOKENS", json.dumps({token: {"name": "al", "scopes": ["admin"]}})
    )
    hook = {"agent": "a", "session": "s", "secret": secret}
    monkeypatch.setenv("JETLOOP_GATEWAY_HOOKS", json.dumps({"gh": hook}))
    with pytest.raises(SettingsError) as caught:
        load_settings()
    msg = str(caught.value)
    assert "JETLOOP_GATEWAY_TOKENS" in msg and "scopes" in msg and "'admin'" in msg
    assert fingerprint(token) in msg and "JETLOOP_GATEWAY_HOOKS gh" in msg
    assert token not in msg and "SECRETVALUE" not in msg and "\n" not in msg
    monkeypatch.setenv("JETLOOP_GATEWAY_TOKENS", "{not json " + token)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert str(caught.value) == "setting JETLOOP_GATEWAY_TOKENS: not valid JSON"

    with pytest.raises(ValidationError) as invalid:
        GatewayConfig.model_validate({"tokens": {token: ["admin"]}, "hooks": {"gh": hook}})
    msg = describe_errors(invalid.value, "JETLOOP_GATEWAY_")
    assert "JETLOOP_GATEWAY_TOKENS" in msg and "JETLOOP_GATEWAY_HOOKS gh" in msg
    assert token not in msg and "SECRETVALUE" not in msg


def test_openapi_matches_the_router(tmp_path: Path) -> None:
    """Every route of the app is in the OpenAPI document (same path, method, operationId
    and scope), and nothing else is."""
    app = make_app(make_config(tmp_path), "nats://127.0.0.1:1")
    served = {
        (r.resource.canonical, r.method.lower(), r.name)
        for r in app.router.routes()
        if r.resource is not None
    }
    doc = openapi_document()
    documented = {
        (path, method, op["operationId"])
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
    }
    assert served == documented
    scopes = {r.name: r.scope for r in ROUTES}
    for ops in doc["paths"].values():
        for op in ops.values():
            want = (
                [{"bearerAuth": [scopes[op["operationId"]]]}] if scopes[op["operationId"]] else []
            )
            assert op["security"] == want, op["operationId"]
    assert doc["openapi"] == "3.1.0"


async def test_openapi_is_served(api: Api) -> None:
    """GET /v1/openapi.json serves the document, without a token."""
    assert await ok(await api.get("/v1/openapi.json")) == json.loads(json.dumps(openapi_document()))


# --- webhooks ---------------------------------------------------------------------------------


def standard_headers(webhook_id: str, payload: bytes, when: datetime) -> dict[str, str]:
    """Headers signed by the reference implementation (standardwebhooks)."""
    sig = Webhook(WHSEC).sign(webhook_id, when, payload.decode())
    stamp = str(int(when.replace(tzinfo=UTC).timestamp()))
    return {"webhook-id": webhook_id, "webhook-timestamp": stamp, "webhook-signature": sig}


async def test_webhooks(api: Api, client: Client, workers: WorkerFactory) -> None:
    """Standard Webhooks and GitHub deliveries start turns when signed; bad signatures and
    timestamps beyond five minutes are refused; a replayed id is the same one turn."""
    workers.start()
    payload = json.dumps({"session": "wh1", "text": script(answer="hooked")}).encode()
    now = datetime.now(UTC)
    first = await ok(
        await api.post(
            "/v1/hooks/std", data=payload, headers=standard_headers("msg_1", payload, now)
        ),
        202,
    )
    assert first["session_id"] == "hook-wh1" and first["request_id"] == "std:msg_1"
    assert first["duplicate"] is False
    # The sender retries (new timestamp, new signature): the same turn, a duplicate.
    later = now + timedelta(seconds=30)
    again = await ok(
        await api.post(
            "/v1/hooks/std", data=payload, headers=standard_headers("msg_1", payload, later)
        ),
        202,
    )
    assert again["turn_id"] == first["turn_id"] and again["duplicate"] is True

    bad = standard_headers("msg_2", payload, now)
    bad["webhook-signature"] = "v1," + base64.b64encode(b"x" * 32).decode()
    assert (await problem(await api.post("/v1/hooks/std", data=payload, headers=bad), 401))[
        "title"
    ] == "invalid webhook signature"
    tampered = standard_headers("msg_2", payload, now)
    await problem(await api.post("/v1/hooks/std", data=payload + b" ", headers=tampered), 401)
    for skew in (timedelta(minutes=-6), timedelta(minutes=6)):
        stale = standard_headers("msg_3", payload, now + skew)
        got = await problem(await api.post("/v1/hooks/std", data=payload, headers=stale), 401)
        assert got["title"] == "webhook timestamp outside tolerance"
    await problem(await api.post("/v1/hooks/std", data=payload), 401)
    await problem(await api.post("/v1/hooks/nope", data=payload), 404)

    gh_body = json.dumps({"repository": {"name": "jet.loop"}, "text": script(answer="gh")}).encode()
    gh_sig = "sha256=" + hmac.new(GH_SECRET.encode(), gh_body, hashlib.sha256).hexdigest()
    gh = {"X-Hub-Signature-256": gh_sig, "X-GitHub-Delivery": "d-1", "X-GitHub-Event": "push"}
    got = await ok(await api.post("/v1/hooks/gh", data=gh_body, headers=gh), 202)
    # GitHub signs only the body: the body's digest is the delivery's id (finding 9).
    signed_id = "sha256-" + hashlib.sha256(gh_body).hexdigest()[:32]
    assert got["session_id"] == "gh-jet-loop" and got["request_id"] == f"gh:{signed_id}"
    assert (await ok(await api.post("/v1/hooks/gh", data=gh_body, headers=gh), 202))["duplicate"]
    # A captured delivery replayed under a new X-GitHub-Delivery id is the same turn.
    replay = {**gh, "X-GitHub-Delivery": "d-2-replayed"}
    replayed = await ok(await api.post("/v1/hooks/gh", data=gh_body, headers=replay), 202)
    assert replayed["turn_id"] == got["turn_id"] and replayed["duplicate"] is True
    forged = {**gh, "X-Hub-Signature-256": "sha256=" + "0" * 64}
    await problem(await api.post("/v1/hooks/gh", data=gh_body, headers=forged), 401)
    no_id = {k: v for k, v in gh.items() if k != "X-GitHub-Delivery"}
    await problem(await api.post("/v1/hooks/gh", data=gh_body, headers=no_id), 400)

    async def done(session: str) -> Any:
        snap = await client.snapshot(session)
        return snap if snap is not None and snap.status == "idle" and snap.turns_done else None

    for session in ("hook-wh1", "gh-jet-loop"):
        snap = await until(lambda s=session: done(s))
        assert snap.turns_done == 1 and not snap.queued  # one turn per delivery id


# --- SSE ------------------------------------------------------------------------------------


async def read_frames(
    resp: Any, until_type: str | None = None, events: int | None = None, comment: bool = False
) -> list[dict[str, Any]]:
    """Parse SSE frames ({"id", "event", "data"} or {"comment"}) until an event of a type,
    a number of events, or (``comment``) a comment-only frame."""
    frames: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}

    async def go() -> None:
        nonlocal cur
        while True:
            line = (await resp.content.readline()).decode()
            if not line:
                raise EOFError("stream ended")
            line = line.rstrip("\n")
            if line == "":
                if cur:
                    frames.append(cur)
                    hit = (
                        (until_type is not None and cur.get("event") == until_type)
                        or (events is not None and len(events_of(frames)) >= events)
                        or (comment and set(cur) == {"comment"})
                    )
                    cur = {}
                    if hit:
                        return
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "":
                cur["comment"] = value
            elif field == "data":
                cur["data"] = json.loads(value)
            elif field == "id":
                cur["id"] = int(value)
            else:
                cur[field] = value

    await asyncio.wait_for(go(), 30)
    return frames


def events_of(frames: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(f["id"], f["data"]["key"]) for f in frames if "id" in f]


async def test_sse_resumes_without_gap_or_repeat(api: Api, workers: WorkerFactory) -> None:
    """Read some events, disconnect, reconnect with Last-Event-ID: together they are
    exactly the full stream, in order; an idle stream sends keep-alives."""
    workers.start()
    text = script([call("read", name="a"), call("write", name="b")], [call("read", name="c")])
    await ok(
        await api.post(
            "/v1/agents/tester/sessions/ev/messages", json={"text": text}, headers=WRITE
        ),
        202,
    )
    url = "/v1/sessions/ev/events"
    resp = await api.get(url, headers=READ)
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    part1 = events_of(await read_frames(resp, events=3))
    resp.close()
    assert len(part1) == 3
    resp = await api.get(url, headers={**READ, "Last-Event-ID": str(part1[-1][0])})
    part2 = events_of(await read_frames(resp, "turn.completed"))
    # Quiet now: keep-alive comments flow.
    assert (await read_frames(resp, comment=True))[-1] == {"comment": "keep-alive"}
    resp.close()

    resp = await api.get(url, params={"after": "0"}, headers=READ)
    full = events_of(await read_frames(resp, "turn.completed"))
    resp.close()
    assert part1 + part2 == full
    seqs = [s for s, _ in full]
    assert seqs == sorted(set(seqs))
    keys = [k for _, k in full]
    assert len(keys) == len(set(keys)) and keys[-1].endswith(".completed")
    assert any(k.endswith(".started") for k in keys)


# --- fuzzing from the OpenAPI document ------------------------------------------------------

DOC = openapi_document()
OPERATIONS = [
    (path, method, op)
    for path, ops in DOC["paths"].items()
    for method, op in ops.items()
    # An event stream does not end: it has its own test.
    if op["operationId"] not in ("streamEvents", "streamAllEvents")
]
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=10,
)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that fit the (small) JSON Schema subset the document uses."""
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=40)
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(
            min_value=low,
            max_value=schema.get("maximum"),
            exclude_min="exclusiveMinimum" in schema,
            allow_nan=False,
        )
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        )
    return ANY_JSON


HEADER_TEXT = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)


def param_value(p: dict[str, Any]) -> st.SearchStrategy[str]:
    """A value from the parameter's schema, or text that may not fit it."""
    schema = p["schema"]
    if p["in"] == "header":
        # Only what an HTTP client can send at all: visible ASCII.
        fitting = from_schema(schema) if "pattern" in schema else HEADER_TEXT
        return fitting | HEADER_TEXT
    if schema.get("type") == "boolean":
        fitting = st.sampled_from(["true", "false"])
    else:
        fitting = from_schema(schema).map(str)
    return fitting | st.text(max_size=30)


@st.composite
def requests(draw: st.DrawFn, path: str, method: str, op: dict[str, Any]) -> dict[str, Any]:
    url = path
    query: dict[str, str] = {}
    headers = dict(
        draw(st.sampled_from([ALL, ALL, ALL, READ, WRITE, {}, {"Authorization": "Bearer ?"}]))
    )
    for p in op.get("parameters", []):
        if p["in"] != "path" and draw(st.booleans()):
            continue
        value = draw(param_value(p))
        if p["in"] == "path":
            url = url.replace("{" + p["name"] + "}", urllib.parse.quote(value, safe="") or "x")
        elif p["in"] == "query":
            query[p["name"]] = value
        else:
            headers[p["name"]] = value
    data: bytes | None = None
    if "requestBody" in op:
        schema = op["requestBody"]["content"].get("application/json", {}).get("schema", {})
        doc = draw(from_schema(schema) | ANY_JSON) if schema else draw(ANY_JSON)
        data = draw(st.just(json.dumps(doc).encode()) | st.binary(max_size=64))
    return {"method": method.upper(), "url": url, "query": query, "headers": headers, "data": data}


@pytest.fixture
async def fuzz_api(nats_ready: EmbeddedServer, tmp_path: Path) -> AsyncIterator[Api]:
    # Waits are capped so a generated ?wait=true costs milliseconds.
    config = make_config(tmp_path, wait_max_seconds=0.05)
    assert config.readmodel_db is not None
    async with await ReadModel.open(config.readmodel_db) as model:
        await model.prepare()  # an empty read model: listing answers, not 503
    async with TestClient(TestServer(make_app(config, nats_ready.url))) as c:
        yield c


@pytest.mark.parametrize(
    ("path", "method", "op"), OPERATIONS, ids=[op["operationId"] for _, _, op in OPERATIONS]
)
@settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
async def test_fuzz_routes_from_openapi(
    fuzz_api: Api, path: str, method: str, op: dict[str, Any], data: st.DataObject
) -> None:
    """Requests generated from the OpenAPI document (fitting it or not) never get a 5xx,
    and every error is problem+json."""
    req = data.draw(requests(path, method, op))
    resp = await fuzz_api.request(
        req["method"], req["url"], params=req["query"], headers=req["headers"], data=req["data"]
    )
    text = await resp.text()
    assert resp.status < 500, (req, resp.status, text)
    if resp.status >= 400:
        assert resp.content_type == PROBLEM, (req, resp.status, text)


async def test_a_message_just_under_the_body_limit_runs_and_the_gateway_lives(
    nats_ready: EmbeddedServer, tmp_path: Path, workers: WorkerFactory
) -> None:
    """A body just under the gateway's limit (the default, 1 MiB), whose request would pass
    NATS's max_payload inline, travels through jl_blobs: its turn runs to the end with the
    whole text, and the same gateway answers the next request."""
    workers.start()
    config = make_config(tmp_path, max_body_bytes=1024 * 1024)
    async with TestClient(TestServer(make_app(config, nats_ready.url))) as api:
        url = "/v1/agents/tester/sessions/{}/messages?wait=true&timeout=30"
        text = json.dumps({"answer": "big ok", "pad": "q" * (1024 * 1024 - 200)})
        assert len(json.dumps({"text": text})) <= 1024 * 1024
        got = await ok(await api.post(url.format("big"), json={"text": text}, headers=WRITE))
        assert got["status"] == "completed" and got["text"].startswith("big ok")
        nxt = await ok(
            await api.post(url.format("next"), json={"text": script(answer="hi")}, headers=WRITE)
        )
        assert nxt["status"] == "completed"
