"""What one worker process holds, kept where another worker finds it if the process dies.

A worker that fetches step or turn messages lists them — stream and sequence, nothing else —
under ``held.<incarnation>`` in ``jl_workers``. The list is published without waiting for an
answer (a core publish into the bucket's stream: no round trip on the step's path) when the
worker fetches, and again with each presence refresh, so the bucket's TTL keeps it only
while the process lives. Lists go out at most every ``LIST_SPACING`` (25 ms): a fetch after
a quiet spell is listed at once (changes made in the same pass of the event loop share that
list), a fetch soon after a list waits for the next one, which names what is held then
(``Holds.sent``). Under load that is one list per 25 ms instead of one per fetch (≈ 1.5 per
7-step turn at 50 turns in flight, each a stored write naming every held message); the
price is that a process killed within 25 ms of such a fetch leaves those messages to their
leases. A message the worker settles (ack, nak, term) leaves the list at once but is not
published on its own: the next list leaves it out.
So a list names what the process held when it was sent, and maybe steps it settled since:
a rescuer that copies one of those finds in state that it is done (``JL_STEPS`` keeps acked
messages; a copy of a settled step does what its redelivery would, nothing twice), and one
that is a work-queue message (``JL_TURNS`` deletes what was acked) finds it gone. Publishing
the list before every settle, as this did before, cost a message per step to spare that
copy after a crash. A process that dies between a fetch and its list leaves those messages
to their leases.

A worker whose drain ran out (``jetloop.services.worker``: SIGTERM, then ``drain_seconds``)
says so in the same entry (``"drained": true``) before it cancels what it still runs, and
keeps saying it until it exits: the worker that takes such a step over resumes it as after a
crash (a call in doubt is settled the same way) but does not count it as a loss of the turn
(``jetloop.consumers.losses``): the holder stopped on purpose, it did not die.

Each list also names the server instance the process's link was on when it sent it
(``"link"``, and the header ``Jl-Link``: the server's id, new at every start of a server): the
list went over that link, after the process subscribed to ``jl.alive.<incarnation>`` on it,
so that server instance knew the subscription (``jetloop.services.probe`` relies on this).

Who reads it: ``jetloop.services.rescue``, when the server says the process's connection
closed; ``jetloop.services.probe``, which hears every list as it is sent; ``drained``, when a
step is taken over.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _string
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError

from jetloop.streams.connection import link_of
from jetloop.streams.loops import running_loop
from jetloop.streams.topology import WORKERS_BUCKET, held_key

# The least time between two lists of one process: under load, fetches every few
# milliseconds share a list instead of each writing one.
LIST_SPACING = 0.025
# The header naming the server instance a list was sent to.
H_LINK = "Jl-Link"


@dataclass
class Holds:
    """The messages this process holds now: (stream, sequence) → held."""

    nc: Client
    incarnation: str
    worker_id: str
    # Each held message as it goes into the list (JSON), encoded once, when it is fetched.
    _held: dict[tuple[str, int], str] = field(default_factory=dict)
    drained: bool = False  # its drain ran out: what it still holds is being cancelled
    _sending: asyncio.Future[None] | None = field(default=None, repr=False)
    _deferred: bool = field(default=False, repr=False)  # the next list waits out the spacing
    _last_sent: float = field(default=float("-inf"), repr=False)  # loop time of the last list

    def add(self, msg: Msg) -> None:
        held = (msg.metadata.stream, msg.metadata.sequence.stream)
        self._held[held] = f"[{_string(held[0])}, {held[1]}]"

    def drop(self, msg: Msg) -> None:
        self._held.pop((msg.metadata.stream, msg.metadata.sequence.stream), None)

    async def sent(self) -> None:
        """Return once a list made after this call has gone out, or is due (never raises).

        Changes made in the same pass of the event loop share one list: the first schedules
        its publish, the others wait for that one. The publish is for the next pass if the
        last list went out ``LIST_SPACING`` ago or more; else it is for the end of the
        spacing, and this returns at once (the fetched steps start meanwhile, and one that
        settles before then is not named at all). A lost list only means a rescuer copies a
        settled step (state decides) or a dead process's step waits for its lease."""
        sending = self._sending
        if sending is None:
            loop = running_loop()
            delay = self._last_sent + LIST_SPACING - loop.time()
            self._deferred = delay > 0
            sending = self._sending = asyncio.ensure_future(self._send(delay), loop=loop)
        if self._deferred:
            return
        await asyncio.shield(sending)

    async def _send(self, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        self._sending = None  # what changes from here on needs a list of its own
        self._last_sent = running_loop().time()
        try:
            await self.publish()
        except Exception:
            pass

    def __len__(self) -> int:
        return len(self._held)

    async def publish(self) -> None:
        """Send the list as it is now (not confirmed: a list lost with its process only
        means that process's steps wait for their leases, as they would without it)."""
        subject, body, headers = self._list()
        await self.nc.publish(subject, body, headers=headers)

    async def publish_confirmed(self, timeout: float) -> None:
        """Send the list and wait until the bucket has stored it (the drain's last word)."""
        subject, body, headers = self._list()
        await self.nc.jetstream().publish(subject, body, timeout=timeout, headers=headers)

    def _list(self) -> tuple[str, bytes, dict[str, str] | None]:
        # {"worker": …, "held": [[stream, sequence], …], "link": …}, the entries joined as
        # encoded. The link is read as the list is made: one sent while disconnected names the
        # instance it was made for, or none, never one it did not go to first.
        held = ", ".join(self._held.values())
        drained = ', "drained": true' if self.drained else ""
        link = link_of(self.nc)
        server = f', "link": {json.dumps(link[0])}' if link is not None else ""
        body = f'{{"worker": {json.dumps(self.worker_id)}, "held": [{held}]{drained}{server}}}'
        headers = {H_LINK: link[0]} if link is not None else None
        return f"$KV.{WORKERS_BUCKET}.{held_key(self.incarnation)}", body.encode(), headers


async def _last_list(js: JetStreamContext, incarnation: str) -> dict[str, Any]:
    """The list ``incarnation`` last sent (empty when none, or not one this code wrote).
    Read from the stream's leader, not by a direct get: on R3 a follower may not have the
    list its process sent a moment before it died."""
    subject = f"$KV.{WORKERS_BUCKET}.{held_key(incarnation)}"
    try:
        raw = await js.get_msg(f"KV_{WORKERS_BUCKET}", subject=subject, direct=False)
    except NotFoundError:
        return {}
    if not raw.data or (raw.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
        return {}
    try:
        body = json.loads(raw.data)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


async def held_link(js: JetStreamContext, incarnation: str) -> str | None:
    """The server instance ``incarnation``'s last list was sent to (None: it named none)."""
    return (await held_at(js, incarnation))[0]


async def held_at(js: JetStreamContext, incarnation: str) -> tuple[str | None, bool]:
    """The server instance ``incarnation``'s last list was sent to (None: it named none), and
    whether that list names anything held."""
    last = await _last_list(js, incarnation)
    link, held = last.get("link"), last.get("held")
    return (link if isinstance(link, str) and link else None), bool(held)


async def read_holds(js: JetStreamContext, incarnation: str) -> list[tuple[str, int]]:
    """The messages ``incarnation`` last said it held (empty when it said nothing)."""
    try:
        return [(str(s), int(q)) for s, q in (await _last_list(js, incarnation)).get("held", [])]
    except (ValueError, TypeError):
        return []  # not a list this code wrote: nothing to hand on


async def retire(js: JetStreamContext, incarnation: str) -> None:
    """Take ``incarnation``'s list down once what it held is handed on. A drained one keeps
    its mark, holding nothing, until the bucket's TTL: the copies handed on are taken over
    after this, and must still learn that their holder stopped on purpose."""
    kv = await js.key_value(WORKERS_BUCKET)
    last = await _last_list(js, incarnation)
    try:
        if last.get("drained") is True:
            if not last.get("held"):
                return  # already retired: a second put would only keep it longer
            mark: dict[str, Any] = {"worker": last.get("worker"), "held": [], "drained": True}
            await kv.put(held_key(incarnation), json.dumps(mark).encode())
        else:
            await kv.delete(held_key(incarnation))
    except (KeyNotFoundError, NatsError):
        pass  # the bucket's TTL removes it


async def drained(js: JetStreamContext, incarnation: str) -> bool:
    """Whether ``incarnation`` said its drain ran out (it stopped on purpose). False once its
    list is gone (the bucket's TTL, 15 s after its last word): a loss is then counted."""
    return (await _last_list(js, incarnation)).get("drained") is True
