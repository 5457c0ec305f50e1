"""Requests whose answers come back through one inline inbox: what a step waits for.

A step's writes (KV CAS, stream publishes) each wait for the server's answer. nats-py's
``request`` and ``JetStreamContext.publish`` make, per request, a random token, a future
with a done-callback, a ``wait_for``, a ``Msg`` and a task switch through a subscription
queue, then decode the answer into a ``PubAck``; a worker sends dozens per turn. Here the
answers arrive on one inline subscription (``SizedClient.subscribe_inline``): a counter
names each request, the reading task resolves its future directly, and one timer per
request (or per batch) bounds the wait. What the caller sees is what nats-py gives: the
same errors (``NoStreamResponseError`` where no stream listens, ``APIError`` with the
server's code, ``nats.errors.TimeoutError``), so retries and fences read them unchanged.
"""

from __future__ import annotations

import asyncio
import json
import re
import weakref
from collections.abc import Sequence
from typing import NamedTuple

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError

from jetloop.streams.connection import AnswerLost, subscribe_inline, when_link_lost

NO_RESPONDERS = "503"


class Answer(NamedTuple):
    data: bytes
    headers: dict[str, str] | None


class Published(NamedTuple):
    """Where a JetStream publish put its message (what nats-py's ``PubAck`` says)."""

    stream: str
    seq: int
    duplicate: bool


class Replies:
    """Requests over one connection, answered through one long-lived inbox subscription."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._sub: Subscription | None = None
        self._prefix = b""
        self._inbox = ""
        self._next = 0
        self._waiting: dict[bytes, asyncio.Future[Answer]] = {}
        self._starting: asyncio.Future[None] | None = None
        # The connection's loop, kept: asking for the running loop costs a getpid() system
        # call each time on Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _start(self) -> None:
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._subscribe())
        await asyncio.shield(self._starting)

    async def _subscribe(self) -> None:
        self._loop = asyncio.get_running_loop()
        inbox = self.nc.new_inbox()
        try:
            self._sub = await subscribe_inline(self.nc, f"{inbox}.*", self._on)
            when_link_lost(self.nc, self._link_lost)
        except BaseException:
            self._starting = None  # the next request tries again
            raise
        self._inbox = inbox + "."
        self._prefix = self._inbox.encode()

    def _on(self, subject: bytes, reply: bytes, data: bytes, hdr: dict[str, str] | None) -> None:
        future = self._waiting.pop(subject[len(self._prefix) :], None)
        if future is not None and not future.done():  # else: it gave up already
            future.set_result(Answer(data, hdr))

    def _link_lost(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(AnswerLost())

    async def send(
        self, subject: str, payload: bytes, headers: dict[str, str] | None
    ) -> asyncio.Future[Answer]:
        """Send one request; its answer resolves the future returned (wait with ``wait``)."""
        if self._sub is None:
            await self._start()
        self._next += 1
        token = str(self._next)
        assert self._loop is not None
        future: asyncio.Future[Answer] = self._loop.create_future()
        key = token.encode()
        self._waiting[key] = future
        try:
            await self.nc.publish(subject, payload, reply=self._inbox + token, headers=headers)
        except BaseException:
            self._waiting.pop(key, None)
            raise
        return future

    async def wait(self, futures: Sequence[asyncio.Future[Answer]], timeout: float) -> list[Answer]:
        """The answers of requests sent with ``send``, in order; ``nats.errors.TimeoutError``
        when they are not all in within ``timeout`` seconds (one timer for them all)."""
        loop = self._loop
        assert loop is not None  # set by the first send
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            for f in futures:
                if not f.done():
                    f.cancel()

        timer = loop.call_later(timeout, expire)
        try:
            return [await f for f in futures]
        except asyncio.CancelledError:
            if expired:
                raise NatsTimeoutError from None
            raise
        finally:
            timer.cancel()
            for f in futures:
                if not f.done():
                    f.cancel()
                elif not f.cancelled():
                    f.exception()  # seen: an answer lost with the link is not "never retrieved"
            if expired or any(f.cancelled() for f in futures):
                self._forget(futures)

    def _forget(self, futures: Sequence[asyncio.Future[Answer]]) -> None:
        gone = set(futures)
        for key in [k for k, f in self._waiting.items() if f in gone]:
            del self._waiting[key]

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str] | None, timeout: float
    ) -> Published:
        """One JetStream publish, its answer awaited (``JetStreamContext.publish``)."""
        (answer,) = await self.wait([await self.send(subject, payload, headers)], timeout)
        return stored(answer)

    async def publish_all(
        self, messages: Sequence[tuple[str, bytes, dict[str, str] | None]], timeout: float
    ) -> list[Published]:
        """Several JetStream publishes sent together, in order, all answers awaited at once;
        the first error among them is raised after every answer is in."""
        futures = [await self.send(s, p, h) for s, p, h in messages]
        return [stored(a) for a in await self.wait(futures, timeout)]

    async def request(
        self, subject: str, payload: bytes, headers: dict[str, str] | None, timeout: float
    ) -> Answer:
        """One request and its answer (``NoRespondersError`` when nobody listens)."""
        (answer,) = await self.wait([await self.send(subject, payload, headers)], timeout)
        if answer.headers is not None and answer.headers.get("Status") == NO_RESPONDERS:
            raise NoRespondersError
        return answer


def stored(answer: Answer) -> Published:
    """A JetStream publish's answer as where it stored the message, or the error it is."""
    if answer.headers is not None and answer.headers.get("Status") == NO_RESPONDERS:
        raise NoStreamResponseError
    quick = _pub_ack(answer.data)
    if quick is not None:
        return quick
    resp = json.loads(answer.data)
    if "error" in resp:
        raise APIError.from_error(resp["error"])
    return Published(resp.get("stream", ""), int(resp.get("seq", 0)), bool(resp.get("duplicate")))


