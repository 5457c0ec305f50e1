"""The benchmark rig: a nats-server on a temporary store, worker processes, turn drivers.

``Rig`` starts nats-server (with its monitoring port, for per-connection message counts),
applies the engine's and the floor's topology, starts engine workers
(``jetloop.tooling.trials.harness.WorkerProcess`` on ``jetloop.tooling.bench.app``, one
process each or
``jetloop worker --processes N``) or the floor worker
(``jetloop.tooling.bench.floor``) on demand, and drives turns: a turn's end is taken from a core
NATS subscription on its ``turn.completed`` event (a JetStream publish also reaches core
subscribers), so waiting costs the driver one message, not a consumer per turn.
``count_ops`` measures what a turn costs from stream sequences, consumer deliveries and the
server's counters, for the engine and the floor alike.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from jetloop.schemas import TurnRequest, encode, scoped_msg_id, turn_id_for
from jetloop.schemas.events import EventType
from jetloop.schemas.log import LogLayout, turn_end_heard
from jetloop.services import durability
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer, free_port
from jetloop.services.settings import load_settings
from jetloop.streams import topology
from jetloop.streams.bus import H_TURN
from jetloop.streams.connection import connect
from jetloop.tooling.bench import floor as bench_floor
from jetloop.tooling.bench import floor_lever1
from jetloop.tooling.bench import syncs as bench_syncs
from jetloop.tooling.bench.costs import PROBE_NAME, Meter, connections
from jetloop.tooling.trials.harness import WorkerProcess
from jetloop.tooling.trials.run import percentile
from jetloop.tooling.trials.servers import write_namespaced_config

APP = "jetloop.tooling.bench.app:app"
SEAL_KEY = "b3" * 32
ENGINE_STREAMS = (
    topology.TURNS_STREAM,
    topology.STEPS_STREAM,
    topology.EVENTS_STREAM,
    topology.DEAD_STREAM,
)
KV_STREAM = f"KV_{topology.STATE_BUCKET}"
BLOB_STREAM = f"OBJ_{topology.BLOB_BUCKET}"
FLOOR_CONCURRENCY = 64
WORKER_START_SECONDS = 60.0
TURN_KINDS = {"1-step": 0, "7-step": 5}
STEPS_OF = {0: 1, 5: 7}


# --- measuring -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Latency:
    """Turn latencies in milliseconds."""

    n: int
    p50_ms: float
    p99_ms: float
    mean_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Latency:
        ms = [s * 1000 for s in seconds]
        return cls(
            n=len(ms),
            p50_ms=percentile(ms, 50) or math.nan,
            p99_ms=percentile(ms, 99) or math.nan,
            mean_ms=statistics.fmean(ms) if ms else math.nan,
        )


@dataclass(frozen=True)
class Batch:
    """A batch of turns: each turn's latency and the wall time of the whole batch."""

    latencies: list[float]
    wall: float

    def per_second(self, steps_per_turn: int) -> float:
        return len(self.latencies) * steps_per_turn / self.wall


@dataclass
class OpCounts:
    """Per turn: KV writes, stored publishes and deliveries (each acked once, confirmed)."""

    kv_writes: float
    publishes: float
    acks: float
    kv_bytes: int  # mean stored bytes of one KV write
    msg_bytes: int  # mean stored bytes of one stream message
    sent: float = math.nan  # messages the worker process sent the server


class Ends:
    """Turn ends seen on a core subscription (a JetStream publish also reaches core
    subscribers of its subject): one future per turn, resolved with the arrival time."""

    def __init__(self, nc: Nats, subject: str, *more: str) -> None:
        self.nc = nc
        self.subjects = [subject, *more]
        self.waiting: dict[str, asyncio.Future[float]] = {}
        self._subs: list[Any] = []

    async def start(self) -> None:
        if not self._subs:
            self._subs = [await self.nc.subscribe(s, cb=self._on) for s in self.subjects]

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            await sub.unsubscribe()

    def expect(self, turn_id: str) -> asyncio.Future[float]:
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.waiting[turn_id] = fut
        return fut

    async def _on(self, msg: Msg) -> None:
        how = turn_end_heard(msg.subject, msg.headers)  # (also a folded answer's)
        if how is None:
            return  # accepted, started: not an end
        tid = (msg.headers or {}).get(H_TURN)
        fut = self.waiting.pop(tid, None) if tid else None
        if fut is None or fut.done():
            return  # a re-emission, or a turn nobody waits for
        if how == EventType.TURN_COMPLETED:
            fut.set_result(time.perf_counter())
        else:
            fut.set_exception(RuntimeError(f"turn {tid} ended {how}"))


