"""What every handler works with: the worker's shared parts and the delivery in hand.

``Delivery.claim`` and ``Delivery.commit`` are the fence of rule 2: the claim records the
attempt with a CAS, every later write expects the revision written last, and a lost CAS
raises ``TakenOver``. The heartbeat writes the claimed record again (the same value, a CAS
like any commit) and then sends an in-progress ack: the write proves the fence still holds
and is the holder's sign of life that another delivery reads (``jetloop.consumers.liveness``); a
heartbeat that finds the fence lost cancels the paid work in flight (``cancelled_when_lost``).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from pydantic import BaseModel

from jetloop.agents import App
from jetloop.agents.prices import Prices
from jetloop.consumers.conversation import MessageCache
from jetloop.consumers.errors import StaleCarry, TakenOver
from jetloop.consumers.faults import Faults
from jetloop.consumers.slots import CallSlots
from jetloop.consumers.tracing import Tracing
from jetloop.schemas import Attempt, CallRecord
from jetloop.schemas.ids import DEFAULT_NAMESPACE
from jetloop.streams.blobs import BlobStore
from jetloop.streams.bus import H_HOLDER_LOST, Bus
from jetloop.streams.connection import linked_for
from jetloop.streams.history import HistoryReader
from jetloop.streams.holds import Holds
from jetloop.streams.loops import running_loop
from jetloop.streams.pauses import Pauses
from jetloop.streams.state import Conflict, StateStore
from jetloop.streams.windows import EndpointLimits, Windows

if TYPE_CHECKING:
    from jetloop.consumers.join import StepCalls

log = structlog.get_logger("jetloop.fence")


def new_incarnation() -> str:
    """A name for one worker process's life."""
    return uuid.uuid4().hex[:12]


