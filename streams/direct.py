"""Batched direct gets: many stored messages for one request (server ≥ 2.11, ADR-31).

A direct get is answered by any replica, so it is used only where a stream has one replica
(``allow_direct`` is set only then, see ``streams.topology``): on R3 a follower could be
behind, and readers fall back to gets the stream leader answers.

One request, ``$JS.API.DIRECT.GET.<stream>``, is answered by one message per stored message
found and an end-of-batch status (204, with ``Nats-Num-Pending`` for what is left), or by a
404 when nothing matched. Round trips are what a step costs (docs/performance.md), so a
handler that needs several keys asks once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client


class DirectGetFailed(Exception):
    """The server answered a batched direct get with an error status."""


@dataclass(frozen=True)
class Stored:
    subject: str
    seq: int
    data: bytes
    headers: dict[str, str]


async def direct_batch(
    nc: Client, stream: str, request: dict[str, Any], timeout: float = 5.0
) -> tuple[list[Stored], int]:
    """The messages one batched direct get returns, and how many more matched after them."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    out: list[Stored] = []
    try:
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
        while True:
            msg = await sub.next_msg(timeout=timeout)
            hdrs = msg.headers or {}
            status = hdrs.get("Status")
            if status == "404":
                return out, 0
            if status:
                if status != "204":
                    raise DirectGetFailed(f"direct get on {stream} failed: {status} {hdrs}")
                return out, int(hdrs.get("Nats-Num-Pending", "0"))
            out.append(
                Stored(hdrs["Nats-Subject"], int(hdrs["Nats-Sequence"]), msg.data, dict(hdrs))
            )
    finally:
        await sub.unsubscribe()
