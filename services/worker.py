"""The worker process: pulls steps of the pools it serves and runs their handlers.

Lifecycle (STYLE rule 5): ``run()`` until ``stop()``; stop intake → drain in-flight steps
for ``drain_seconds`` → cancel the rest (their messages are handed back with a nak) →
close. It fetches only as many messages as it has free slots, so nothing it holds waits
unstarted past its lease.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Sequence

import structlog
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from prometheus_client import start_http_server

from agents import App
from consumers import Faults, Runtime, dispatch, route_step, route_turn
from consumers.control import Control
from consumers.dispatch import Handler
from services.client import publish_trigger
from services.control import ControlService
from services.lifecycle import Service
from services.metrics import watch_lag
from services.settings import Settings
from streams import topology
from streams.blobs import BlobStore
from streams.bus import Bus
from streams.connection import connect
from streams.history import HistoryReader
from streams.state import StateStore

log = structlog.get_logger("jetloop.worker")


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker(Service):
    def __init__(
        self,
        settings: Settings,
        app: App,
        pools: Sequence[str] = topology.POOLS,
        worker_id: str | None = None,
        apply_topology: bool = True,
        faults: Faults | None = None,
    ) -> None:
        super().__init__()
        unknown = set(pools) - set(topology.POOLS)
        if unknown:
            raise ValueError(f"unknown pools {sorted(unknown)}; pools are {topology.POOLS}")
        self.settings = settings
        self.app = app
        self.pools = tuple(pools)
        self.worker_id = worker_id or settings.worker_id or default_worker_id()
        self.apply_topology = apply_topology
        self.faults = faults or Faults.from_env()
        self._nc: Client | None = None
        self._inflight: set[asyncio.Task[None]] = set()

    def _concurrency(self, pool: str) -> int:
        s = self.settings
        return {
            topology.SESSION_POOL: s.session_concurrency,
            topology.MODEL_POOL: s.model_concurrency,
            topology.TOOL_POOL: s.tool_concurrency,
        }[pool]

    async def run(self) -> None:
        s = self.settings
        nc = await connect(s.nats_urls, name=f"jetloop-worker-{self.worker_id}")
        self._nc = nc
        js = nc.jetstream()
        try:
            if self.apply_topology:
                await self._apply_topology(js)
            rt = Runtime(
                nc=nc,
                js=js,
                state=await StateStore.open(nc, s.sealer()),
                blobs=BlobStore(await js.object_store(topology.BLOB_BUCKET), s.blob_threshold),
                history=await HistoryReader.for_stream(nc),
                bus=Bus(js),
                app=self.app,
                worker_id=self.worker_id,
                lease_seconds=s.lease_seconds,
                faults=self.faults,
                max_losses=s.max_losses,
            )
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
                    nc, rt.state, Control(rt.state, rt.bus), rt.history, rt.blobs
                )
                await control.start()
            loops = []
            if topology.SESSION_POOL in self.pools:
                loops.append(
                    self._pull(
                        rt,
                        js,
                        topology.TURNS_STREAM,
                        topology.TURNS_CONSUMER,
                        route_turn,
                        s.session_concurrency,
                    )
                )
            for pool in self.pools:
                loops.append(
                    self._pull(
                        rt,
                        js,
                        topology.STEPS_STREAM,
                        topology.step_consumer(pool),
                        route_step,
                        self._concurrency(pool),
                    )
                )
            log.info(
                "worker.started",
                worker=self.worker_id,
                pools=list(self.pools),
                agents=sorted(self.app.agents),
            )
            self._started.set()
            if s.metrics_port is not None:
                start_http_server(s.metrics_port, addr="127.0.0.1")
            async with asyncio.TaskGroup() as tg:
                for loop in loops:
                    tg.create_task(loop)
                tg.create_task(watch_lag(js, self._stopping))
            if control is not None:
                await control.stop()
            await self._drain()
        finally:
            await nc.drain() if nc.is_connected else await nc.close()
            log.info("worker.stopped", worker=self.worker_id)

    async def _apply_topology(self, js: JetStreamContext) -> None:
        """Servers may still be forming a cluster (no peers, no leader yet): keep trying."""
        delay = 0.2
        while True:
            try:
                await topology.apply(js, self.settings.topology())
                return
            except Exception as exc:
                if self._stopping.is_set():
                    raise
                log.warning("worker.topology_not_ready", error=str(exc), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _pull(
        self,
        rt: Runtime,
        js: JetStreamContext,
        stream: str,
        consumer: str,
        handler: Handler,
        concurrency: int,
    ) -> None:
        sub = await js.pull_subscribe_bind(durable=consumer, stream=stream)
        mine: set[asyncio.Task[None]] = set()
        slot_free = asyncio.Event()
        while not self._stopping.is_set():
            free = concurrency - len(mine)
            if free <= 0:
                slot_free.clear()
                await _first(slot_free.wait(), self._stopping.wait())
                continue
            try:
                msgs = await sub.fetch(free, timeout=1.0)
            except (NatsTimeoutError, TimeoutError):
                continue
            except Exception as exc:  # an outage: reconnect happens underneath
                log.warning("worker.fetch_failed", consumer=consumer, error=str(exc))
                await _first(asyncio.sleep(0.5), self._stopping.wait())
                continue
            for m in msgs:
                if self._stopping.is_set():
                    # Not started: hand it back now, it costs no attempt.
                    await _nak_quietly(m)
                    continue
                task = asyncio.create_task(dispatch(rt, m, handler))
                mine.add(task)
                self._inflight.add(task)

                def done(t: asyncio.Task[None], mine: set[asyncio.Task[None]] = mine) -> None:
                    mine.discard(t)
                    self._inflight.discard(t)
                    slot_free.set()

                task.add_done_callback(done)
        await sub.unsubscribe()

    async def _drain(self) -> None:
        if not self._inflight:
            return
        log.info("worker.draining", steps=len(self._inflight), grace=self.settings.drain_seconds)
        _, pending = await asyncio.wait(set(self._inflight), timeout=self.settings.drain_seconds)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)


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
