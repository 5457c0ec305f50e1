"""Batched direct gets: many stored messages for one request (server ≥ 2.11, ADR-31).

A direct get is answered by any replica, so it is used only where a stream has one replica
(``allow_direct`` is set only then, see ``jetloop.streams.topology``): on R3 a follower could be
behind, and readers fall back to gets the stream leader answers.

One request, ``$JS.API.DIRECT.GET.<stream>``, is answered by one message per stored message
found and an end-of-batch status (204, with ``Nats-Num-Pending`` for what is left), or by a
404 when nothing matched. Round trips are what a step costs (docs/performance.md), so a
handler that needs several keys asks once.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


class DirectGetFailed(Exception):
    """The server answered a batched direct get with an error status."""


@dataclass(frozen=True)
class Stored:
    subject: str
    seq: int
    data: bytes
    headers: dict[str, str]


class DirectGets:
    """Batched direct gets over one connection, through one long-lived inbox subscription:
    a request per batch, and no subscribe/unsubscribe of its own (each a message more)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._sub: Subscription | None = None
        self._inbox = ""
        self._next = 0
        self._waiting: dict[str, asyncio.Queue[Msg]] = {}

    async def _route(self, msg: Msg) -> None:
        q = self._waiting.get(msg.subject.rsplit(".", 1)[-1])
        if q is not None:  # else: the answer to a request that already gave up
            q.put_nowait(msg)

    async def batch(
        self, stream: str, request: dict[str, Any], timeout: float = 5.0
    ) -> tuple[list[Stored], int]:
        """The messages one batched direct get returns, and how many more matched after them."""
        if self._sub is None:
            self._inbox = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._route)
        self._next += 1
        token = str(self._next)
        q: asyncio.Queue[Msg] = asyncio.Queue()
        self._waiting[token] = q
        out: list[Stored] = []
        try:
            await self.nc.publish(
                f"$JS.API.DIRECT.GET.{stream}",
                json.dumps(request).encode(),
                reply=f"{self._inbox}.{token}",
            )
            loop = asyncio.get_running_loop()
            # ``timeout`` for each message (not a task per wait, as ``wait_for`` makes).
            async with asyncio.timeout(timeout) as deadline:
                while True:
                    msg = await q.get()
                    deadline.reschedule(loop.time() + timeout)
                    hdrs = msg.headers or {}
                    status = hdrs.get("Status")
                    if status == "404":
                        return out, 0
                    if status:
                        if status != "204":
                            raise DirectGetFailed(f"direct get on {stream} failed: {status} {hdrs}")
                        return out, int(hdrs.get("Nats-Num-Pending", "0"))
                    out.append(
                        Stored(hdrs["Nats-Subject"], int(hdrs["Nats-Sequence"]), msg.data, hdrs)
                    )
        finally:
            del self._waiting[token]


_BY_CONNECTION: weakref.WeakKeyDictionary[Client, DirectGets] = weakref.WeakKeyDictionary()


def direct_gets(nc: Client) -> DirectGets:
    """The connection's one ``DirectGets``."""
    got = _BY_CONNECTION.get(nc)
    if got is None:
        got = _BY_CONNECTION[nc] = DirectGets(nc)
    return got


async def direct_batch(
    nc: Client, stream: str, request: dict[str, Any], timeout: float = 5.0
) -> tuple[list[Stored], int]:
    """The messages one batched direct get returns, and how many more matched after them."""
    return await direct_gets(nc).batch(stream, request, timeout)
