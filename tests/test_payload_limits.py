"""No message the engine builds can take a connection down: headers count to max_payload.

nats-py compares only the body with the server's ``max_payload``; the server counts the
headers too and closes the connection on a message past it (NATS-NOTES). These tests run a
real worker process and check that it is the same process that serves the next turn.
"""

from __future__ import annotations

import msgpack

from services.client import Client
from streams.connection import PayloadTooLarge, message_size
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


async def test_a_request_the_worker_cannot_store_is_dead_lettered_and_the_worker_lives(
    client: Client, workers: WorkerFactory
) -> None:
    """A raw request whose text fits one message but not the records a worker makes of it
    (record fields, claim, seal and KV headers on top): the step whose write would pass the
    limit is dead-lettered with the reason; the same worker process serves the next turn."""
    w = workers.start()
    text = "z" * (MIB - 400)
    body = msgpack.packb({"text": text})
    hdrs = {"Nats-Msg-Id": "huge.1"}
    assert message_size(body, hdrs) <= client.nc.max_payload
    await client.js.publish("jl.turn.tester.huge", body, headers=hdrs)

    async def dead() -> list[tuple[str, str, bytes]]:
        return [d for d in await client.dead_letters() if d[0].endswith(".huge")]

    [(_, reason, _)] = await until(dead, timeout=30)
    assert "PayloadTooLarge" in reason and "max_payload" in reason
    h = await client.send("tester", "after-huge", script(answer="still here"))
    res = await client.wait(h, timeout=10)
    assert res.text is not None and "still here" in res.text
    assert w.alive()
