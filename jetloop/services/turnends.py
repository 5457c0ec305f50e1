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
back (``SizedClient.when_link_lost``). A credential not allowed the subscription (a server
configured by an older ``jetloop up``) then still waits, by those reads alone.

Before, each wait made an ephemeral consumer filtered to the session's turn ends, read every
end the session had stored from its start, and deleted the consumer: a gateway holding a
thousand waiting requests paid that a thousand times.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from jetloop.schemas.events import TURN_ENDS
from jetloop.streams import topology
from jetloop.streams.bus import H_TURN
from jetloop.streams.connection import when_link_lost

# How often a wait reads the turn's record again without hearing its end.
RECHECK_SECONDS = 5.0


@dataclass
class _Session:
    """The subscriptions of one session (one per way a turn ends), and how many waits share
    them."""

    ready: asyncio.Future[list[Subscription]]
    users: int = 0


@dataclass
class TurnEnds:
    """The turn ends one connection hears, for the waits on it (``Client.wait``)."""

    nc: Client
    _sessions: dict[str, _Session] = field(default_factory=dict)
    # turn id → the wake-ups of the waits on it
    _waits: dict[str, set[asyncio.Event]] = field(default_factory=dict)
    _hooked: bool = False

    @asynccontextmanager
    async def heard(self, session_id: str, turn_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set each time an end of turn ``turn_id`` is heard (and when the link to
        the server was lost): subscribed before this yields, so an end stored after it is
        heard. The caller clears it and reads the turn's record."""
        if not self._hooked:
            when_link_lost(self.nc, self._wake_all)
            self._hooked = True
        wake = asyncio.Event()
        self._waits.setdefault(turn_id, set()).add(wake)
        entry = self._sessions.get(session_id)
        if entry is None:
            entry = self._sessions[session_id] = _Session(
                asyncio.get_running_loop().create_future()
            )
            subs: list[Subscription] = []
            try:
                for end in TURN_ENDS:
                    subject = topology.event_subject(session_id, end.value)
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
            yield wake
        finally:
            waits = self._waits.get(turn_id)
            if waits is not None:
                waits.discard(wake)
                if not waits:
                    del self._waits[turn_id]
            entry.users -= 1
            if entry.users == 0 and self._sessions.get(session_id) is entry:
                del self._sessions[session_id]
                if entry.ready.done() and not entry.ready.exception():
                    await _unsubscribe(self.nc, entry.ready.result())

    async def _on(self, msg: Msg) -> None:
        turn_id = (msg.headers or {}).get(H_TURN)
        for wake in self._waits.get(turn_id or "", ()):
            wake.set()

    def _wake_all(self) -> None:
        for waits in self._waits.values():
            for wake in waits:
                wake.set()


async def _unsubscribe(nc: Client, subs: list[Subscription]) -> None:
    if nc.is_closed:
        return
    for sub in subs:
        await sub.unsubscribe()