class Unstarted:
    """The attempts this process claimed and has not begun the work of (a model call): one
    whose claim is found later, held by no delivery of this process, never ran. A claim can
    land although its answer said it lost (during a failover two servers may answer one
    write, the stale one "wrong last sequence"), and a delivery can end between its claim and
    its work; the next delivery then finds this process's own claim and continues that
    attempt instead of counting another. Only this process knows, so a claim of another
    process, or of this one once forgotten, is taken over as any other (and counted)."""

    MOST = 4096  # forgotten past this (then counted: the safe side)

    def __init__(self) -> None:
        self._keys: set[tuple[str, int]] = set()

    def claiming(self, key: str, no: int) -> None:
        if len(self._keys) >= self.MOST:
            self._keys.clear()
        self._keys.add((key, no))

    def began(self, key: str, no: int) -> None:
        self._keys.discard((key, no))

    def take(self, key: str, no: int) -> bool:
        """Whether attempt ``no`` of ``key`` was claimed here and its work never began."""
        if (key, no) in self._keys:
            self._keys.discard((key, no))
            return True
        return False


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
    # The namespace this worker serves (JETLOOP_NAMESPACE): ids are unique only within one,
    # so the idempotency keys it makes and the tool context it gives carry it.
    namespace: str = DEFAULT_NAMESPACE
    faults: Faults = field(default_factory=Faults)
    max_losses: int = 2
    # How long a step a newer jetloop wrote is handed back before it is dead-lettered.
    newer_writer_seconds: float = 3600.0
    # Names this process's life in its claims: a worker id can be reused after a restart.
    incarnation: str = field(default_factory=lambda: new_incarnation())
    messages: MessageCache = field(default_factory=MessageCache)
    # The state keys this process's deliveries have claimed and still work on.
    holding: set[str] = field(default_factory=set)
    # The attempts this process claimed whose paid work has not begun (``Unstarted``).
    unstarted: Unstarted = field(default_factory=Unstarted)
    # The messages this process holds, as a rescuer finds them if it dies (jetloop.services.worker).
    holds: Holds | None = None
    # What model calls cost (jetloop.agents.prices): the usage ledger charges by it.
    prices: Prices = field(default_factory=Prices)
    # Providers paused by a 429, shared by every worker (jetloop.streams.pauses).
    pauses: Pauses = field(default_factory=Pauses)
    # Requests and tokens per window, by endpoint (JETLOOP_PROVIDER_LIMITS), and the shared
    # windows they are counted in (jetloop.streams.windows).
    provider_limits: dict[str, EndpointLimits] = field(default_factory=dict)
    windows: Windows = field(default_factory=Windows)
    # Traces of turns (jetloop.consumers.tracing), None when off.
    tracing: Tracing | None = None
    # Whether a model step's calls go in one ``call_tools`` message: only while every live
    # worker runs that kind (its presence says so; set by jetloop.services.worker), else a
    # message per call, which every release runs.
    calls_in_one_message: bool = False
    # Whether a step's reads may keep their outcomes in one record (``StepReads``): only
    # while every live worker reads it (``Registry.every_worker_takes``).
    step_reads: bool = False
    # Whether the results of a step's reads kept together go to the log in one history
    # entry (``HistoryEntry.parts``): only while every live worker reads it.
    results_entry: bool = False
    # The session log's layout (jetloop.schemas.log, JETLOOP_EVENT_LOG): True, folded (an
    # event that tells the same fact as a history entry rides in it).
    folded_log: bool = False
    # How many calls of ``call_tools`` messages run at once (the tool pool's concurrency: a
    # message of n calls counts n); None: no bound.
    call_slots: CallSlots | None = None

    def limits_of(self, adapter: object) -> EndpointLimits | None:
        """The limits of the endpoint ``adapter`` calls: by ``provider:model``, else by the
        model's name; None when none are set."""
        if not self.provider_limits:
            return None
        model = getattr(adapter, "model", None)
        provider = getattr(adapter, "provider", None)
        return self.provider_limits.get(f"{provider}:{model}") or self.provider_limits.get(
            str(model)
        )

    def stored_since_link(self, stored_at: float) -> bool:
        """Whether the server stored a message at ``stored_at`` (its clock) after this
        process's current link to it opened, by more than ``LINK_MARGIN`` and the
        measurement's error (on the server's clock, as this process last measured its own
        against it; unmeasured, taken as equal)."""
        up = linked_for(self.nc)
        if up == 0.0:
            return False  # no link now: nothing can be told
        if math.isinf(up):
            return True  # a client whose links are not followed (tests' plain clients)
        guard = self.state.sealer.guard if self.state.sealer is not None else None
        reading = guard.reading if guard is not None else None
        offset, error = (reading.now(), reading.error) if reading is not None else (0.0, 0.0)
        opened = time.time() - up - offset
        return stored_at > opened + error + LINK_MARGIN

    def took_unstarted(self, key: str, held: Attempt) -> bool:
        """Whether ``held`` is an attempt of this process whose work never began
        (``Unstarted``), forgotten as it is told: the caller continues it."""
        return held.incarnation == self.incarnation and self.unstarted.take(key, held.no)

    def new_attempt(self, no: int) -> Attempt:
        return Attempt(
            no=no, worker=self.worker_id, started_at=time.time(), incarnation=self.incarnation
        )


# How long after this process's link to the server (re)opened a message must have been stored
# to be taken for a first delivery on its count (``Delivery.first_sight``), beyond the error of
# the measured offset between the two clocks: the server's stamp and the clocks' drift since.
LINK_MARGIN = 0.02


