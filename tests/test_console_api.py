"""The console's routes (issue 18), in-process against a real nats-server: the page and its
files are served without a token and with a strict policy; the JSON routes need the read
scope, answer problem+json, and stay bounded with 10,000 sessions in the read model."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from jetloop.schemas import Event, EventType, encode
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.gateway.app import make_app
from jetloop.services.gateway.config import GatewayConfig
from jetloop.services.readmodel.model import Incoming, ReadModel
from tests.test_gateway import ALL, READ, make_config, ok, problem

Api = TestClient[web.Request, web.Application]
MANY = 10_000


@pytest.fixture
def config(tmp_path: Path) -> GatewayConfig:
    return make_config(tmp_path)


@pytest.fixture
async def api(nats_ready: EmbeddedServer, config: GatewayConfig) -> AsyncIterator[Api]:
    assert config.readmodel_db is not None
    async with await ReadModel.open(config.readmodel_db) as model:
        await model.prepare()
    async with TestClient(TestServer(make_app(config, nats_ready.url))) as c:
        yield c


async def test_console_page_and_files(api: Api) -> None:
    """`/` and its files need no token (they hold no data) and forbid other origins'
    scripts; an unknown or escaping file name is a problem, not a file."""
    page = await api.get("/")
    assert page.status == 200 and page.content_type == "text/html"
    assert "/console/console.js" in await page.text()
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    js = await api.get("/console/console.js")
    assert js.status == 200 and js.content_type == "text/javascript"
    assert "sessionStorage" in await js.text()
    css = await api.get("/console/console.css")
    assert css.status == 200 and css.content_type == "text/css"
    await problem(await api.get("/console/nothing.js"), 404)
    for name in ("..%2Fapp.py", "index.html", "console.py"):
        resp = await api.get(f"/console/{name}")
        assert resp.status in (404, 422), name
        assert resp.content_type == "application/problem+json"


async def test_whoami_and_scopes(api: Api) -> None:
    """The console learns the token's name and scopes (to show the approve button only to
    a token that may approve); without a token it is a 401 problem."""
    assert await ok(await api.get("/v1/whoami", headers=ALL)) == {
        "name": "alice",
        "scopes": ["approve", "read", "write"],
    }
    assert (await ok(await api.get("/v1/whoami", headers=READ)))["scopes"] == ["read"]
    for path in ("/v1/whoami", "/v1/inbox", "/v1/operations", "/v1/dead-letters", "/v1/events"):
        await problem(await api.get(path), 401)


async def test_operations_and_empty_dead_letters(api: Api) -> None:
    """Operations answer with streams and consumers before any worker ran; no dead letters
    is an empty page; an unknown one is a 404 problem."""
    ops = await ok(await api.get("/v1/operations", headers=READ))
    assert {s["name"] for s in ops["streams"]} >= {"JL_EVENTS", "JL_DEAD", "JL_TURNS"}
    assert ops["workers"] == [] and ops["readmodel_position"] == 0
    dead = await ok(await api.get("/v1/dead-letters", headers=READ))
    assert dead == {"total": 0, "letters": [], "next_before": None}
    await problem(await api.get("/v1/dead-letters/7", headers=READ), 404)
    await problem(await api.get("/v1/dead-letters", params={"limit": "1000"}, headers=READ), 422)


def ev(seq: int, kind: EventType, turn: str, **data: object) -> Incoming:
    e = Event(key=f"k{seq}", type=kind, session_id="tl", turn_id=turn, at=1000.0 + seq, data=data)
    return Incoming(seq, f"jl.event.tl.{kind.value}", encode(e))


async def test_timeline_shows_outcome_unknown_and_cuts_large_payloads(
    api: Api, config: GatewayConfig
) -> None:
    """A turn's timeline lists its events in log order and its calls with their idempotency
    keys; an outcome_unknown call says so; a large payload is cut in the page and whole
    from the event's own route; pages follow ``next_after``."""
    assert config.readmodel_db is not None
    big = "x" * 5000
    async with await ReadModel.open(config.readmodel_db) as model:
        await model.apply(
            [
                ev(1, EventType.TURN_ACCEPTED, "t1", request_id="r1", queued=False),
                ev(2, EventType.TURN_STARTED, "t1", request_id="r1", agent="demo"),
                ev(
                    3,
                    EventType.MODEL_ANSWERED,
                    "t1",
                    model_step=0,
                    usage={"input_tokens": 12, "output_tokens": 5},
                    text=big,
                    calls=[{"call_id": "c", "tool": "pay", "args": {}, "effect": "write"}],
                ),
                ev(
                    4,
                    EventType.CALL_OUTCOME,
                    "t1",
                    call_key="tl.t1.0.0",
                    tool="pay",
                    effect="write",
                    state="outcome_unknown",
                    attempts=2,
                ),
            ]
        )
    tl = await ok(await api.get("/v1/sessions/tl/turns/t1/timeline", headers=READ))
    assert [e["type"] for e in tl["events"]] == [
        "turn.accepted",
        "turn.started",
        "model.answered",
        "call.outcome",
    ]
    (c,) = tl["calls"]
    assert c["state"] == "outcome_unknown" and c["attempts"] == 2 and c["effect"] == "write"
    assert c["idempotency_key"].startswith("jl-")
    answered = tl["events"][2]
    assert answered["truncated"] and answered["size"] > 5000 and len(answered["data"]) < 2100
    whole = await ok(await api.get(f"/v1/sessions/tl/events/{answered['seq']}", headers=READ))
    assert whole["data"]["text"] == big and whole["data"]["usage"]["input_tokens"] == 12
    page = await ok(
        await api.get("/v1/sessions/tl/turns/t1/timeline", params={"limit": "2"}, headers=READ)
    )
    assert [e["seq"] for e in page["events"]] == [1, 2] and page["next_after"] == 2
    rest = await ok(
        await api.get("/v1/sessions/tl/turns/t1/timeline", params={"after": "2"}, headers=READ)
    )
    assert [e["seq"] for e in rest["events"]] == [3, 4] and rest["next_after"] is None
    await problem(await api.get("/v1/sessions/tl/turns/nope/timeline", headers=READ), 404)
    await problem(await api.get("/v1/sessions/tl/events/99", headers=READ), 404)


