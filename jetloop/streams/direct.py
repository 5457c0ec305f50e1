"""Batched direct gets: many stored messages for one request (server ≥ 2.11, ADR-31).

A direct get is answered by any replica, so it is used only where a stream has one replica
(``allow_direct`` is set only then, see ``jetloop.streams.topology``): on R3 a follower could be
behind, and readers fall back to gets the stream leader answers.

One request, ``$JS.API.DIRECT.GET.<stream>``, is answered by one message per stored message
found and an end-of-batch status (204, with ``Nats-Num-Pending`` for what is left), or by a
404 when nothing matched. Round trips are what a step costs (docs/performance.md), so a
handler that needs several keys asks once. A request without ``batch`` (``last_by_subj``
alone: one key) is answered by the one message or a 404 (``direct_get``).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from json.encoder import encode_basestring_ascii as _string
from typing import Any, NamedTuple

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError

from jetloop.streams.connection import AnswerLost, subscribe_inline, when_link_lost

NO_RESPONDERS = "503"


def request_body(request: dict[str, Any]) -> bytes:
    """The request as JSON; its two shapes on a step's path written directly (a step makes
    several: ``json.dumps`` of a dict was a percent of the worker's time)."""
    keys = request.keys()
    if keys == {"last_by_subj"}:
        return f'{{"last_by_subj":{_string(request["last_by_subj"])}}}'.encode()
    if keys == {"multi_last", "batch"} and type(request["batch"]) is int:
        subjects = ",".join(_string(s) for s in request["multi_last"])
        return f'{{"multi_last":[{subjects}],"batch":{request["batch"]}}}'.encode()
    return json.dumps(request).encode()


class DirectGetFailed(Exception):
    """The server answered a batched direct get with an error status."""


class Stored(NamedTuple):
    subject: str
    seq: int
    data: bytes
    headers: dict[str, str]


class _Batch:
    """One batched direct get's answers as they come, and the future its end resolves."""

    __slots__ = ("found", "future", "heard", "single", "stream", "timer")

    def __init__(
        self, stream: str, future: asyncio.Future[tuple[list[Stored], int]], single: bool
    ) -> None:
        self.stream = stream
        self.found: list[Stored] = []
        self.future = future
        self.heard = 0.0
        self.single = single  # answered by one message, with no end-of-batch status
        self.timer: asyncio.TimerHandle | None = None

    def arm(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """Fail the batch once ``timeout`` seconds pass without an answer; ``disarm`` when
        it ends (the timer holds the batch: the two are let go of together then)."""
        self.heard = loop.time()
        self.timer = loop.call_later(timeout, self._check, loop, timeout)

    def _check(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        if self.future.done():
            return
        quiet = loop.time() - self.heard
        if quiet >= timeout:
            self.future.set_exception(TimeoutError())
        else:
            self.timer = loop.call_later(timeout - quiet, self._check, loop, timeout)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def take(self, data: bytes, hdrs: dict[str, str], now: float) -> None:
        self.heard = now
        status = hdrs.get("Status")
        if status == "404":
            self.future.set_result((self.found, 0))
        elif status == "204":
            self.future.set_result((self.found, int(hdrs.get("Nats-Num-Pending", "0"))))
        elif status == NO_RESPONDERS:  # between leaders (a transient error, tried again)
            self.future.set_exception(NoRespondersError())
        elif status:
            self.future.set_exception(
                DirectGetFailed(f"direct get on {self.stream} failed: {status} {hdrs}")
            )
        else:
            self.found.append(Stored(hdrs["Nats-Subject"], int(hdrs["Nats-Sequence"]), data, hdrs))
            if self.single:
                self.future.set_result((self.found, 0))


class DirectGets:
    """Batched direct gets over one connection, through one long-lived inline inbox
    subscription (``SizedClient.subscribe_inline``): a request per batch, no subscribe or
    unsubscribe of its own (each a message more), and each answer taken as it is read."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._sub: Subscription | None = None
        self._inbox = ""
        self._prefix = 0
        self._next = 0
        self._waiting: dict[bytes, _Batch] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _on(self, subject: bytes, reply: bytes, data: bytes, hdr: dict[str, str] | None) -> None:
        batch = self._waiting.get(subject[self._prefix :])
        if batch is None or batch.future.done():
            return  # the answer to a request that already gave up
        assert self._loop is not None
        try:
            batch.take(data, hdr or {}, self._loop.time())
        except (KeyError, ValueError) as exc:
            batch.future.set_exception(
                DirectGetFailed(f"direct get on {batch.stream}: unreadable answer ({exc!r})")
            )

    def _link_lost(self) -> None:
        for batch in self._waiting.values():
            if not batch.future.done():
                batch.future.set_exception(AnswerLost())

    async def batch(
        self, stream: str, request: dict[str, Any], timeout: float = 5.0
    ) -> tuple[list[Stored], int]:
        """The messages one batched direct get returns, and how many more matched after them.

        ``timeout`` bounds the wait for each message (a long batch is not cut short)."""
        if self._sub is None:
            # The connection's loop, kept: asking for the running loop costs a getpid()
            # system call each time on Python 3.11.
            self._loop = asyncio.get_running_loop()
            inbox = self.nc.new_inbox()
            self._sub = await subscribe_inline(self.nc, f"{inbox}.*", self._on)
            self._inbox, self._prefix = inbox + ".", len(inbox) + 1
            when_link_lost(self.nc, self._link_lost)
        loop = self._loop
        assert loop is not None
        self._next += 1
        token = str(self._next)
        key = token.encode()
        batch = _Batch(stream, loop.create_future(), "batch" not in request)
        self._waiting[key] = batch
        # No closure here: a timer calling a function that re-arms itself is a reference
        # cycle, freed only by the garbage collector — one per read, which was all of the
        # worker's cyclic garbage and most of its collections.
        batch.arm(loop, timeout)
        try:
            await self.nc.publish(
                f"$JS.API.DIRECT.GET.{stream}",
                request_body(request),
                reply=self._inbox + token,
            )
            return await batch.future
        finally:
            batch.disarm()
            del self._waiting[key]

    async def last(self, stream: str, subject: str, timeout: float = 5.0) -> Stored | None:
        """The last message stored on ``subject`` (None when there is none)."""
        found, _ = await self.batch(stream, {"last_by_subj": subject}, timeout)
        return found[0] if found else None


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


async def direct_get(nc: Client, stream: str, subject: str, timeout: float = 5.0) -> Stored | None:
    """The last message stored on ``subject`` (None when there is none), by a direct get."""
    found, _ = await direct_gets(nc).batch(stream, {"last_by_subj": subject}, timeout)
    return found[0] if found else None
