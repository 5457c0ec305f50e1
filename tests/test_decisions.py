"""The first decision wins, and a conflicting one says so: on a decided approval or an
answered question, the same decision again returns the recorded one, and another decision
is refused with 409 on every path (the client with the seal key, the client without it
over ``jl.control.*``, the raw NATS control API, the CLI)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jetloop import ControlError
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.gateway.openapi import openapi_document
from tests.conftest import WorkerFactory, body, call, script, until
from tests.test_cli import acli


async def pending(client: Client, session: str, what: str) -> Any:
    async def check() -> Any:
        snap = await client.snapshot(session)
        return snap if snap is not None and getattr(snap, what) else None

    return await until(check, timeout=30)


async def control(client: Client, op: str, request: dict[str, Any]) -> dict[str, Any]:
    """A raw ``jl.control.<op>`` request, as a client in another language sends it."""
    msg = await client.nc.request(f"jl.control.{op}", json.dumps(request).encode(), timeout=10)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


async def refused(decision: Any) -> ControlError:
    with pytest.raises(ControlError) as caught:
        await decision
    assert caught.value.status == 409, caught.value
    return caught.value


async def test_a_reject_after_an_approve_is_refused_on_every_path(
    client: Client, workers: WorkerFactory, nats_ready: EmbeddedServer
) -> None:
    """Approved by alice: approving again (direct, over NATS, raw) returns alice's decision;
    rejecting is 409 "already approved" naming alice, on the direct path, the request path,
    the raw control API and the CLI; the call runs once."""
    workers.start()
    bare = Client(client.nc)  # no seal key: asks the workers over jl.control.*
    h = await client.send("tester", "dc-a", script([call("guarded", name="g")]))
    [ap] = (await pending(client, "dc-a", "approvals")).approvals
    aid = ap.approval_id

    first = await client.approve("dc-a", aid, by="alice")
    assert first.status == "approved"
    for again in (
        await client.approve("dc-a", aid, by="alice"),
        await bare.approve("dc-a", aid, by="bob"),
    ):
        assert (again.status, again.decided_by) == ("approved", "alice")
    raw = await control(client, "approve", {"session_id": "dc-a", "approval_id": aid})
    assert raw["ok"] is True and raw["result"]["decided_by"] == "alice", raw

    for err in (
        await refused(client.reject("dc-a", aid, by="bob")),
        await refused(bare.reject("dc-a", aid, by="bob", reason="no")),
    ):
        assert err.title == "already approved" and "by alice" in err.detail, err
    raw = await control(client, "reject", {"session_id": "dc-a", "approval_id": aid})
    assert raw["ok"] is False and raw["error"]["status"] == 409, raw
    assert raw["error"]["title"] == "already approved", raw

    cli = await acli(nats_ready.url, "approve", "dc-a", aid, "--reject")
    assert cli.returncode == 1 and "already approved" in cli.stderr, (cli.stdout, cli.stderr)

    res = await client.wait(h, timeout=30)
    assert [s["status"] for s in body(res.text)["seen"]] == ["ok"]
    snap = await client.snapshot("dc-a")
    assert snap is not None and snap.approvals == []


async def test_an_approve_after_a_reject_is_refused(client: Client, workers: WorkerFactory) -> None:
    """Rejected: approving is 409 "already rejected" on both client paths; the call stays
    denied and the tool never runs."""
    workers.start()
    bare = Client(client.nc)
    h = await client.send("tester", "dc-r", script([call("guarded", name="g")]))
    [ap] = (await pending(client, "dc-r", "approvals")).approvals
    await bare.reject("dc-r", ap.approval_id, by="carol", reason="not today")
    for err in (
        await refused(client.approve("dc-r", ap.approval_id, by="dave")),
        await refused(bare.approve("dc-r", ap.approval_id, by="dave")),
    ):
        assert err.title == "already rejected" and "by carol" in err.detail, err
    again = await client.reject("dc-r", ap.approval_id, by="carol")
    assert (again.status, again.reason) == ("rejected", "not today")
    res = await client.wait(h, timeout=30)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "denied" and seen["error"] == "denied by carol: not today"


async def test_another_answer_is_refused_and_the_same_one_repeats(
    client: Client, workers: WorkerFactory
) -> None:
    """Answered "blue": "blue" again returns the record; "red" is 409 "already answered"
    (direct, over NATS, raw); the model sees "blue"."""
    workers.start()
    bare = Client(client.nc)
    h = await client.send("tester", "dc-q", script([call("ask_user", question="Which?")]))
    [q] = (await pending(client, "dc-q", "questions")).questions
    qid = q.question_id
    await bare.answer("dc-q", qid, "blue", by="erin")
    again = await client.answer("dc-q", qid, "blue", by="erin")
    assert (again.answer, again.answered_by) == ("blue", "erin")
    for err in (
        await refused(client.answer("dc-q", qid, "red", by="frank")),
        await refused(bare.answer("dc-q", qid, "red", by="frank")),
    ):
        assert err.title == "already answered" and "'blue' by erin" in err.detail, err
    raw = await control(
        client, "answer", {"session_id": "dc-q", "question_id": qid, "answer": "red"}
    )
    assert raw["ok"] is False and raw["error"]["status"] == 409, raw
    res = await client.wait(h, timeout=30)
    assert body(res.text)["seen"][0]["result"] == {"answer": "blue"}, res.text


def test_the_openapi_document_says_what_a_conflict_is() -> None:
    """The gateway's decision routes answer the recorded decision on a repeat and describe
    their 409 as a decision taken otherwise."""
    paths = openapi_document()["paths"]
    for path, word in (
        ("/v1/sessions/{session}/approvals/{approval_id}", "decided otherwise"),
        ("/v1/sessions/{session}/questions/{question_id}", "answered otherwise"),
    ):
        responses = paths[path]["post"]["responses"]
        assert "repeat" in responses["200"]["description"]
        assert word in responses["409"]["description"]