async def many_sessions(path: Path) -> None:
    """10,000 sessions, each waiting for an approval, written straight into the read model
    (one transaction): what a busy deployment's read model holds, in a second."""
    async with await ReadModel.open(path) as model:
        db = model.db
        await db.execute("BEGIN")
        await db.executemany(
            "INSERT INTO sessions (session_id, agent, status, created_at, updated_at, "
            "last_turn_id, turns_total, pending_approvals, last_text, last_seq) "
            "VALUES (?, 'demo', 'waiting', ?, ?, 't', 1, 1, ?, ?)",
            [(f"s{i:05d}", 1000.0 + i, 1000.0 + i, f"close T-{i}", i) for i in range(MANY)],
        )
        await db.executemany(
            "INSERT INTO turns (session_id, turn_id, agent, status) VALUES (?, 't', 'demo', "
            "'running')",
            [(f"s{i:05d}",) for i in range(MANY)],
        )
        await db.executemany(
            "INSERT INTO approvals (session_id, approval_id, turn_id, call_key, tool, args, "
            "status, requested_at) VALUES (?, ?, 't', ?, 'close_ticket', ?, 'pending', ?)",
            [
                (f"s{i:05d}", f"a{i}", f"s{i:05d}.t.0.0", json.dumps({"ticket": i}), 1000.0 + i)
                for i in range(MANY)
            ],
        )
        await db.execute("COMMIT")


