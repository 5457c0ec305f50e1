"""Find a dead worker fast without the system account: ask the processes that hold something.

Where a worker hears the system account's disconnect advisories (``jetloop.services.rescue``),
the server tells it at once that a connection closed, and why. Where it does not — a NATS of
your own or a managed one without a system-account user — nobody is told, and a dead
worker's steps would wait for their leases. So every worker that does not watch the
advisories asks instead: every ``PROBE_EVERY`` it asks each other process that holds
something, on ``jl.alive.<incarnation>``, whether it lives.

"No responders" is evidence only in one case, and the probe acts only in it: the holder's
last list (``jetloop.streams.holds``) names the server *instance* its link was on when it
sent the list (the server's id, which a server makes anew at every start), and that is the
instance this worker's own link is on now. The holder subscribed to ``jl.alive`` before it
sent any list, over the same link, so that server had the subscription; if the same server,
still running, now knows no one on that subject, the holder's connection to it closed (a
live process never unsubscribes). A process killed while the server stays up is the common
case, and it is found within ``PROBE_EVERY`` + ``GONE_PATIENCE``.

What "no responders" cannot tell, the probe leaves alone:

- a list that names another instance: the server restarted since (every process was cut
  off, and a live one may still be connecting again), or the holder is linked to another
  node of a cluster, which may still know a subscription that this node's routes have not
  heard of yet, or no longer; its lease (or, where one is heard, the advisory) decides;
- a live process whose connection the server closed (a slow consumer): it connects again at
  once and subscribes first. Silence is asked again for ``GONE_PATIENCE``, and it counts only
  if every answer in that while was "no responders" and this worker's own link stayed on the
  same instance throughout (a timeout, or a link that dropped, says nothing).

The probe hands on what a gone process held exactly as the advisory's path does
(``Rescuer.rescue``): copies every deliverer checks again before it takes over
(``jetloop.consumers.liveness``), so nothing decides an outcome here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from jetloop.consumers.liveness import silent
from jetloop.services.rescue import Rescuer
from jetloop.streams.connection import link_of
from jetloop.streams.holds import H_LINK, held_at
from jetloop.streams.topology import WORKERS_BUCKET, held_key

log = structlog.get_logger("jetloop.probe")

# How often the processes that hold something are looked at; one that sent a list within
# this while is not asked (it lived a moment ago, and a busy one sends one every few
# milliseconds): asking costs a round trip only of the quiet ones.
PROBE_EVERY = 0.2
LISTS = f"$KV.{WORKERS_BUCKET}.{held_key('*')}"
# A list that names nothing held: its process has nothing to hand on.
_EMPTY = b'"held": []'


class Probe:
    """One worker's part where it hears no disconnect advisories: ask the quiet holders on
    the server instance this worker is linked to, and hand on what a gone one held."""

    def __init__(
        self,
        nc: Client,
        incarnation: str,
        rescuer: Rescuer,
        stopping: asyncio.Event,
        every: float = PROBE_EVERY,
    ) -> None:
        self.nc = nc
        self.incarnation = incarnation
        self.rescuer = rescuer
        self.stopping = stopping
        self.every = every
        # incarnation → (the instance its last list was sent to, when it was heard)
        self.holders: dict[str, tuple[str, float]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _heard(self, msg: Msg) -> None:
        inc = msg.subject.rpartition(".")[2]
        if inc == self.incarnation:
            return
        headers = msg.headers or {}
        link = headers.get(H_LINK)
        if headers.get("KV-Operation") in ("DEL", "PURGE") or not link or _EMPTY in msg.data:
            # Gone on purpose, or holding nothing (or naming no instance: not judged).
            self.holders.pop(inc, None)
            return
        self.holders[inc] = (link, time.monotonic())

    async def run(self) -> None:
        """Hear the lists and ask the quiet holders until stopped (the rescuer's advisory
        watch, while it runs, does this instead)."""

        async def heard(msg: Msg) -> None:
            self._heard(msg)

        sub = await self.nc.subscribe(LISTS, cb=heard)
        try:
            await self._load()
            while not self.stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), self.every)
                if not self.rescuer.watching:
                    self._look()
        finally:
            for t in list(self._tasks):
                t.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _load(self) -> None:
        """The lists sent before this probe listened (a holder busy inside one long step sends
        its next only with its presence refresh): read once, as if heard long ago."""
        for inc in await self.rescuer.listed():
            if inc == self.incarnation or inc in self.holders:
                continue
            link, held = await held_at(self.rescuer.js, inc)
            if link is not None and held and inc not in self.holders:
                self.holders[inc] = (link, float("-inf"))

    def _look(self) -> None:
        link = link_of(self.nc)
        if link is None:
            return
        quiet_since = time.monotonic() - self.every
        for inc, (on, heard) in list(self.holders.items()):
            if on != link[0] or heard > quiet_since or inc in self.rescuer.busy:
                continue
            self.rescuer.busy.add(inc)
            task = asyncio.ensure_future(self._check(inc))
            self._tasks.add(task)
            done: Callable[[asyncio.Task[None]], None] = self._tasks.discard
            task.add_done_callback(done)

    async def _check(self, inc: str) -> None:
        try:
            if not await silent(self.nc, inc):
                return
            self.holders.pop(inc, None)
            handed = await self.rescuer.rescue(inc)
            log.info("rescue.handed_on", incarnation=inc, reason="probe", messages=handed)
        except Exception as exc:  # an outage: the leases still bring the steps back
            log.warning("rescue.failed", incarnation=inc, error=str(exc))
        finally:
            self.rescuer.busy.discard(inc)
