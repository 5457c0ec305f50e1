"""A dead letter is the message whole, its headers kept, beside a reason a person can act on
(docs/protocol.md, "Dead letters")."""

from __future__ import annotations

from typing import Any

from nats.js.errors import NotFoundError

from jetloop.services.client import Client
from jetloop.streams import topology
from tests.conftest import WorkerFactory, until


async def dead_letter(client: Client, subject: str) -> Any:
    """The first dead letter of ``subject``, or None while there is none."""
    try:
        return await client.js.get_msg(
            topology.DEAD_STREAM, seq=1, subject=f"jl.dead.{subject}", next=True
        )
    except NotFoundError:
        return None


async def test_a_dead_letter_keeps_the_original_headers_and_says_why(
    client: Client, workers: WorkerFactory
) -> None:
    """A body that is not msgpack: its dead letter keeps every original header, the
    original ``Nats-Msg-Id`` as ``Jl-Dead-Msg-Id`` (the copy has its own, for dedupe), and
    its reason names msgpack's error and the body's first bytes, never an empty one."""
    workers.start()
    subject = "jl.turn.tester.dl1"
    body = b"\xc1 and then some text that is no msgpack at all, longer than 32 bytes"
    await client.js.publish(subject, body, headers={"Nats-Msg-Id": "dl1.m-1", "X-Trace": "trace-7"})
    m = await until(lambda: dead_letter(client, subject), timeout=30)
    hdrs = m.headers or {}
    assert m.data == body
    assert hdrs["X-Trace"] == "trace-7"
    assert hdrs["Jl-Dead-Msg-Id"] == "dl1.m-1"
    assert hdrs["Nats-Msg-Id"].startswith("dead.JL_TURNS.")
    assert (hdrs["Jl-Dead-Stream"], hdrs["Jl-Dead-Subject"]) == ("JL_TURNS", subject)
    reason = hdrs["Jl-Dead-Reason"]
    assert reason.startswith("body is not msgpack: FormatError (it starts b'\\xc1 and")
    assert f"{len(body)} bytes in all" in reason
