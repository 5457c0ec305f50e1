"""Waiting for a turn's end without a consumer of its own: one core subscription per session.

A turn ends with an event stored on ``jl.event.<session>.turn.<how>`` (``completed``,
``failed``, ``cancelled``); a JetStream publish reaches core subscribers of its subject too.
So a client waiting for turns subscribes once to the three ends of each session it waits on
(``jl.event.<session>.turn.completed``, ``….failed``, ``….cancelled``: every wait on that
session shares them; ``turn.*`` would also bring each turn's ``accepted`` and ``started``,
two messages a turn the wait does nothing with) and, after subscribing, reads the
turn's record: a turn that ended before the subscription is found ended there; one that ends
after it is heard. Hearing is only a wake-up: the record decides, read again after each end
heard of the turn. A core message is not durable (a link lost and made again can miss one),
so each wait also reads the record again every ``RECHECK_SECONDS`` and when the link comes
back (``SizedClient.when_link_lost``). ``Client.send`` subscribes before it publishes a new
request it will wait for (``before_send``), so the wait that follows it hears every end of
that turn and reads the record once, at the end, instead of also before it listens. A
credential not allowed the subscription (a server configured by an older ``jetloop up``)
then still waits, by those reads alone: the refusal (``SizedClient.when_refused``) wakes
every wait to read.

Before, each wait made an ephemeral consumer filtered to the session's turn ends, read every
end the session had stored from its start, and deleted the consumer: a gateway holding a
thousand waiting requests paid that a thousand times.

In the folded log (``jetloop.schemas.log``) ``turn.completed`` rides in the last answer's
history entry (``jl.event.<session>.history.assistant``, header ``Jl-Events:
turn.completed``): there the session's assistant entries are heard too, and only one whose
header names a turn end wakes a wait. There a turn's ``accepted`` and ``started`` ride in its
user's entry, so the session's ``turn.*`` is one subscription for its ends. The layout is
read from ``JL_EVENTS`` when a session is listened to, at most every ``LAYOUT_SECONDS`` (read
as separate if it cannot be: a wait then hears a folded end only by its reads, within
``RECHECK_SECONDS``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from jetloop.schemas.events import TURN_ENDS
from jetloop.schemas.history import HistoryRole
from jetloop.schemas.log import LogLayout, turn_end_heard
from jetloop.streams import topology
from jetloop.streams.bus import H_TURN
from jetloop.streams.connection import when_link_lost, when_refused

# How often a wait reads the turn's record again without hearing its end.
RECHECK_SECONDS = 5.0
# How long the subscriptions made before a request is sent wait for the wait on its turn,
# and how many turns at most are listened for so (past that, a wait reads first).
EARLY_SECONDS = 30.0
EARLY_MOST = 10_000
# How long the log's layout, once read, is taken as it was.
LAYOUT_SECONDS = 30.0


@dataclass
class _Session:
    """The subscriptions of one session (one per way a turn ends), and how many waits share
    them."""

    ready: asyncio.Future[list[Subscription]]
    users: int = 0


@dataclass
class _Early:
    """A turn listened for since before its request was sent (``TurnEnds.before_send``)."""

    wake: asyncio.Event
    links_lost: int  # ``TurnEnds._links_lost`` when it began
    expiry: asyncio.TimerHandle | None = None


@dataclass
class TurnEnds:
    """The turn ends one connection hears, for the waits on it (``Client.wait``)."""

    nc: Client
    js: JetStreamContext | None = None  # where the log's layout is read (None: separate)
    _sessions: dict[str, _Session] = field(default_factory=dict)
    # turn id → the wake-ups of the waits on it
    _waits: dict[str, set[asyncio.Event]] = field(default_factory=dict)
    # turn id → listened for since before its request was sent, no wait on it yet
    _early: dict[str, _Early] = field(default_factory=dict)
    _links_lost: int = 0
    _hooked: bool = False
    _deaf: bool = False  # a subscription to turn ends was refused
    _letting_go: set[asyncio.Task[None]] = field(default_factory=set)
    _folded: asyncio.Future[bool] | None = None
    _folded_at: float = 0.0

    async def before_send(self, session_id: str, turn_id: str) -> None:
        """Listen for turn ``turn_id``'s end before its request is published: a wait on it
        that begins within ``EARLY_SECONDS`` and finds the link to the server unbroken since
        need not read the turn's record before it listens (its end cannot come before its
        request, and is heard from now on). Unclaimed by a wait, it is let go after that."""
        self._hook()
        if turn_id in self._early or self._deaf or len(self._early) >= EARLY_MOST:
            return
        wake = asyncio.Event()
        early = self._early[turn_id] = _Early(wake, self._links_lost)
        self._waits.setdefault(turn_id, set()).add(wake)
        try:
            await self._enter(session_id)
        except BaseException:
            self._forget(turn_id, wake)
            del self._early[turn_id]
            raise
        early.expiry = asyncio.get_running_loop().call_later(
            EARLY_SECONDS, self._expire, session_id, turn_id
        )

    def not_sent(self, session_id: str, turn_id: str) -> None:
        """The request ``before_send`` listened for was not published after all."""
        early = self._early.get(turn_id)
        if early is not None and early.expiry is not None:
            early.expiry.cancel()
            self._expire(session_id, turn_id)

    @asynccontextmanager
    async def heard(
        self, session_id: str, turn_id: str
    ) -> AsyncIterator[tuple[asyncio.Event, bool]]:
        """An event set each time an end of turn ``turn_id`` is heard (and when the link to
        the server was lost), subscribed before this yields, so an end stored after it is
        heard; and whether every end of the turn was heard so far (``before_send`` listened
        since before its request, the link unbroken since: the record need not be read
        before the event is set). The caller clears the event and reads the turn's
        record."""
        self._hook()
        early = self._early.pop(turn_id, None)
        if early is not None and early.expiry is not None:
            early.expiry.cancel()  # its use of the session's subscriptions is this wait's now
            wake, whole = early.wake, early.links_lost == self._links_lost and not self._deaf
        else:
            wake, whole = asyncio.Event(), False
            self._waits.setdefault(turn_id, set()).add(wake)
            try:
                await self._enter(session_id)
            except BaseException:
                self._forget(turn_id, wake)
                raise
        try:
            yield wake, whole
        finally:
            self._forget(turn_id, wake)
            await self._leave(session_id)

    def _hook(self) -> None:
        if not self._hooked:
            when_link_lost(self.nc, self._wake_all)
            when_refused(self.nc, self._refused)
            self._hooked = True

    def _refused(self, error: str) -> None:
        """The server refused a subscription to turn ends (a credential of a server set up
        by an older ``jetloop up``): nothing is heard, so every wait reads instead."""
        if "jl.event." in error and ".turn." in error:
            self._deaf = True
            self._wake_all()

    async def _enter(self, session_id: str) -> None:
        """One more user of the session's subscriptions, made if it has none."""
        entry = self._sessions.get(session_id)
        if entry is None:
            entry = self._sessions[session_id] = _Session(
                asyncio.get_running_loop().create_future()
            )
            subs: list[Subscription] = []
            try:
                if await self._log_folded():
                    # Folded, a turn's ``accepted`` (when it starts at once) and ``started``
                    # ride in its user entry: ``turn.*`` brings its ends (and the ``accepted``
                    # of a queued turn), two subscriptions fewer for each session.
                    subjects = [
                        topology.event_subject(session_id, "turn.*"),
                        topology.history_subject(session_id, HistoryRole.ASSISTANT),
                    ]
                else:
                    subjects = [topology.event_subject(session_id, e.value) for e in TURN_ENDS]
                for subject in subjects:
                    subs.append(await self.nc.subscribe(subject, cb=self._on))
                entry.ready.set_result(subs)
            except BaseException as exc:
                await _unsubscribe(self.nc, subs)
                entry.ready.set_exception(exc)
                entry.ready.exception()  # raised below, to each waiter
                del self._sessions[session_id]
        entry.users += 1
        try:
            await asyncio.shield(entry.ready)
        except BaseException:
            await self._leave(session_id, entry)
            raise

    async def _leave(self, session_id: str, entry: _Session | None = None) -> None:
        entry = entry or self._sessions.get(session_id)
        if entry is None:
            return
        entry.users -= 1
        if entry.users == 0 and self._sessions.get(session_id) is entry:
            del self._sessions[session_id]
            if entry.ready.done() and not entry.ready.exception():
                await _unsubscribe(self.nc, entry.ready.result())

    def _forget(self, turn_id: str, wake: asyncio.Event) -> None:
        waits = self._waits.get(turn_id)
        if waits is not None:
            waits.discard(wake)
            if not waits:
                del self._waits[turn_id]

    def _expire(self, session_id: str, turn_id: str) -> None:
        early = self._early.pop(turn_id, None)
        if early is None:
            return
        self._forget(turn_id, early.wake)
        task = asyncio.ensure_future(self._leave(session_id))
        self._letting_go.add(task)
        task.add_done_callback(self._letting_go.discard)

    async def _log_folded(self) -> bool:
        now = asyncio.get_running_loop().time()
        if self._folded is None or now - self._folded_at > LAYOUT_SECONDS:
            self._folded = asyncio.ensure_future(self._read_layout())
            self._folded_at = now
        return await asyncio.shield(self._folded)

    async def _read_layout(self) -> bool:
        if self.js is None:
            return False
        try:
            return await topology.log_layout(self.js) == LogLayout.FOLDED
        except Exception:
            return False  # (not allowed, or no server now: the reads still find the end)

    async def _on(self, msg: Msg) -> None:
        if turn_end_heard(msg.subject, msg.headers) is None:
            return  # an answer that asked for calls: the turn goes on
        turn_id = (msg.headers or {}).get(H_TURN)
        for wake in self._waits.get(turn_id or "", ()):
            wake.set()

    def _wake_all(self) -> None:
        self._links_lost += 1
        for waits in self._waits.values():
            for wake in waits:
                wake.set()


async def _unsubscribe(nc: Client, subs: list[Subscription]) -> None:
    if nc.is_closed:
        return
    for sub in subs:
        await sub.unsubscribe()
