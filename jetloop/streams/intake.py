"""A pull consumer's messages as they arrive: pull requests kept open for as many messages as
the taker has room for, instead of one ``fetch`` after another.

Why not nats-py's ``fetch(n)``: for ``n > 1`` it sometimes holds a message that arrived on an
idle consumer until the fetch's whole timeout runs out (measured: 3 to 4 of 60 messages
published at random moments waited 100–830 ms with ``fetch(10, timeout=1)``; none with
``fetch(1)``). A worker's steps arrive on idle consumers all the time, so that wait was the
sporadic half-second in the sequential benchmark's p99. Each ``fetch`` also costs a request
and a status round trip even when messages are waiting.

How: one inbox subscription per consumer. ``take(room)`` tops the open requests up to
``room`` messages (``$JS.API.CONSUMER.MSG.NEXT``, with ``expires`` and ``idle_heartbeat``) and
returns what has arrived. Each message counts one off the messages asked for; a request that
ends unfilled says so with a status on its own reply subject (408 expired, 409 refused or cut
short), with what it still owed (``Nats-Pending-Messages``; a request refused outright owed
all it asked). So the count of messages asked for and not yet come stays exact, and the
consumer never has more messages out to this taker than its room. When the server goes
quiet for longer than two heartbeats while requests are open, or the connection was made
again, the open requests are taken as lost and asked again; if one was not lost
after all, its messages are still delivered here, so the taker may get a few more than its
room (never lost, at most briefly over its limit).

Requests expire after a second (and are asked again at once): a process that hangs (SIGSTOP,
a stuck loop) keeps its open requests on the server, and a message delivered into them waits
out its lease; short requests keep that window as short as a one-second fetch kept it.

What else lands in the inbox is dropped where it is read: a message that is not a delivery
of this very consumer (a reply subject that is no ``$JS.ACK.`` subject, or whose metadata
does not read or names another stream or consumer) never reaches the taker, which reads
``msg.metadata`` on every delivery. Each is counted (``jetloop_foreign_messages_total``)
and each kind is logged once per intake: whoever may publish into the inbox can neither
end the loop that reads it nor flood the log.
"""

from __future__ import annotations

import asyncio
import json
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api
from prometheus_client import Counter

from jetloop.streams.connection import subscribe_inline, unsubscribe_inline
from jetloop.streams.liblog import LibraryLogger
from jetloop.streams.loops import running_loop

log = LibraryLogger("jetloop.intake")

FOREIGN = Counter(
    "jetloop_foreign_messages_total",
    "Messages dropped by a pull intake: not a delivery of its consumer",
    ["stream", "kind"],
)
# The kinds of foreign message (the counter's ``kind``).
NOT_JETSTREAM = "not_jetstream"  # its reply subject is no JetStream ack subject
OTHER_CONSUMER = "other_consumer"  # an ack subject of another stream or consumer
BAD_METADATA = "bad_metadata"  # this consumer's ack subject, with metadata that does not read

STATUS = "Status"
PENDING = "Nats-Pending-Messages"
HEARTBEAT = "100"
EXPIRED = "408"