Starter = Callable[[str, str, int], Awaitable[asyncio.Future[float]]]


async def run_batch(start_turn: Starter, fan: int, turns: int, in_flight: int, tag: str) -> Batch:
    """``turns`` turns, at most ``in_flight`` at once, each on its own session."""
    sem = asyncio.Semaphore(in_flight)
    latencies: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            # The request id is unique in the stream: dedupe covers the whole stream.
            fut = await start_turn(f"{tag}{i}", f"{tag}{i}", fan)
            t1 = await asyncio.wait_for(fut, 60)
            latencies.append(t1 - t0)

    began = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i in range(turns):
            tg.create_task(one(i))
    return Batch(latencies, time.perf_counter() - began)


# --- the rig -------------------------------------------------------------------------------


class Rig:
    """One nats-server on a temporary store, the engine's and the floor's topology, worker
    processes on demand, and the driver's connection."""

    def __init__(
        self,
        base: Path,
        event_log: str = "folded",
        sync: str = durability.ALWAYS,
        sync_trace: Path | None = None,
    ) -> None:
        """``sync_trace``: run the server under ``jetloop.tooling.bench.syncs``'s trace,
        written to that file (read it once the rig is closed)."""
        self.base = base
        self.event_log = event_log  # the session log's layout (jetloop.schemas.log)
        # When the server syncs what it acknowledged (jetloop.services.durability).
        self.sync = sync
        # The monitoring port's /connz says how many messages each connection sent.
        self.monitor_port = free_port()
        # The server as `jetloop up` configures it: the default namespace in an account of
        # its own (docs/design.md, "Namespaces"); the rig's connections, without a user, act
        # as its workers.
        config, _, self.auth_store = write_namespaced_config(base, names=("default",), sync=sync)
        self.server = EmbeddedServer(
            base / "store",
            port=0,
            log_file=base / "nats.log",
            extra_args=["-m", str(self.monitor_port)],
            config_file=config,
            wrap=bench_syncs.prefix(sync_trace) if sync_trace is not None else None,
        )
        self.sync_trace = sync_trace
        # The floor's state buckets and event streams (``jetloop bench peer --floor-shards``).
        self.floor_shards = int(os.environ.get(bench_floor.SHARDS_ENV, "1"))
        self.workers: list[WorkerProcess] = []
        self.floor: subprocess.Popen[bytes] | None = None
        # The floor of lever 1's write pattern (``jetloop.tooling.bench.floor_lever1``).
        self.floor1: subprocess.Popen[bytes] | None = None
        self._nc: Nats | None = None
        # The connection that asks for consumer and stream state (``quiet``, ``counters``):
        # apart, so that what a batch costs is counted without the bench's own questions.
        self._probe: Nats | None = None
        self.engine_ends: Ends | None = None
        self.floor_ends: Ends | None = None
        self.floor1_ends: Ends | None = None
        self._client: Client | None = None
        self._ids = 0

    @property
    def nc(self) -> Nats:
        assert self._nc is not None, "the rig is not running"
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    @property
    def probe(self) -> JetStreamContext:
        assert self._probe is not None, "the rig is not running"
        return self._probe.jetstream()

    def meter(self, engine: bool = True) -> Meter:
        """What batches cost: the server's messages, and the server's, this process's and
        the workers' CPU time — the engine's worker processes, or (``engine=False``) the
        floor's process (``jetloop.tooling.bench.costs``)."""
        server_pid = self.server.server_pid()
        assert server_pid is not None

        def worker_pids() -> list[int]:
            if not engine:
                return [self.floor.pid] if self.floor is not None else []
            return [w.proc.pid for w in self.workers if w.proc is not None]

        return Meter(self.monitor_port, server_pid, worker_pids)

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start)
        await self.server.wait_jetstream()
        self._nc = await nats.connect(self.server.url, name="jetloop-bench")
        self._probe = await nats.connect(self.server.url, name=PROBE_NAME)
        cfg = topology.TopologyConfig(event_log=LogLayout(self.event_log))
        await topology.apply(self.js, cfg)
        await bench_floor.apply_topology(self.js, self.floor_shards)
        await floor_lever1.apply_topology(self.js)
        # The public API's client on a connection as ``Client.connect`` makes it (jetloop's
        # own: its parser and its publish path), not on the driver's plain nats-py one, which
        # a program using jetloop does not get.
        self._client = Client(
            await connect([self.server.url], name="jetloop-client"),
            own=True,
            sealer=load_settings(seal_key=SEAL_KEY).sealer(),
        )
        # Subscribed while the raw driver runs turns only (``send``): through the public API
        # (``api_turn``) it would hear every turn's events, messages no user of it pays.
        answers = ["jl.event.*.history.assistant"] if self.event_log == "folded" else []
        self.engine_ends = Ends(self.nc, "jl.event.*.turn.*", *answers)
        self.floor_ends = Ends(self.nc, bench_floor.COMPLETED)
        await self.floor_ends.start()
        self.floor1_ends = Ends(self.nc, floor_lever1.COMPLETED)
        await self.floor1_ends.start()

    async def close(self) -> None:
        self.stop_workers()
        self.stop_floor()
        if self._client is not None:
            await self._client.close()
        for nc in (self._nc, self._probe):
            if nc is not None and not nc.is_closed:
                await nc.close()
        if self.sync_trace is not None:
            # A stop, not a kill: the trace ends with the server, written whole.
            await asyncio.to_thread(self.server.stop, 30.0)
        self.server.kill()

    async def traced_syncs(self) -> list[bench_syncs.SyncCall]:
        """Close the rig and read its server's syncs (``sync_trace``; none without it)."""
        await self.close()
        return await asyncio.to_thread(bench_syncs.read, self.sync_trace) if self.sync_trace else []

    # workers

    def worker_env(self, **extra: str) -> dict[str, str]:
        return {
            # The credentials of the rig's own server, never those of a `jetloop up` store in
            # the working directory (the README's first look leaves one there).
            "JETLOOP_STORE_DIR": str(self.auth_store),
            "JETLOOP_SEAL_KEY": SEAL_KEY,
            "JETLOOP_LOG_LEVEL": "info",
            "JETLOOP_VENDOR_DB": str(self.base / "vendor.sqlite"),
            **extra,
        }

    async def start_workers(self, n: int, **env: str) -> list[WorkerProcess]:
        started = []
        for _ in range(n):
            self._ids += 1
            name = f"bench{self._ids}"
            w = WorkerProcess(
                self.server.url,
                APP,
                self.base / f"{name}.log",
                worker_id=name,
                env=self.worker_env(**env),
            ).start()
            self.workers.append(w)
            started.append(w)
        for w in started:
            await w.wait_for("worker.started", timeout=WORKER_START_SECONDS)
        return started

    async def start_worker_processes(self, n: int, **env: str) -> WorkerProcess:
        """``jetloop worker --processes n``: one parent of ``n`` worker processes (``n`` = 1:
        one worker in the process itself), once every one of them has started."""
        self._ids += 1
        name = f"bench{self._ids}"
        w = WorkerProcess(
            self.server.url,
            APP,
            self.base / f"{name}.log",
            worker_id=name,
            env=self.worker_env(**env),
            processes=n,
        ).start()
        self.workers.append(w)
        ids = [name] if n == 1 else [f"{name}-{i}" for i in range(1, n + 1)]
        for wid in ids:
            await w.wait_for("worker.started", timeout=WORKER_START_SECONDS, worker=wid)
        return w

    def stop_workers(self) -> None:
        for w in self.workers:
            w.terminate(timeout=15)
        self.workers.clear()

    async def start_floor(self, ops: OpCounts) -> None:
        """The floor worker process, with payloads sized like the engine's."""
        self.floor = await spawn_floor(
            bench_floor.__name__,
            "floor_worker_main",
            self.server.url,
            ops,
            {
                bench_floor.LAYOUT_ENV: self.event_log,
                bench_floor.SHARDS_ENV: str(self.floor_shards),
            },
        )

    async def start_floor1(self, ops: OpCounts) -> None:
        """The worker of lever 1's write pattern, with the floor's payload sizes."""
        self.floor1 = await spawn_floor(floor_lever1.__name__, "worker_main", self.server.url, ops)

    def stop_floor(self) -> None:
        for proc in (self.floor, self.floor1):
            if proc is not None:
                stop_floor_process(proc)
        self.floor = self.floor1 = None

    # turns

    async def engine_turn(self, sid: str, rid: str, fan: int) -> asyncio.Future[float]:
        """A turn of the ``bench`` agent: ``fan`` no-op calls (0: one model step)."""
        return await self.send("bench", sid, rid, f"fan {fan}" if fan else "hello")

    async def api_turn(self, sid: str, rid: str, fan: int) -> asyncio.Future[float]:
        """``engine_turn`` through jetloop's public API, as a program would: ``Client.send``,
        then ``Client.wait`` (its reads and its subscription are the turn's cost too)."""
        assert self._client is not None and self.engine_ends is not None, "not running"
        await self.engine_ends.stop()
        client = self._client
        handle = await client.send("bench", sid, f"fan {fan}" if fan else "hello", rid)

        async def ended() -> float:
            await client.wait(handle, timeout=60)  # raises TurnFailed unless it completed
            return time.perf_counter()

        return asyncio.ensure_future(ended())

    async def send(self, agent: str, sid: str, rid: str, text: str) -> asyncio.Future[float]:
        """Publish a turn request as ``Client.send`` does; the future resolves at its end."""
        assert self.engine_ends is not None
        await self.engine_ends.start()
        fut = self.engine_ends.expect(turn_id_for(sid, rid))
        await self.js.publish(
            topology.turn_subject(agent, sid),
            encode(TurnRequest(text=text)),
            headers={
                "Nats-Msg-Id": scoped_msg_id(sid, rid),
                "Jl-Kind": "turn.request",
                "Jl-Session": sid,
            },
        )
        return fut

    async def floor_turn(self, sid: str, rid: str, fan: int) -> asyncio.Future[float]:
        assert self.floor_ends is not None
        return await self._raw_turn(self.floor_ends, bench_floor.turn_subject, sid, rid, fan)

    async def floor1_turn(self, sid: str, rid: str, fan: int) -> asyncio.Future[float]:
        """A turn of lever 1's floor (``jetloop.tooling.bench.floor_lever1``)."""
        assert self.floor1_ends is not None
        return await self._raw_turn(self.floor1_ends, floor_lever1.turn_subject, sid, rid, fan)

    async def _raw_turn(
        self, ends: Ends, subject: Callable[[str, str, int], str], sid: str, rid: str, fan: int
    ) -> asyncio.Future[float]:
        tid = turn_id_for(sid, rid)
        fut = ends.expect(tid)
        await self.js.publish(subject(sid, tid, fan), b"r" * 64, headers={"Nats-Msg-Id": tid})
        return fut

    async def quiet(self, timeout: float = 60.0) -> None:
        """Wait until every consumer has delivered and had acked everything (the steps
        after a turn's end, such as turn_done, have run)."""
        consumers = [*ENGINE_CONSUMERS, *FLOOR_CONSUMERS, *FLOOR1_CONSUMERS]
        deadline = time.monotonic() + timeout
        while True:
            busy = 0
            for stream, name in consumers:
                info = await self.probe.consumer_info(stream, name)
                busy += (info.num_pending or 0) + (info.num_ack_pending or 0)
            if busy == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{busy} messages still pending after {timeout}s")
            await asyncio.sleep(0.02)

    async def last_seqs(self) -> dict[str, int]:
        """Every stream's last sequence: the messages it has stored, deleted ones too."""
        return {
            info.config.name: info.state.last_seq
            for info in await self.probe.streams_info()
            if info.config.name is not None
        }

    async def counters(
        self, streams: Sequence[str], kv: str, consumers: Sequence[tuple[str, str]]
    ) -> dict[str, int]:
        """Stream sequences and bytes, and consumer deliveries, for op counting."""
        out = {
            "pub": 0,
            "pub_bytes": 0,
            "pub_msgs": 0,
            "kv": 0,
            "kv_bytes": 0,
            "kv_msgs": 0,
            "acks": 0,
        }
        for s in streams:
            st = (await self.probe.stream_info(s)).state
            out["pub"] += st.last_seq
            out["pub_bytes"] += st.bytes
            out["pub_msgs"] += st.messages
        st = (await self.probe.stream_info(kv)).state
        out["kv"], out["kv_bytes"], out["kv_msgs"] = st.last_seq, st.bytes, st.messages
        for stream, name in consumers:
            info = await self.probe.consumer_info(stream, name)
            out["acks"] += info.delivered.consumer_seq if info.delivered else 0
        return out

    async def sent_by(self, name_prefix: str) -> int:
        """Messages the server received from connections named ``name_prefix…``: publishes,
        requests (KV reads and writes, pulls), acks, in-progress acks."""
        return sum(
            int(c.get("in_msgs", 0))
            for c in await connections(self.monitor_port)
            if str(c.get("name", "")).startswith(name_prefix)
        )

    async def stored_bytes(self) -> int:
        """Bytes stored in every jetloop stream and bucket."""
        total = 0
        for s in (*ENGINE_STREAMS, KV_STREAM, BLOB_STREAM):
            total += (await self.probe.stream_info(s)).state.bytes
        return total


