"""The worker process: pulls steps of the pools it serves and runs their handlers.

Lifecycle (docs/design.md, convention 3): ``run()`` until ``stop()``; stop intake → drain in-flight
steps for ``drain_seconds`` → cancel the rest (their messages are handed back with a nak) → close.
It fetches only as many messages as it has free slots, so nothing it holds waits unstarted past its
lease.

Its clock: measured against the NATS server's before it serves anything, and every
``JETLOOP_CLOCK_CHECK_SECONDS`` after (``jetloop.streams.clock``). While it is off by more
than half the seal tolerance, every record it sealed would be rejected by every reader, so
it seals nothing, takes no steps or turns (those already on their way here are handed
back unstarted) and answers no control requests: the other workers serve them. It says so
once (``worker.clock_off``, with the offset), and once again when the clock is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Sequence

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import start_http_server

from jetloop.agents import App
from jetloop.agents.prices import Prices
from jetloop.consumers import Faults, Runtime, dispatch, metrics, route_step, route_turn
from jetloop.consumers.dispatch import Handler
from jetloop.consumers.liveness import HOLDING
from jetloop.consumers.metrics import watch_lag
from jetloop.consumers.runtime import new_incarnation
from jetloop.consumers.slots import CallSlots
from jetloop.consumers.tracing import Tracing
from jetloop.schemas.errors import NotAuthorized
from jetloop.schemas.kinds import StepKind
from jetloop.schemas.log import LogLayout
from jetloop.services.client import publish_trigger
from jetloop.services.control import ControlService
from jetloop.services.lifecycle import Service
from jetloop.services.probe import Probe
from jetloop.services.rescue import Rescuer, connection_name, password_user
from jetloop.services.runner import loop_name
from jetloop.services.settings import Settings
from jetloop.sessions.decisions import Control
from jetloop.streams import topology
from jetloop.streams.blobs import BlobStore
from jetloop.streams.bus import Bus
from jetloop.streams.clock import ClockGuard, describe
from jetloop.streams.connection import ConnectionLost, connect, finish
from jetloop.streams.consumer_guard import guard_consumers
from jetloop.streams.history import HistoryReader
from jetloop.streams.holds import Holds
from jetloop.streams.intake import Intake
from jetloop.streams.pauses import Pauses
from jetloop.streams.registry import RESULTS_ENTRY, STEP_READS, Registry
from jetloop.streams.state import StateStore
from jetloop.streams.topology import alive_subject
from jetloop.streams.windows import Windows

log = structlog.get_logger("jetloop.worker")
# What to do about a stream nats-server left without a leader (docs/design.md, "What is not
# promised"): the presence bucket holds nothing durable; any other needs NATS's own recovery.
LEADERLESS_HINT = (
    "nats-server left these streams without a leader; KV_jl_workers holds only presences: "
    "delete it (nats stream rm KV_jl_workers, as this namespace's account) and a worker makes "
    "it again; for any other stream see NATS's recovery docs (docs/design.md, What is not "
    "promised)"
)

# Once every live worker runs the newest step kinds, the presences are read again only with
# every this-many-th refresh of this worker's own (every 30 s), not every 5 s.
KINDS_CHECK_EVERY = 6


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker(Service):
    """A worker process's engine: serves the agents of an app (``run()`` until ``stop()``,
    or ``async with``). Start it with ``jetloop worker --app module:attr`` or in-process."""

    def __init__(
        self,
        settings: Settings,
        app: App,
        pools: Sequence[str] | None = None,
        worker_id: str | None = None,
        apply_topology: bool = True,
        faults: Faults | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.app = app
        # Default: the engine's pools and those of the tools this app makes in pools of
        # their own (never those it declares as served elsewhere).
        self.pools = served_pools(app, pools)
        self.worker_id = worker_id or settings.worker_id or default_worker_id()
        self.apply_topology = apply_topology
        self.faults = faults or Faults.from_env()
        self._nc: Client | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._since = time.time()
        self._kinds_checks = 0  # presence refreshes since the start (``_kinds_written``)
        # The pull loops' intakes: at each reconnect their open requests may have gone with
        # the server, so they ask again at once.
        self._intakes: list[Intake] = []
        self._rt: Runtime | None = None
        self._clock = ClockGuard(settings.seal_tolerance_seconds)
        # Set while this worker may serve: cleared while its clock is too far off to seal.
        self._serving = asyncio.Event()
        self._serving.set()
        self._control: ControlService | None = None
        # Only a worker that seals is held back by its clock (unsealed records are not
        # checked against the server's time).
        self._seals = settings.sealer() is not None

    def _on_reconnected(self) -> None:
        for intake in self._intakes:
            intake.forget_requests()

    def _concurrency(self, pool: str) -> int:
        s = self.settings
        return {
            topology.SESSION_POOL: s.session_concurrency,
            topology.MODEL_POOL: s.model_concurrency,
        }.get(pool, s.tool_concurrency)  # the tool pool, and tools' pools of their own

    def agents(self) -> list[str]:
        """The agents this worker serves, as its presence lists them: those it pulls any
        pool of (a worker of a pool of its own: the agents with tools in that pool)."""
        return sorted(a for a in self.app.agents if self._pools_of(a))

    def _pools_of(self, agent: str) -> tuple[str, ...]:
        """The pools this worker pulls for ``agent``: a tool's pool of its own only for an
        agent that has such a tool."""
        theirs = set(topology.POOLS) | set(self.app.tool_pools(agent))
        return tuple(p for p in self.pools if p in theirs)

    async def run(self) -> None:
        s = self.settings
        if s.sealer() is None:
            log.warning(
                "worker.unsealed",
                hint="records are written unsealed: set JETLOOP_SEAL_KEY, or run where "
                f"{s.store_dir / 'seal.key'} is (the key `jetloop up` keeps)",
            )
        lost: list[ConnectionLost] = []

        async def on_closed() -> None:
            # A closed connection is never reopened: stop, and raise from run() (below) so a
            # supervisor, or the process's exit status, starts a fresh worker.
            if not self._stopping.is_set():
                log.error("worker.connection_closed", worker=self.worker_id)
                lost.append(ConnectionLost(f"worker {self.worker_id}"))
                self.stop_soon()

        incarnation = new_incarnation()
        nc = await connect(
            s.nats_urls,
            name=connection_name(self.worker_id, incarnation),
            closed_cb=on_closed,
            reconnected_cb=self._on_reconnected,
        )
        self._nc = nc
        js = nc.jetstream()
        try:
            # Answered while this process lives: another worker asks before it takes over a
            # step this one claimed (jetloop.consumers.liveness).
            await nc.subscribe(alive_subject(incarnation), cb=self._answer_alive)
            registry = await self._prepare(js)
            # Before anything is served or sealed: a worker whose clock is off starts gated.
            await self._first_clock(nc)
            holds = Holds(nc, incarnation, self.worker_id)
            rescuer = Rescuer(nc, incarnation, self._stopping, password_user(s.nats_urls))
            state = await StateStore.open(nc, s.sealer())
            if state.sealer is not None:
                state.sealer.guard = self._clock
            # A heartbeat's write lost with a restarting server is sent again well within
            # the lease, so the claim's sign of life does not lapse (jetloop.consumers.liveness).
            state.write_timeout = state.read_timeout = min(5.0, s.lease_seconds / 4)
            rt = Runtime(
                nc=nc,
                js=js,
                state=state,
                blobs=BlobStore(await js.object_store(topology.BLOB_BUCKET), s.blob_threshold),
                history=await HistoryReader.for_stream(nc, timeout=state.read_timeout),
                bus=Bus(js),
                app=self.app,
                worker_id=self.worker_id,
                lease_seconds=s.lease_seconds,
                namespace=s.namespace,
                faults=self.faults,
                max_losses=s.max_losses,
                newer_writer_seconds=s.newer_writer_seconds,
                incarnation=incarnation,
                holds=holds,
                prices=Prices(s.prices),
                pauses=await Pauses.open(js),
                provider_limits=dict(s.provider_limits),
                windows=Windows(await js.key_value(topology.LIMITS_BUCKET)),
                tracing=Tracing.from_env("jetloop-worker"),
                call_slots=CallSlots(s.tool_concurrency),
            )
            self._rt = rt
            await self._kinds_written(registry)
            await self._layout_read()
            for agent in self.app.agents.values():
                for trigger in agent.triggers:
                    await publish_trigger(js, agent.name, trigger)
                    log.info(
                        "trigger.applied",
                        agent=agent.name,
                        trigger=trigger.name,
                        schedule=trigger.schedule,
                    )
            control: ControlService | None = None
            if topology.SESSION_POOL in self.pools:
                control = ControlService(
                    nc,
                    rt.state,
                    Control(rt.state, rt.bus),
                    rt.history,
                    rt.blobs,
                    namespace=s.namespace,
                )
                self._control = control
                if self._serving.is_set():
                    await control.start()
            loops = []
            # One budget per pool, shared by the agents this worker serves.
            turn_slots = Slots(s.session_concurrency)
            # One rate for the turns of every agent served (JETLOOP_TURN_RATE).
            turn_rate = TurnRate(s.turn_rate) if s.turn_rate else None
            pool_slots = {pool: Slots(self._concurrency(pool)) for pool in self.pools}
            for name in sorted(self.app.agents):
                if topology.SESSION_POOL in self.pools:
                    loops.append(
                        self._pull(
                            rt,
                            nc,
                            topology.TURNS_STREAM,
                            topology.turn_consumer(name),
                            route_turn,
                            turn_slots,
                            holds,
                            turn_rate,
                        )
                    )
                for pool in self._pools_of(name):
                    loops.append(
                        self._pull(
                            rt,
                            nc,
                            topology.STEPS_STREAM,
                            topology.step_consumer(pool, name),
                            route_step,
                            pool_slots[pool],
                            holds,
                        )
                    )
            log.info(
                "worker.started",
                worker=self.worker_id,
                incarnation=incarnation,
                pools=list(self.pools),
                agents=self.agents(),
                loop=loop_name(),
            )
            self._started.set()
            if s.metrics_port is not None:
                start_http_server(s.metrics_port, addr="127.0.0.1")
            async with asyncio.TaskGroup() as tg:
                for loop in loops:
                    tg.create_task(loop)
                tg.create_task(watch_lag(js, self._stopping, self._consumers()))
                # Room for the live views: others' consumers swept before the stream's cap.
                tg.create_task(guard_consumers(js, self._stopping))
                tg.create_task(self._advertise(registry, holds))
                tg.create_task(self._watch_clock(nc))
                tg.create_task(self._sweep(rescuer))
                # Where no advisories are heard: ask the quiet holders (jetloop.services.probe).
                tg.create_task(self._probe(Probe(nc, incarnation, rescuer, self._stopping)))
                watch_urls = s.nats_watch_urls
                if watch_urls is not None:
                    tg.create_task(self._watch(rescuer, watch_urls))
            if not lost:
                await registry.withdraw(self.worker_id)
            if control is not None:
                await control.stop()
            await self._drain(holds)
        finally:
            if self._rt is not None:
                await self._rt.pauses.close()
                for agent in self.app.agents.values():
                    for server in agent.mcp_servers:
                        await server.close()  # a stdio server's process ends with it
                if self._rt.tracing is not None:
                    await asyncio.to_thread(self._rt.tracing.shutdown)
            await finish(nc)
            log.info("worker.stopped", worker=self.worker_id)
        if lost:
            raise lost[0]

    async def _probe(self, probe: Probe) -> None:
        """Run the probe; one that fails (an outage while it subscribes) is started again."""
        while not self._stopping.is_set():
            try:
                await probe.run()
            except Exception as exc:
                log.warning("worker.probe_failed", error=str(exc))
                await _first(asyncio.sleep(1.0), self._stopping.wait())

    async def _sweep(self, rescuer: Rescuer) -> None:
        """Hand on what dead predecessors held (``Rescuer.sweep``), beside serving: the sweep
        first waits for this process's link to settle."""
        try:
            log.info("worker.swept", messages=await rescuer.sweep())
        except Exception as exc:  # an outage: the leases bring those steps back
            log.warning("worker.sweep_failed", error=str(exc))

    async def _first_clock(self, nc: Client) -> None:
        """Measure the clock until the server answers (it may still be starting)."""
        delay = 0.2
        while not self._stopping.is_set():
            try:
                await self._clock.update(nc)
            except Exception as exc:
                log.warning("worker.clock_unmeasured", error=str(exc), retry_in=delay)
                await _first(asyncio.sleep(delay), self._stopping.wait())
                delay = min(delay * 2, 5.0)
                continue
            await self._clock_verdict(first=True)
            return

    async def _watch_clock(self, nc: Client) -> None:
        """Measure the clock again every ``clock_check_seconds`` until stopped; a measurement
        that fails (no server just now) keeps the last verdict."""
        every = self.settings.clock_check_seconds
        while not self._stopping.is_set():
            await _first(asyncio.sleep(every), self._stopping.wait())
            if self._stopping.is_set():
                return
            try:
                await self._clock.update(nc)
            except Exception as exc:
                log.debug("worker.clock_unmeasured", error=str(exc))
                continue
            gated = self._clock.off and self._seals
            if gated == self._serving.is_set():
                await self._clock_verdict(first=False)
            else:
                self._clock_metrics()

    def _gated(self) -> bool:
        """Whether to take no steps: the clock was found off, or it has jumped since it was
        last measured (seen on the monotonic clock at once; said at the next measurement)."""
        return not self._serving.is_set() or (self._seals and self._clock.off)

    def _clock_metrics(self) -> None:
        metrics.CLOCK_OFFSET.set(self._clock.offset() or 0.0)
        metrics.CLOCK_OFF.set(0 if self._serving.is_set() else 1)

    async def _clock_verdict(self, first: bool) -> None:
        """Serve, or stop serving, as the clock's verdict says; said once per change."""
        now = self._clock.offset()
        offset = round(now, 3) if now is not None else None
        if self._clock.off and self._seals:
            assert now is not None
            self._serving.clear()
            self._clock_metrics()
            if self._control is not None:
                await self._control.stop()
            log.error(
                "worker.clock_off",
                worker=self.worker_id,
                offset=offset,
                limit=self._clock.limit,
                error=f"this worker's clock is {describe(now)} the NATS server's (at most "
                f"{self._clock.limit:g} s is safe): every record it sealed would be rejected, so "
                "it serves no steps and no control requests until the clock is set right (NTP)",
            )
        elif not self._serving.is_set() or first:
            was_off = not self._serving.is_set()
            self._serving.set()
            self._clock_metrics()
            if self._control is not None:
                await self._control.start()
            if was_off:
                log.warning("worker.clock_back", worker=self.worker_id, offset=offset)
            else:
                log.info("worker.clock", worker=self.worker_id, offset=offset)

    def _consumers(self) -> list[tuple[str, str]]:
        return [
            sc
            for agent in sorted(self.app.agents)
            for sc in topology.agent_consumers(agent, self._pools_of(agent))
        ]

    async def _advertise(self, registry: Registry, holds: Holds) -> None:
        """Presence for clients and people (``jetloop.streams.registry``), and the list of what this
        process holds, kept fresh for a rescuer (``jetloop.streams.holds``), until stopped."""
        while not self._stopping.is_set():
            await _first(asyncio.sleep(topology.PRESENCE_TTL / 3), self._stopping.wait())
            try:
                await registry.advertise(self.worker_id, self.agents(), self.pools, self._since)
                if len(holds):
                    await holds.publish()
                await self._kinds_written(registry)
                await self._layout_read()
            except Exception as exc:  # an outage: the next beat tries again
                log.warning("worker.advertise_failed", error=str(exc))

    async def _layout_read(self) -> None:
        """The session log's layout, read from ``JL_EVENTS`` at the start and with every
        presence refresh: an operator who changes it (``JETLOOP_EVENT_LOG`` on a worker that
        applies the topology) changes what every worker writes within a refresh."""
        rt = self._rt
        if rt is None:
            return
        folded = await topology.log_layout(rt.js) == LogLayout.FOLDED
        if folded != rt.folded_log:
            rt.folded_log = folded
            log.info("worker.event_log", now=LogLayout.FOLDED if folded else LogLayout.SEPARATE)

    async def _kinds_written(self, registry: Registry) -> None:
        """Write a model step's calls as one message only while every live worker runs that
        kind: during a rolling upgrade from a release without it, a message per call. Looked
        at with every presence refresh while an older worker lives, and with every
        ``KINDS_CHECK_EVERY``-th once none does (an older one started later, a roll back, meets
        the new kind only in that while, and hands it back for a worker that runs it). The
        same for a step's reads kept in one record (``Runtime.step_reads``) and its results
        in one history entry (``Runtime.results_entry``)."""
        rt = self._rt
        if rt is None:
            return
        self._kinds_checks += 1
        settled = rt.calls_in_one_message and rt.step_reads and rt.results_entry
        if settled and self._kinds_checks % KINDS_CHECK_EVERY:
            return
        one, records = await registry.every_worker_takes(StepKind.CALL_TOOLS, self.worker_id)
        if one != rt.calls_in_one_message:
            rt.calls_in_one_message = one
            log.info("worker.calls_in_one_message", now=one)
        reads = STEP_READS in records
        if reads != rt.step_reads:
            rt.step_reads = reads
            log.info("worker.step_reads", now=reads)
        together = RESULTS_ENTRY in records
        if together != rt.results_entry:
            rt.results_entry = together
            log.info("worker.results_entry", now=together)

    async def _watch(self, rescuer: Rescuer, urls: list[str]) -> None:
        """Hear other workers' connections close (``jetloop.services.rescue``); a watch connection
        that cannot be made (no system account, a wrong password) costs only the fast path."""
        delay = 1.0
        while not self._stopping.is_set():
            try:
                await rescuer.watch(urls)
            except NotAuthorized:
                log.warning(
                    "worker.watch_failed",
                    error="the server refused the watch user",
                    hint="set JETLOOP_NATS_WATCH_USER / JETLOOP_NATS_WATCH_PASSWORD to a user "
                    "of the server's system account (docs/design.md); until then a dead "
                    "worker's steps wait for their leases",
                    retry_in=delay,
                )
            except Exception as exc:
                log.warning("worker.watch_failed", error=str(exc), retry_in=delay)
            await _first(asyncio.sleep(delay), self._stopping.wait())
            delay = min(delay * 2, 60.0)

    async def _answer_alive(self, msg: Msg) -> None:
        """Alive; asked about a state key, whether a delivery here still works on it."""
        if not msg.reply:
            return
        if msg.data:
            holding = self._rt is not None and msg.data.decode(errors="replace") in self._rt.holding
            await msg.respond(HOLDING if holding else b"done")
        else:
            await msg.respond(self.worker_id.encode())

    async def _prepare(self, js: JetStreamContext) -> Registry:
        """The topology (unless told not to), this worker's per-agent consumers and its first
        presence. Servers may still be forming a cluster or electing a leader (no peers, no
        answer yet): keep trying."""
        cfg = self.settings.topology()
        delay = 0.2
        while True:
            try:
                if self.apply_topology:
                    await topology.apply(js, cfg)
                for name in sorted(self.app.agents):
                    # Only this worker's agents: another app's turns never reach it.
                    await topology.apply_agent(js, cfg, name, self._pools_of(name))
                registry = await Registry.open(js)
                # Before "started": a client that saw this worker start finds its agents.
                await registry.advertise(self.worker_id, self.agents(), self.pools, self._since)
                return registry
            except Exception as exc:
                if self._stopping.is_set():
                    raise
                said: dict[str, object] = {}
                if delay >= 5.0:
                    # Waited a while: a stream nats-server left without a leader (after a power
                    # cut of every node) is named, so an operator knows what to mend.
                    with contextlib.suppress(Exception):
                        stuck = await topology.leaderless(js)
                        if stuck:
                            said = {"leaderless": stuck, "hint": LEADERLESS_HINT}
                log.warning("worker.topology_not_ready", error=str(exc), retry_in=delay, **said)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _pull(
        self,
        rt: Runtime,
        nc: Client,
        stream: str,
        consumer: str,
        handler: Handler,
        slots: Slots,
        holds: Holds,
        rate: TurnRate | None = None,
    ) -> None:
        intake = Intake(nc, stream, consumer)
        await intake.start()
        self._intakes.append(intake)
        mine = slots.running
        try:
            while not self._stopping.is_set():
                if self._gated():
                    # The clock is off: hand back, unstarted, what requests made before brought
                    # (another worker takes them); ask for nothing more.
                    for m in await intake.take(0, timeout=0.5):
                        await _nak_quietly(m)
                    continue
                free = slots.limit - len(mine)
                if free <= 0:
                    slots.freed.clear()
                    await _first(slots.freed.wait(), self._stopping.wait())
                    continue
                if rate is not None:
                    # Over the rate: ask for nothing until a token is due; the requests wait
                    # in their stream, undelivered (no attempt spent, no lease running).
                    allowed = rate.room()
                    if allowed < 1:
                        await _first(asyncio.sleep(rate.due()), self._stopping.wait())
                        continue
                    free = min(free, allowed)
                try:
                    msgs = await intake.take(free, timeout=1.0)
                except Exception as exc:  # an outage: reconnect happens underneath
                    log.warning("worker.fetch_failed", consumer=consumer, error=str(exc))
                    await _first(asyncio.sleep(0.5), self._stopping.wait())
                    continue
                if rate is not None:
                    rate.took(len(msgs))
                if msgs and not self._stopping.is_set() and not self._gated():
                    for m in msgs:
                        holds.add(m)
                    await holds.sent()
                for m in msgs:
                    if self._stopping.is_set() or self._gated():
                        # Not started: hand it back now, it costs no attempt.
                        holds.drop(m)
                        await _nak_quietly(m)
                        continue
                    self._start(rt, m, handler, mine, holds, slots)
        finally:
            self._intakes.remove(intake)
            for m in await intake.stop():
                await _nak_quietly(m)

    def _start(
        self,
        rt: Runtime,
        m: Msg,
        handler: Handler,
        mine: set[asyncio.Task[None]],
        holds: Holds,
        slots: Slots,
    ) -> None:
        task = asyncio.create_task(dispatch(rt, m, handler))
        mine.add(task)
        self._inflight.add(task)

        def done(t: asyncio.Task[None]) -> None:
            mine.discard(t)
            self._inflight.discard(t)
            holds.drop(m)
            slots.freed.set()

        task.add_done_callback(done)

    async def _drain(self, holds: Holds) -> None:
        if not self._inflight:
            return
        log.info("worker.draining", steps=len(self._inflight), grace=self.settings.drain_seconds)
        _, pending = await asyncio.wait(set(self._inflight), timeout=self.settings.drain_seconds)
        if pending:
            # Said before anything is cancelled, and confirmed: whoever takes these steps
            # over must know this process stopped on purpose (jetloop.streams.holds).
            holds.drained = True
            log.info("worker.drain_ran_out", steps=len(pending))
            try:
                await holds.publish_confirmed(timeout=2.0)
            except Exception as exc:  # a takeover then counts a loss, as after a crash
                log.warning("worker.drained_unsaid", error=repr(exc))
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)


