"""What every handler works with: the worker's shared parts and the delivery in hand.

``Delivery.claim`` and ``Delivery.commit`` are the fence of rule 2: the claim records the
attempt with a CAS, every later write expects the revision written last, and a lost CAS
raises ``TakenOver``. The heartbeat sends an in-progress ack only while the fence holds.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from pydantic import BaseModel

from agents import App
from consumers.errors import TakenOver
from consumers.faults import Faults
from schemas import Attempt
from streams.blobs import BlobStore
from streams.bus import Bus
from streams.history import HistoryReader
from streams.state import Conflict, StateStore


@dataclass
class Runtime:
    nc: Client
    js: JetStreamContext
    state: StateStore
    blobs: BlobStore
    history: HistoryReader
    bus: Bus
    app: App
    worker_id: str
    lease_seconds: float
    faults: Faults = field(default_factory=Faults)
    max_losses: int = 2

    def new_attempt(self, no: int) -> Attempt:
        return Attempt(no=no, worker=self.worker_id, started_at=time.time())


class Delivery:
    """One message being handled, and the fence of the attempt it carries."""

    def __init__(self, rt: Runtime, msg: Msg) -> None:
        self.rt = rt
        self.msg = msg
        self.fence_key: str | None = None
        self.fence_rev: int | None = None
        self.lost = False
        # Set by a call handler: the heartbeat then also notices a cancelled turn.
        self.watch_turn: tuple[str, str] | None = None
        self.cancelled = False
        # Writes and the heartbeat's check never overlap, or a check could read the
        # revision of a write whose answer has not reached us yet and think we lost.
        self._lock = asyncio.Lock()

    @property
    def num_delivered(self) -> int:
        n: int = self.msg.metadata.num_delivered
        return n

    async def claim(self, key: str, value: BaseModel, revision: int | None) -> int:
        """Record this attempt with a CAS from the revision read; lost → TakenOver."""
        async with self._lock:
            try:
                rev = await self.rt.state.write(key, value, revision)
            except Conflict as exc:
                self.lost = True
                raise TakenOver(key) from exc
            self.fence_key, self.fence_rev = key, rev
            return rev

    async def commit(self, value: BaseModel) -> int:
        """Write the fenced key, expecting the revision this attempt wrote last."""
        assert self.fence_key is not None and self.fence_rev is not None, "commit before claim"
        async with self._lock:
            if self.lost:
                raise TakenOver(self.fence_key)
            try:
                rev = await self.rt.state.write(self.fence_key, value, self.fence_rev)
            except Conflict as exc:
                self.lost = True
                raise TakenOver(self.fence_key) from exc
            self.fence_rev = rev
            return rev

    async def still_ours(self) -> bool:
        async with self._lock:
            if self.lost:
                return False
            if self.fence_key is None:
                return True
            current = await self.rt.state.revision(self.fence_key)
            if current != self.fence_rev:
                self.lost = True
            return not self.lost

    async def heartbeat(self) -> None:
        """Extend the lease, unless another attempt has taken the step over."""
        if await self.still_ours():
            await self.msg.in_progress()
        if self.watch_turn is not None and not self.cancelled:
            turn = await self.rt.state.turn(*self.watch_turn)
            if turn is not None and turn.value.status == "cancelled":
                self.cancelled = True
