"""Bad input goes to the dead-letter stream with its reason; the worker keeps running."""

from __future__ import annotations

import hashlib

import msgpack

from jetloop.services.client import Client
from tests.conftest import WorkerFactory, call, script


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