class Slots:
    """How many steps of one pool a worker runs at once, across the agents it serves."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running: set[asyncio.Task[None]] = set()
        self.freed = asyncio.Event()


# A worker's turn rate lets this many seconds' worth of turns in at once after a quiet while.
TURN_BURST_SECONDS = 0.1


class TurnRate:
    """How many turn requests a second a worker takes in (``JETLOOP_TURN_RATE``): a token
    bucket of ``rate`` a second holding at most ``TURN_BURST_SECONDS`` of them (one at
    least), shared by the turn consumers of every agent the worker serves. It only delays
    the worker's pull requests: what is over the rate stays in ``JL_TURNS``, in order."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = max(1.0, burst if burst is not None else rate * TURN_BURST_SECONDS)
        self._tokens = self.burst
        self._at = time.monotonic()

    def _fill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def room(self) -> int:
        """How many requests may be asked for now."""
        self._fill()
        return max(0, int(self._tokens))

    def due(self) -> float:
        """Seconds until one more may be asked for."""
        self._fill()
        return max(0.0, (1.0 - self._tokens) / self.rate)

    def took(self, n: int) -> None:
        """``n`` requests came in (a request asked before may bring one more than is due:
        it is owed, and waited for)."""
        self._tokens -= n


async def _first(*aws: object) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]  # type: ignore[call-overload]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


