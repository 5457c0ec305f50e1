"""Bad input goes to the dead-letter stream with its reason; the worker keeps running."""

from __future__ import annotations

import hashlib
import json

import msgpack
import pytest

from jetloop.schemas import TurnRequest, encode
from jetloop.schemas.errors import ControlError
from jetloop.schemas.ids import scoped_msg_id, turn_id_for
from jetloop.services.client import Client, TurnFailed, TurnHandle
from jetloop.streams.topology import turn_subject
from tests.conftest import WorkerFactory, call, script, until


async def test_malformed_messages_are_dead_lettered(client: Client, workers: WorkerFactory) -> None:
    """Undecodable, invalid and unroutable messages land in JL_DEAD, whole, with a reason;
    a request for an agent no worker serves is not lost: it waits, and the snapshot says so."""
    w = workers.start()
    js = client.js
    await js.publish("jl.turn.tester.bad1", b"\xc1 not msgpack", headers={"Nats-Msg-Id": "bad1.b1"})
    await js.publish(
        "jl.turn.nobody.bad2", msgpack.packb({"text": "hi"}), headers={"Nats-Msg-Id": "bad2.b2"}
    )
    await js.publish("jl.turn.tester.bad3", msgpack.packb({"text": "no id"}))
    await js.publish(
        "jl.step.tool.tester.call_tool.bad4",
        msgpack.packb({"kind": "call_tool"}),
        headers={"Nats-Msg-Id": "b4"},
    )

    h = await client.send("tester", "good", script([call("write", name="after")]))
    await client.wait(h, timeout=30)
    assert w.alive()

    dead = {subject: (reason, body) for subject, reason, body in await client.dead_letters()}
    assert set(dead) == {
        "jl.turn.tester.bad1",
        "jl.turn.tester.bad3",
        "jl.step.tool.tester.call_tool.bad4",
    }
    assert "not msgpack" in dead["jl.turn.tester.bad1"][0]
    assert dead["jl.turn.tester.bad1"][1] == b"\xc1 not msgpack"
    assert "Nats-Msg-Id" in dead["jl.turn.tester.bad3"][0]
    assert "StepMessage invalid" in dead["jl.step.tool.tester.call_tool.bad4"][0]
    # No worker serves "nobody": its request is kept, unaccepted, and shown as waiting.
    snap = await client.snapshot("bad2")
    assert snap is not None and snap.agent == "nobody"
    assert (snap.status, snap.unaccepted) == ("waiting_for_worker", 1)


async def test_ten_megabyte_tool_result(client: Client, workers: WorkerFactory) -> None:
    """A 10 MB tool result goes through the blob store to the model and the snapshot intact."""
    workers.start()
    size = 10 * 1024 * 1024
    h = await client.send("tester", "big", script([call("big", size=size)]))
    res = await client.wait(h, timeout=60)
    rec = await client.call("big", h.turn_id, 0, 0)
    assert rec is not None and rec.outcome is not None
    assert rec.outcome.result_ref is not None and rec.outcome.result is None
    snap = await client.snapshot("big")
    assert snap is not None and snap.turn is not None and snap.turn.turn_id == h.turn_id
    [view] = snap.calls
    value = view.result
    assert isinstance(value, str) and len(value) == size
    digest = hashlib.sha256(value.encode()).hexdigest()
    assert res.text is not None
    assert f'"len": {size}' in res.text and digest in res.text


async def test_a_message_to_another_agents_session_is_refused(
    client: Client, workers: WorkerFactory
) -> None:
    """A session belongs to the agent that started it. The client refuses a message for it
    under another agent before anything is written (409, naming the owner: before, it became
    a failed turn in the owner's session). A raw publisher, with no client to ask first, is
    refused by the worker: the turn ends failed naming the owner and the request is
    dead-lettered with the same reason. The owner's next message runs."""
    workers.start()
    first = await client.send("tester", "owned", script([call("write", name="mine")]))
    await client.wait(first, timeout=30)

    with pytest.raises(ControlError, match="belongs to agent 'tester', not 'compactor'") as no:
        await client.send("compactor", "owned", "hello")
    assert no.value.status == 409
    assert [t.turn_id for t in (await client.turns("owned")).turns] == [first.turn_id]

    await client.js.publish(
        turn_subject("compactor", "owned"),
        encode(TurnRequest(text="hello")),
        headers={"Nats-Msg-Id": scoped_msg_id("owned", "raw-1"), "Jl-Request-Id": "raw-1"},
    )
    stray = TurnHandle("compactor", "owned", "raw-1", turn_id_for("owned", "raw-1"), False)
    with pytest.raises(TurnFailed, match="belongs to agent 'tester', not 'compactor'"):
        await client.wait(stray, timeout=20)

    async def dead_lettered() -> list[str]:  # just after the turn's end is told
        return [r for s, r, _ in await client.dead_letters() if s == "jl.turn.compactor.owned"]

    dead = await until(dead_lettered, timeout=10)
    assert "belongs to agent 'tester'" in dead[0]

    after = await client.send("tester", "owned", script([call("write", name="again")]))
    await client.wait(after, timeout=30)


async def test_a_session_name_with_a_trailing_newline_is_refused_everywhere(
    client: Client, workers: WorkerFactory
) -> None:
    """``"s1\\n"`` is no session id (a subject or key cannot hold it): the client's snapshot,
    turn and decisions refuse it with a clear error instead of answering about session
    ``s1`` or "no such session", and a raw control request gets 422 naming the field."""
    workers.start()
    h = await client.send("tester", "nl1", script([]))
    await client.wait(h, timeout=30)
    for attempt in (
        client.snapshot("nl1\n"),
        client.turn("nl1\n", h.turn_id),
        client.cancel("nl1\n"),
        client.answer("nl1\n", "q1", "blue", by="alice"),
    ):
        with pytest.raises(ValueError, match="session id 'nl1\\\\n' is not valid"):
            await attempt
    reply = await client.nc.request(
        "jl.control.cancel", json.dumps({"session_id": "nl1\n"}).encode(), timeout=10
    )
    answer = json.loads(reply.data)
    assert answer["ok"] is False and answer["error"]["status"] == 422, answer
    assert "session_id" in answer["error"]["detail"], answer