class Delivery:
    """One message being handled, and the fence of the attempt it carries."""

    def __init__(self, rt: Runtime, msg: Msg) -> None:
        self.rt = rt
        self.msg = msg
        self.fence_key: str | None = None
        self.fence_rev: int | None = None
        self.fence_value: BaseModel | None = None  # what this attempt wrote last
        self.fenced_at = 0.0  # monotonic time of the last fenced write that landed
        self.lost = False
        # Set by a call handler: the heartbeat then also notices a cancelled turn.
        self.watch_turn: tuple[str, str] | None = None
        self.cancelled = False
        # Writes and the heartbeat's check never overlap, or a check could read the
        # revision of a write whose answer has not reached us yet and think we lost.
        self._lock = asyncio.Lock()
        # The task in a ``cancelled_when_lost`` block, and whether a loss cancelled it.
        self._paid: asyncio.Task[object] | None = None
        self._cancelled_for_loss = False
        # A message that carries several calls (``call_tools``) handles each as a part: a
        # delivery of the same message with a fence of its own (``part``).
        self.parts: list[Delivery] = []
        # A part's: what the parts of its message know of their step (``consumers.join``).
        self.together: StepCalls | None = None
        self.ended = False  # a part's: its call ended its work (``end_part``)

    def part(self) -> Delivery:
        """One call of a message that carries several: fenced on its own (its claim, its
        commits, its loss), settled with the message (the parts' handler decides how)."""
        part = Delivery(self.rt, self.msg)
        self.parts.append(part)
        return part

    @property
    def num_delivered(self) -> int:
        n: int = self.msg.metadata.num_delivered
        return n

    @property
    def first_sight(self) -> bool:
        """The message's first delivery: its count says 1, it is not a rescuer's copy of one
        a dead process held, and it was stored after this process's link to the server
        (re)opened. A nats-server restarted on its store may deliver again, as delivery 1, a
        message it delivered (even one acked) before the restart: its consumer state had not
        reached disk; such a message was stored before the link the restart made. What a
        first delivery carries was current when it was published, and likely is still."""
        if self.num_delivered != 1 or H_HOLDER_LOST in (self.msg.headers or {}):
            return False
        return self.rt.stored_since_link(self.msg.metadata.timestamp.timestamp())

    async def claim(
        self, key: str, value: BaseModel, revision: int | None, carried: bool = False
    ) -> int:
        """Record this attempt with a CAS from the revision read; lost → TakenOver.
        ``carried``: the revision came with the message, not from a read, and a record
        written since is ``StaleCarry`` (nothing was lost: the step reads and starts again)."""
        async with self._lock:
            # Held from before the write is sent: a write whose answer a restarting server
            # loses is tried again, and meanwhile that server may deliver this same message
            # again (as delivery 1); that delivery must see the key held here, not a claim
            # of this process that "ended without finishing" (jetloop.consumers.liveness).
            fresh = key not in self.rt.holding
            self.rt.holding.add(key)
            try:
                rev = await self.rt.state.write(key, value, revision)
            except Conflict as exc:
                if fresh:
                    self.rt.holding.discard(key)
                if carried and self.fence_key is None:
                    raise StaleCarry(key) from exc
                self._lose()
                raise TakenOver(key) from exc
            except BaseException:
                if fresh and key != self.fence_key:
                    self.rt.holding.discard(key)
                raise
            if self.fence_key is not None and self.fence_key != key:
                self.rt.holding.discard(self.fence_key)
            self.fence_key, self.fence_rev, self.fence_value = key, rev, value
            self.fenced_at = time.monotonic()
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
                log.info("fence.lost_on_commit", key=self.fence_key, rev=self.fence_rev)
                self._lose()
                raise TakenOver(self.fence_key) from exc
            self.fence_rev, self.fence_value = rev, value
            self.fenced_at = time.monotonic()
            return rev

    async def still_ours(self, fresh_for: float = 0.0) -> bool:
        """Read the fence back, unless this attempt wrote it less than ``fresh_for`` seconds
        ago. A takeover needs the lease to lapse, and the lease began at the delivery, just
        before the claim; so a short while after the claim the read would only cost a round
        trip. (A delivery that waited in the client past its lease is still fenced: every
        later commit is a CAS, so it records nothing.)"""
        async with self._lock:
            if self.lost:
                return False
            if self.fence_key is None:
                return True
            if time.monotonic() - self.fenced_at < fresh_for:
                return True
            current = await self.rt.state.revision(self.fence_key)
            if current != self.fence_rev:
                log.info(
                    "fence.lost_on_read", key=self.fence_key, rev=self.fence_rev, current=current
                )
                self._lose()
            return not self.lost

    def end_part(self) -> None:
        """This part's call ended its work in the message (an outcome committed, a wait
        begun, a failure): its record is not written again for the message — a wait's own
        message may commit it meanwhile, and a heartbeat rewriting the wait over that
        commit would fail and take the whole message for lost — and its key is no longer
        held here."""
        self.ended = True
        self.release()

    def release(self) -> None:
        """The delivery ended: this process no longer works on the key it claimed."""
        if self.fence_key is not None:
            self.rt.holding.discard(self.fence_key)
        for part in self.parts:
            part.release()

    def _lose(self) -> None:
        """The fence is lost: stop the paid work in flight, if another task found it."""
        self.lost = True
        if self.fence_key is not None:
            self.rt.holding.discard(self.fence_key)
        paid = self._paid
        if paid is not None and paid is not asyncio.current_task():
            if not self._cancelled_for_loss:
                self._cancelled_for_loss = True
                paid.cancel("the step was taken over")

    @asynccontextmanager
    async def cancelled_when_lost(self) -> AsyncIterator[None]:
        """Run paid work (a model call and its stream) so that a heartbeat finding the fence
        lost cancels it at once; the block then raises ``TakenOver``, so the step commits,
        publishes and acks nothing. It only arms the cancel: check the fence right before
        (``still_ours``), since a loss found before the block does not cancel it."""
        task = asyncio.current_task(running_loop())
        assert task is not None, "cancelled_when_lost outside a task"
        self._paid = task
        try:
            yield
        except asyncio.CancelledError:
            # Ours only if nobody else (a shutdown past its drain) cancelled the task too.
            if self._cancelled_for_loss and task.uncancel() == 0:
                raise TakenOver(self.fence_key or "?") from None
            raise
        finally:
            self._paid = None
        if self._cancelled_for_loss:
            # The answer came in the same instant the loss was found: it is not ours to use.
            raise TakenOver(self.fence_key or "?")

    async def heartbeat(self) -> None:
        """Write the claimed record again and extend the lease, unless another attempt has
        taken the step over (then the write's CAS fails and nothing is sent)."""
        if self.parts:
            await self._beat_parts()
            return
        if self.fence_value is not None and not self.lost:
            await self._rewrite()
        if not self.lost:
            await self.msg.in_progress()
        if self.watch_turn is not None and not self.cancelled:
            turn = await self.rt.state.turn(*self.watch_turn)
            if turn is not None and turn.value.status == "cancelled":
                self.cancelled = True

    async def _beat_parts(self) -> None:
        """The heartbeat of a message of several calls: the record of each call still at work
        written again (the sign of life of the calls still ours), the turn read once, and the
        message's lease extended only while no call of it was taken over: a taken call means
        another attempt holds the message now, and JetStream does not fence an older
        delivery's in-progress."""
        parts = [p for p in self.parts if not p.ended]
        await asyncio.gather(*(p._rewrite() for p in parts if p.fence_value is not None))
        if not any(p.lost for p in self.parts):
            await self.msg.in_progress()
        watching = [p for p in parts if p.watch_turn is not None and not p.cancelled]
        if watching and watching[0].watch_turn is not None:
            turn = await self.rt.state.turn(*watching[0].watch_turn)
            if turn is not None and turn.value.status == "cancelled":
                for p in watching:
                    p.cancelled = True

    async def _rewrite(self) -> None:
        """Write what this attempt wrote last once more, as it is *when the lock is ours*: a
        value read before waiting for the lock could be older than a commit that held it, and
        writing it would undo that commit."""
        async with self._lock:
            if self.lost or self.fence_key is None or self.fence_value is None:
                return
            if isinstance(self.fence_value, CallRecord) and self.fence_value.done:
                # A call's outcome is its step's last write of the record: the join elects
                # the call committed last by the records' revisions (``consumers.join``).
                return
            try:
                rev = await self.rt.state.write(self.fence_key, self.fence_value, self.fence_rev)
            except Conflict:
                log.info("fence.lost_on_beat", key=self.fence_key, rev=self.fence_rev)
                self._lose()
                return
            self.fence_rev = rev
            self.fenced_at = time.monotonic()