async def test_ten_thousand_sessions_page_is_bounded(api: Api, config: GatewayConfig) -> None:
    """With 10,000 sessions (each with a pending approval) the console's lists answer one
    page at a time: the sessions list, a filtered list, a deep page and the inbox each
    return at most their limit, say the total, and answer quickly."""
    assert config.readmodel_db is not None
    await many_sessions(config.readmodel_db)
    for params, rows in (
        ({}, 50),
        ({"limit": "200"}, 200),
        ({"status": "approval"}, 50),
        ({"q": "s099"}, 50),  # s0990x … s0999x
        ({"offset": str(MANY - 10)}, 10),
    ):
        t0 = time.monotonic()
        resp = await api.get("/v1/sessions", params=params, headers=READ)
        raw = await resp.read()
        took = time.monotonic() - t0
        page = json.loads(raw)
        assert resp.status == 200, raw
        assert len(page["sessions"]) == rows, params
        assert page["total"] == (MANY if "q" not in params else 100), params
        assert len(raw) < 200 * 1024 and took < 5.0, (params, len(raw), took)
    newest = await ok(await api.get("/v1/sessions", params={"limit": "1"}, headers=READ))
    assert newest["sessions"][0]["session_id"] == f"s{MANY - 1:05d}"
    # No worker serves `demo` here: every busy session waits for one (no call rows name more).
    assert newest["sessions"][0]["waiting_for"] == ["worker"]
    await problem(await api.get("/v1/sessions", params={"limit": "10000"}, headers=READ), 422)

    t0 = time.monotonic()
    resp = await api.get("/v1/inbox", headers=READ)
    raw = await resp.read()
    inbox = json.loads(raw)
    assert resp.status == 200 and inbox["total"] == MANY and len(inbox["items"]) == 50
    assert len(raw) < 200 * 1024 and time.monotonic() - t0 < 5.0
    assert inbox["items"][0]["session_id"] == f"s{MANY - 1:05d}"
    assert inbox["items"][0]["args"] == {"ticket": MANY - 1}
    await problem(await api.get("/v1/inbox", params={"limit": "201"}, headers=READ), 422)


async def test_every_sessions_events_from_now(api: Api, nats_ready: EmbeddedServer) -> None:
    """`/v1/events` streams every session's events from now (what came before is not
    replayed), history entries left out, each with its stream sequence as its id."""
    nc = await nats.connect(nats_ready.url)
    js = nc.jetstream()
    try:

        async def publish(sid: str, n: int) -> None:
            e = Event(key=f"{sid}.{n}", type=EventType.TURN_ACCEPTED, session_id=sid, turn_id="t")
            e.data = {"request_id": "r", "queued": False}
            await js.publish(f"jl.event.{sid}.turn.accepted", encode(e))

        await publish("before", 1)
        resp = await api.get("/v1/events", headers=READ)
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        assert await resp.content.readuntil(b"\n\n") == b"retry: 2000\n: connected\n\n"
        await js.publish("jl.event.a.history.user", b"not an event")
        await publish("a", 2)
        await publish("b", 3)
        frames = [await resp.content.readuntil(b"\n\n") for _ in range(2)]
        got = [json.loads(f.split(b"data: ", 1)[1]) for f in frames]
        assert [g["session_id"] for g in got] == ["a", "b"]
        assert frames[0].startswith(b"id: ") and b"event: turn.accepted" in frames[0]
        resp.close()
        bad = await api.get("/v1/events", headers={**READ, "Last-Event-ID": "x"})
        await problem(bad, 400)
    finally:
        await nc.close()


async def test_anonymous_on_loopback_is_signed_in(
    nats_ready: EmbeddedServer, tmp_path: Path
) -> None:
    """Where anonymous requests have scopes (`jetloop up` on loopback without tokens), the
    console's first question is answered without a token: no sign-in form."""
    config = make_config(tmp_path, tokens={}, anonymous_scopes=["read", "write", "approve"])
    async with TestClient(TestServer(make_app(config, nats_ready.url))) as c:
        assert await ok(await c.get("/v1/whoami")) == {
            "name": "anonymous",
            "scopes": ["approve", "read", "write"],
        }