async def _nak_quietly(m: object) -> None:
    try:
        await m.nak()  # type: ignore[attr-defined]
    except Exception as exc:
        log.warning("worker.nak_failed", error=str(exc))


def served_pools(app: App, asked: Sequence[str] | None) -> tuple[str, ...]:
    """The pools a worker of ``app`` serves: those ``asked`` (``--pools``), else the engine's
    and those of the tools the app makes in pools of their own (never those it declares as
    served elsewhere). A pool it cannot serve is a ``ValueError`` that names the setting."""
    if asked is None:
        return topology.POOLS + app.tool_pools(made_here=True)
    pools = tuple(asked)
    declared = app.tool_pools()
    made = app.tool_pools(made_here=True)
    unknown = sorted(set(pools) - set(topology.POOLS) - set(declared))
    if unknown:
        theirs = f"; the app's tools name {', '.join(declared)}" if declared else ""
        raise ValueError(
            f"--pools / pools: unknown pools {unknown}; the engine's are "
            f"{', '.join(topology.POOLS)}{theirs}"
        )
    elsewhere = sorted(p for p in pools if p in declared and p not in made)
    if elsewhere:
        raise ValueError(
            f"--pools / pools: this app declares the tools of {elsewhere} as served elsewhere "
            "(served_elsewhere): run the workers of those pools with an app that makes them"
        )
    return pools
