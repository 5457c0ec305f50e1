"""What one worker process holds, kept where another worker finds it if the process dies.

A worker that fetches step or turn messages lists them — stream and sequence, nothing else —
under ``held.<incarnation>`` in ``jl_workers``. The list is published without waiting for an
answer (a core publish into the bucket's stream: no round trip on the step's path) at once
each time the worker fetches, at most ``SETTLE_SECONDS`` after messages are let go (acked,
nak'd, given back), and again with each presence refresh, so the bucket's TTL keeps it only
while the process lives. Whoever reads the list checks that each message is still in its
stream (a work queue deletes a message once it is acked); the prompt update after a let-go
keeps a message nak'd for later (a wait for an approval, a timer) from being handed on early.

Who reads it: ``services.rescue``, when the server says the process's connection closed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from streams.topology import WORKERS_BUCKET, held_key

SETTLE_SECONDS = 0.05


@dataclass
class Holds:
    """The messages this process holds now: (stream, sequence) → held."""

    nc: Client
    incarnation: str
    worker_id: str
    _held: dict[tuple[str, int], None] = field(default_factory=dict)
    _update: asyncio.Task[None] | None = None

    def add(self, msg: Msg) -> None:
        self._held[(msg.metadata.stream, msg.metadata.sequence.stream)] = None

    def drop(self, msg: Msg) -> None:
        """The message is let go; the list says so shortly (one update for many let-gos)."""
        self._held.pop((msg.metadata.stream, msg.metadata.sequence.stream), None)
        if self._update is None or self._update.done():
            self._update = asyncio.ensure_future(self._publish_soon())

    async def _publish_soon(self) -> None:
        await asyncio.sleep(SETTLE_SECONDS)
        try:
            await self.publish()
        except Exception:  # a lost update: the next one, or the presence refresh, sends it
            pass

    def __len__(self) -> int:
        return len(self._held)

    async def publish(self) -> None:
        """Send the list as it is now (not confirmed: a list lost with its process only
        means that process's steps wait for their leases, as they would without it)."""
        body = {"worker": self.worker_id, "held": [[s, q] for s, q in self._held]}
        subject = f"$KV.{WORKERS_BUCKET}.{held_key(self.incarnation)}"
        await self.nc.publish(subject, json.dumps(body).encode())


async def read_holds(kv: KeyValue, incarnation: str) -> list[tuple[str, int]]:
    """The messages ``incarnation`` last said it held (empty when it said nothing)."""
    try:
        entry = await kv.get(held_key(incarnation))
    except KeyNotFoundError:
        return []
    if not entry.value:
        return []
    try:
        body = json.loads(entry.value)
        return [(str(s), int(q)) for s, q in body.get("held", [])]
    except (ValueError, TypeError, AttributeError):
        return []  # not a list this code wrote: nothing to hand on