# A PubAck as the server writes it: ``{"stream":"S","seq":7}``, maybe with a domain before
# ``seq`` and ``"duplicate":true`` after it. Read without a JSON parse (a worker reads ~30 a
# turn); anything else (an error, another shape) goes to ``json.loads``.
_PUB_ACK = re.compile(
    rb'\{"stream":"([^"\\]*)",(?:"domain":"[^"\\]*",)?"seq":(\d+)(,"duplicate":true)?\}'
)


def _pub_ack(data: bytes) -> Published | None:
    m = _PUB_ACK.fullmatch(data)
    if m is None:
        return None
    return Published(m.group(1).decode(), int(m.group(2)), m.group(3) is not None)


async def js_publish(
    nc: Client,
    subject: str,
    payload: bytes,
    headers: dict[str, str] | None,
    timeout: float,
) -> Published:
    """``JetStreamContext.publish`` without its layers: one message, its answer awaited."""
    return await replies_of(nc).publish(subject, payload, headers, timeout)


async def js_publish_all(
    nc: Client,
    messages: Sequence[tuple[str, bytes, dict[str, str] | None]],
    timeout: float,
) -> list[Published]:
    """Several JetStream publishes sent together (``Replies.publish_all``)."""
    return await replies_of(nc).publish_all(messages, timeout)


NO_MESSAGE = 10037  # JetStream's err_code for a get that found no message


async def first_seq(nc: Client, stream: str, subject: str, timeout: float) -> int | None:
    """The sequence of the first message on ``subject`` (a filter) still in ``stream``, asked
    of the stream's leader (``$JS.API.STREAM.MSG.GET``), or None when there is none. Only the
    sequence is read: the message's body is not decoded."""
    answer = await replies_of(nc).request(
        f"$JS.API.STREAM.MSG.GET.{stream}",
        json.dumps({"seq": 1, "next_by_subj": subject}).encode(),
        None,
        timeout,
    )
    resp = json.loads(answer.data)
    if "error" in resp:
        if resp["error"].get("err_code") == NO_MESSAGE:
            return None
        raise APIError.from_error(resp["error"])
    return int(resp["message"]["seq"])


def connection_of(js: JetStreamContext) -> Client:
    """The connection a JetStream context sends on (nats-py gives it no public name)."""
    nc: Client = js._nc
    return nc


_BY_CONNECTION: weakref.WeakKeyDictionary[Client, Replies] = weakref.WeakKeyDictionary()


def replies_of(nc: Client) -> Replies:
    """The connection's one ``Replies``."""
    got = _BY_CONNECTION.get(nc)
    if got is None:
        got = _BY_CONNECTION[nc] = Replies(nc)
    return got
