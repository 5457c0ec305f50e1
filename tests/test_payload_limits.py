"""No message the engine builds can take a connection down: headers count to max_payload.

nats-py compares only the body with the server's ``max_payload``; the server counts the headers too
and closes the connection on a message past it (docs/design.md, JetStream facts). These tests run a
real worker process and check that it is the same process that serves the next turn.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from jetloop.schemas import turn_id_for
from jetloop.services.client import Client, TurnFailed
from jetloop.streams.connection import PayloadTooLarge, message_size
from tests.conftest import WorkerFactory, script, until

MIB = 1024 * 1024


async def test_a_message_over_the_limit_with_its_headers_is_refused_before_it_is_sent(
    client: Client,
) -> None:
    """A body under max_payload whose headers take it over is refused on the call, and the
    connection is still open for the next publish."""
    limit = client.nc.max_payload
    hdrs = {"Nats-Msg-Id": "x" * 100}
    body = b"y" * (limit - 50)
    assert message_size(body, hdrs) > limit >= len(body)
    try:
        await client.js.publish("jl.turn.tester.over", body, headers=hdrs)
    except PayloadTooLarge as exc:
        assert str(limit) in str(exc)
    else:
        raise AssertionError("an oversized message was sent")
    assert client.nc.is_connected
    ack = await client.js.publish("jl.turn.tester.under", b"", headers={"Nats-Msg-Id": "u"})
    assert ack.seq


async def test_a_raw_request_near_the_limit_runs_and_the_worker_lives(
    client: Client, workers: WorkerFactory
) -> None:
    """A raw request whose text fits one message but not the records a worker makes of it
    (record fields, claim, seal and KV headers on top): the worker keeps the text in
    jl_blobs, the turn runs with the whole text, and the same process serves the next turn."""
    w = workers.start()
    text = json.dumps({"answer": "huge ok", "pad": "z" * (MIB - 500)})
    body = msgpack.packb({"text": text})
    hdrs = {"Nats-Msg-Id": "huge.1"}
    assert message_size(body, hdrs) <= client.nc.max_payload
    await client.js.publish("jl.turn.tester.huge", body, headers=hdrs)
    tid = turn_id_for("huge", "1")  # Nats-Msg-Id <session>.<request id>
    turn = await until(lambda: _ended(client, "huge", tid), timeout=30)
    assert turn.status.value == "completed" and turn.text == "" and turn.text_ref is not None
    assert (await client.answer_text(turn) or "").startswith("huge ok")
    h = await client.send("tester", "after-huge", script(answer="still here"))
    res = await client.wait(h, timeout=10)
    assert res.text is not None and "still here" in res.text
    assert w.alive()
    assert await client.dead_letters() == []


async def test_a_ten_megabyte_message_runs_end_to_end(
    client: Client, workers: WorkerFactory
) -> None:
    """A 10 MB user message: the client puts its text in jl_blobs, every record and history
    entry refers to it, the model gets all of it, and nothing is dead-lettered."""
    w = workers.start()
    text = json.dumps({"answer": "ten ok", "pad": "m" * (10 * MIB)})
    h = await client.send("tester", "ten", text)
    res = await client.wait(h, timeout=60)
    assert res.text is not None and res.text.startswith("ten ok")
    turn = await client.turn("ten", h.turn_id)
    assert turn is not None and turn.text_ref is not None and turn.text_ref.size == len(text)
    snap = await client.snapshot("ten")
    assert snap is not None
    [user] = [e for e in snap.history if e.role.value == "user"]
    assert user.text is None and user.text_ref == turn.text_ref
    assert await client.dead_letters() == [] and w.alive()


async def _ended(client: Client, sid: str, tid: str) -> Any:
    turn = await client.turn(sid, tid)
    return turn if turn is not None and turn.status.terminal else None


async def test_a_model_answer_too_big_to_keep_fails_its_turn(
    client: Client, workers: WorkerFactory
) -> None:
    """A model answer whose calls are too big for the turn's record (1.2 MiB of arguments,
    past the server's max_payload) cannot be committed, and no retry can change that: the step
    is dead-lettered, and the turn fails with the reason instead of running for ever (the
    caller's wait returns, the log says why, and the session's next message runs)."""
    workers.start()
    big = "y" * (MIB + MIB // 5)
    h = await client.send("tester", "toobig", script([{"tool": "write", "args": {"name": big}}]))
    with pytest.raises(TurnFailed, match=r"step .* failed: .*max_payload"):
        await client.wait(h, timeout=30)
    events = [e async for e in client.events("toobig", follow=False)]
    [dead] = [e for e in events if e.type == "agent.run.step_dead_lettered"]
    assert dead.data["dead_letter"].startswith("jl.dead.jl.step.")
    assert any(s.startswith("jl.step.") for s, _, _ in await client.dead_letters())
    after = await client.send("tester", "toobig", script([]))
    await client.wait(after, timeout=30)