async def spawn_floor(
    module: str, entry: str, url: str, ops: OpCounts, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A floor worker process (``module.entry``), once it says it is ready."""
    code = f"from {module} import {entry}; {entry}()"
    args = [url, str(ops.kv_bytes), str(ops.msg_bytes), str(FLOOR_CONCURRENCY)]
    proc = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
    if line.strip() != b"ready":
        stop_floor_process(proc)
        raise RuntimeError(f"the floor worker {module} did not start: {line!r}")
    return proc


def stop_floor_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


# The bench app's agents (jetloop.tooling.bench.app): each has its own durables.
ENGINE_CONSUMERS = [*topology.agent_consumers("bench"), *topology.agent_consumers("parked")]
FLOOR_CONSUMERS = [
    (bench_floor.TURNS, bench_floor.TURNS_CONSUMER),
    (bench_floor.STEPS, bench_floor.STEPS_CONSUMER),
]
FLOOR1_CONSUMERS = [
    (floor_lever1.TURNS, floor_lever1.TURNS_CONSUMER),
    (floor_lever1.STATE_STREAM, floor_lever1.WORK_CONSUMER),
]


@asynccontextmanager
async def rig(
    work_dir: Path | None = None,
    event_log: str = "folded",
    sync: str = durability.ALWAYS,
    sync_trace: bool = False,
) -> AsyncIterator[Rig]:
    """A running rig on ``work_dir`` (else a temporary directory), closed on the way out;
    ``sync_trace``: its server's syncs traced to ``nats-syncs.trace`` there."""
    with tempfile.TemporaryDirectory(prefix="jetloop-bench-") as tmp:
        base = work_dir or Path(tmp)
        await asyncio.to_thread(base.mkdir, parents=True, exist_ok=True)
        r = Rig(base, event_log, sync, base / "nats-syncs.trace" if sync_trace else None)
        try:
            await r.start()
            yield r
        finally:
            await r.close()


async def count_ops(r: Rig, start: Starter, fan: int, turns: int, engine: bool) -> OpCounts:
    """What one turn costs in writes, publishes, acks and messages sent, from stream
    sequences, consumer deliveries and the server's per-connection counters."""
    streams: Sequence[str] = (
        ENGINE_STREAMS if engine else (bench_floor.TURNS, bench_floor.STEPS, bench_floor.EVENTS)
    )
    kv = KV_STREAM if engine else f"KV_{bench_floor.BUCKET}"
    consumers = ENGINE_CONSUMERS if engine else FLOOR_CONSUMERS
    who = "jetloop-worker-" if engine else bench_floor.CONNECTION_NAME
    await r.quiet()
    before = await r.counters(streams, kv, consumers)
    sent = await r.sent_by(who)
    await run_batch(start, fan, turns, 1, tag(f"ops{fan}{'e' if engine else 'f'}"))
    await r.quiet()
    sent = await r.sent_by(who) - sent
    after = await r.counters(streams, kv, consumers)
    d = {k: after[k] - before[k] for k in after}
    return OpCounts(
        kv_writes=d["kv"] / turns,
        publishes=d["pub"] / turns,
        acks=d["acks"] / turns,
        kv_bytes=max(64, d["kv_bytes"] // max(1, d["kv_msgs"])),
        msg_bytes=max(64, d["pub_bytes"] // max(1, d["pub_msgs"])),
        sent=sent / turns,
    )


def message_kind(subject: str, data: bytes) -> str | None:
    """What a message a worker sent is for, from its subject (None: not a worker's)."""
    if subject.startswith("$JS.ACK."):
        # ack_sync sends an empty body, which the server takes as +ACK.
        kinds = {b"": "ack", b"+ACK": "ack", b"-NAK": "nak", b"+WPI": "in-progress ack"}
        return kinds.get(data[:4], "term")
    if subject.startswith("$JS.API.DIRECT.GET."):
        stream = subject.split(".")[4]
        return "history read (direct get)" if stream == topology.EVENTS_STREAM else "KV read"
    if subject.startswith("$JS.API.STREAM.MSG.GET."):
        stream = subject.split(".")[5]
        return "KV read" if stream.startswith("KV_") else f"stream read ({stream})"
    if subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
        return "pull request"
    if subject.startswith("$JS.API."):
        return None  # the driver's own info requests
    if subject.startswith("$KV."):
        return "KV write"
    if subject.startswith(("jl.step.", "floor.step.")):
        return "step publish"
    if subject.startswith(("jl.event.", "floor.event.")):
        return "event/history publish"
    return None  # turn requests (the driver), timers' schedules, live text


async def message_mix(
    r: Rig, start: Starter, fan: int, turns: int, stream_marks: Sequence[str]
) -> dict[str, float]:
    """Per turn, what the worker sends the server, by kind: a core subscription sees every
    request, publish and ack (only those naming ``stream_marks`` or their subjects)."""
    counts: dict[str, int] = {}

    async def on(msg: Msg) -> None:
        if not any(m in msg.subject for m in stream_marks):
            return
        kind = message_kind(msg.subject, msg.data)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1

    await r.quiet()
    subs = [await r.nc.subscribe(p, cb=on) for p in ("$JS.>", "$KV.>", "jl.>", "floor.>")]
    try:
        await run_batch(start, fan, turns, 1, tag(f"mix{fan}"))
        await r.quiet()
        await r.nc.flush()
    finally:
        for sub in subs:
            await sub.unsubscribe()
    return {k: v / turns for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


ENGINE_MARKS = ("JL_", "jl_", "jl.")
FLOOR_MARKS = ("FLOOR_", "floor_", "floor.")


async def start_sized_floor(r: Rig, engine: OpCounts) -> dict[str, OpCounts]:
    """Start the floor worker with payloads sized so that it stores, per KV write and per
    message, what the engine stores (stored sizes include subjects and headers); return
    the floor's own op counts per turn shape."""
    await r.start_floor(engine)
    await run_batch(r.floor_turn, 5, 40, 10, tag("warm"))
    first = await count_ops(r, r.floor_turn, 5, 20, False)
    r.stop_floor()
    await r.start_floor(_payloads_for(engine, first, engine))
    return {k: await count_ops(r, r.floor_turn, f, 20, False) for k, f in TURN_KINDS.items()}


def _payloads_for(target: OpCounts, stored: OpCounts, sent: OpCounts) -> OpCounts:
    """Payload sizes that make the floor store ``target``'s bytes, given that payloads of
    ``sent``'s sizes stored ``stored``'s (the difference is subjects and headers)."""
    kv = max(16, target.kv_bytes - (stored.kv_bytes - sent.kv_bytes))
    msg = max(16, target.msg_bytes - (stored.msg_bytes - sent.msg_bytes))
    return OpCounts(target.kv_writes, target.publishes, target.acks, kv, msg)


def tag(prefix: str) -> str:
    """A fresh session-id prefix: every batch runs on sessions of its own."""
    return f"{prefix}{uuid.uuid4().hex[:8]}-"