class Intake:
    """The messages of one durable pull consumer, for one taker (the worker's pull loop)."""

    def __init__(
        self,
        nc: Client,
        stream: str,
        consumer: str,
        *,
        expires: float = 1.0,
        heartbeat: float = 0.4,
    ) -> None:
        self.nc = nc
        self.stream = stream
        self.consumer = consumer
        self.subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        # Set for a consumer made by ``ephemeral``: deleted again at ``stop``.
        self._js: JetStreamContext | None = None
        self.expires = expires
        self.heartbeat = heartbeat
        # Messages asked for and not yet come.
        self.asked = 0
        self._requests = 0
        self._ready: asyncio.Queue[Msg] = asyncio.Queue()
        self._woken = asyncio.Event()  # a message came, or the requests were forgotten
        self._heard = time.monotonic()
        self._inbox = ""
        self._sub: Subscription | None = None
        self._warned: set[str] = set()  # the kinds of foreign message logged already

    @classmethod
    async def ephemeral(
        cls, js: JetStreamContext, stream: str, config: api.ConsumerConfig
    ) -> Intake:
        """A new ephemeral consumer of ``stream`` (a reader's: events followed live), taken
        through an intake; ``stop`` deletes it (else it ages out by its inactive threshold)."""
        info = await js.add_consumer(stream, config=config)
        intake = cls(js._nc, stream, info.name)  # the context's connection: no public name
        intake._js = js
        await intake.start()
        return intake

    async def info(self) -> api.ConsumerInfo:
        """The consumer's info (pending counts); for an intake made by ``ephemeral``."""
        assert self._js is not None, "info() is for consumers made by ephemeral()"
        info: api.ConsumerInfo = await self._js.consumer_info(self.stream, self.consumer)
        return info

    async def start(self) -> None:
        self._inbox = self.nc.new_inbox()
        # Inline: a delivery goes to the taker's queue as it is read, not through a task.
        self._sub = await subscribe_inline(self.nc, f"{self._inbox}.>", self._on)

    async def stop(self) -> list[Msg]:
        """No more requests and no more messages; returns those that came and were not
        taken (the caller hands them back)."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await unsubscribe_inline(self.nc, sub)
        left = []
        while not self._ready.empty():
            left.append(self._ready.get_nowait())
        if self._js is not None:
            self._js = None
            # Asked, not awaited: a role that may not delete consumers (a client's, an
            # operator's) is refused without an answer, and awaiting one would wait out the
            # request's timeout (5 s) at the end of every read. Refused, gone already or no
            # server now: the consumer ages out by its inactive threshold.
            subject = f"$JS.API.CONSUMER.DELETE.{self.stream}.{self.consumer}"
            try:
                await self.nc.publish(subject, b"", reply=self.nc.new_inbox())
            except Exception:
                pass
        return left

    def forget_requests(self) -> None:
        """The connection was made again: the server that had the open requests may be gone,
        so ask again now (a request that outlived it only brings its messages here anyway)."""
        self.asked = 0
        self._woken.set()

    async def take(self, room: int, timeout: float) -> list[Msg]:
        """What has arrived, else the first to arrive within ``timeout`` (``[]`` if none
        did); ``room`` is how many the taker can start now, and so how many are asked for.
        Everything that arrived is returned, also past ``room`` after a lost request turned
        up: a message left here would wait unstarted while its lease runs."""
        loop = running_loop()
        deadline = loop.time() + timeout
        while True:
            if self.asked and time.monotonic() - self._heard > 2 * self.heartbeat:
                self.asked = 0  # the server went quiet: its requests are gone with it
            want = room - self._ready.qsize() - self.asked
            if want > 0:
                await self._ask(want)
            if not self._ready.empty():
                msgs: list[Msg] = []
                while not self._ready.empty():
                    msgs.append(self._ready.get_nowait())
                return msgs
            left = deadline - loop.time()
            if left <= 0:
                return []
            self._woken.clear()
            try:
                # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that comes as the
                # wait ends, and a taker cancelled then would go on taking.
                async with asyncio.timeout(left):
                    await self._woken.wait()
            except TimeoutError:
                return []

    async def _ask(self, n: int) -> None:
        body = {
            "batch": n,
            "expires": int(self.expires * 1e9),
            "idle_heartbeat": int(self.heartbeat * 1e9),
        }
        self._requests += 1
        # What the request asked is in its reply subject, for a status that ends it.
        reply = f"{self._inbox}.{self._requests}.{n}"
        self.asked += n
        self._heard = time.monotonic()
        await self.nc.publish(self.subject, json.dumps(body).encode(), reply=reply)

    def _on(self, subject: bytes, reply: bytes, data: bytes, hdr: dict[str, str] | None) -> None:
        self._heard = time.monotonic()
        status = hdr.get(STATUS) if hdr else None
        if not status:
            msg = Msg(self.nc, subject.decode(), reply.decode(), data, hdr)
            kind = self._foreign(msg)
            if kind is not None:
                self._drop(kind, msg)
                return
            # A message names its stream subject, not its request: it counts off the total.
            self.asked = max(0, self.asked - 1)
            self._ready.put_nowait(msg)
            self._woken.set()
            return
        if status == HEARTBEAT:
            return
        # The request ended unfilled: 408 (expired) and 409 (cut short) say what it still
        # owed; a request refused outright (409 with no count) owed all it asked.
        owed = (hdr or {}).get(PENDING) or subject.decode().rsplit(".", 1)[-1]
        self.asked = max(0, self.asked - int(owed)) if owed.isdigit() else 0
        if status == EXPIRED:
            # Ask again now, not at the taker's next turn: no request is open meanwhile.
            # (A refusal waits for that turn: asking again at once could spin on it.)
            self._woken.set()

    def _foreign(self, msg: Msg) -> str | None:
        """What is wrong with a message that came without a status (None: a delivery of
        this consumer, whose metadata reads)."""
        if not msg.reply.startswith("$JS.ACK."):
            return NOT_JETSTREAM
        try:
            meta = msg.metadata  # parsed once here, kept on the message for the taker
            int(meta.sequence.stream)
            int(meta.num_delivered)
        except Exception:  # any failure to read it is the same verdict: not ours
            return BAD_METADATA
        # (Compared as read, not as a prefix: the ack subject may carry a domain.)
        if meta.stream != self.stream or meta.consumer != self.consumer:
            return OTHER_CONSUMER
        return None

    def _drop(self, kind: str, msg: Msg) -> None:
        FOREIGN.labels(self.stream, kind).inc()
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(
                "intake.foreign_message",
                stream=self.stream,
                consumer=self.consumer,
                kind=kind,
                subject=msg.subject[:200],
                reply=msg.reply[:200],
                hint="dropped; more of this kind are counted, not logged",
            )
