"""Core benchmarks (issue 7), each against a baseline measured in the same run.

- ``engine_overhead``: turn latency p50/p99 of a one-model-step turn and of the 7-step turn
  (a model step, five parallel no-op tool steps, a model step) with the zero-latency app
  ``jetloop.tooling.bench.app``, sequential and with 50 turns in flight, against the raw JetStream
  floor of ``jetloop.tooling.bench.floor`` (the same CAS writes, publishes and acks, nothing else).
- ``throughput``: steps per second (model and tool steps) of 7-step turns on many concurrent
  sessions, with 1, 2 and 4 worker processes (``jetloop worker --processes N``), each beside
  the machine's core count, against the floor.
- ``history_growth``: durable bytes per step (growth of every jetloop stream's and bucket's
  ``state.bytes``) and turn latency when the session's history holds ~10 and ~1,000 messages.
- ``waiting_at_scale``: N sessions parked on approvals and timers: worker and server RSS,
  store size on disk, and the time to release them all.
- ``profile`` (``jetloop.tooling.bench.profile``): the 7-step turn under pyinstrument.
- ``peer`` (``jetloop.tooling.bench.peer``): the 7-step turn on Restate and on DBOS Transact with
  SQLite, side by side with the engine, sequential and 50 in flight (each peer runs when it
  is installed: ``pip install -e '.[peer]'`` and ``npm ci --prefix jetloop/tooling/bench/restate``;
  one missing is said on stderr and left out).

Every benchmark runs on its own nats-server on a temporary store with real worker processes
(``jetloop.tooling.bench.rig``); nothing here changes the engine. ``run_benchmarks`` runs a chosen
set; the targets and the printed tables are ``jetloop.tooling.bench.report``; ``main`` is what
``jetloop bench`` calls. (About 600 lines: the benchmarks share the rig, the sizes and the
runner, and read best side by side.)
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nats.aio.msg import Msg

from jetloop.schemas import Event, approval_id_for, call_key, decode, turn_id_for
from jetloop.services import durability
from jetloop.services.client import Client
from jetloop.streams.bus import H_SESSION
from jetloop.streams.seal import Sealer, key_bytes
from jetloop.tooling.bench.limits import limit_cost
from jetloop.tooling.bench.peer import available, peer_side_by_side
from jetloop.tooling.bench.profile import profile_engine
from jetloop.tooling.bench.report import BenchReport, format_report, judge
from jetloop.tooling.bench.rig import (
    ENGINE_MARKS,
    FLOOR_MARKS,
    SEAL_KEY,
    STEPS_OF,
    TURN_KINDS,
    Latency,
    OpCounts,
    Rig,
    count_ops,
    message_mix,
    rig,
    run_batch,
    start_sized_floor,
    tag,
)
from jetloop.tooling.trials.run import machine, percentile

# --- engine overhead -----------------------------------------------------------------------


@dataclass
class OverheadRow:
    """Engine against floor for one turn shape and one load."""

    turn: str
    load: str
    engine: Latency
    floor: Latency

    @property
    def ratio_p50(self) -> float:
        return self.engine.p50_ms / self.floor.p50_ms

    @property
    def ratio_p99(self) -> float:
        return self.engine.p99_ms / self.floor.p99_ms


@dataclass
class OverheadResult:
    """The latency rows, and what a turn costs each side in operations and messages."""

    rows: list[OverheadRow]
    engine_ops: dict[str, OpCounts]
    floor_ops: dict[str, OpCounts]
    # per turn shape: what the worker sent the server, by kind (``bench_rig.message_kind``)
    engine_mix: dict[str, dict[str, float]]
    floor_mix: dict[str, dict[str, float]]


async def engine_overhead(
    r: Rig,
    sequential: int = 200,
    concurrent: int = 500,
    in_flight: int = 50,
    chunks: int = 4,
    warm: int = 40,
    op_turns: int = 20,
) -> OverheadResult:
    """Latency of both turn shapes, engine against floor, sequential and ``in_flight`` at
    once. The engine worker and the floor worker both run throughout and their batches
    alternate in ``chunks``, so a change in the machine's background load hits both.
    ``op_turns`` turns of each shape count operations and messages."""
    await r.start_workers(1)
    await run_batch(r.engine_turn, 5, warm, 10, tag("warm"))
    engine_ops = {
        k: await count_ops(r, r.engine_turn, f, op_turns, True) for k, f in TURN_KINDS.items()
    }
    floor_ops = await start_sized_floor(r, engine_ops["7-step"])
    engine_mix = {
        k: await message_mix(r, r.engine_turn, f, op_turns, ENGINE_MARKS)
        for k, f in TURN_KINDS.items()
    }
    floor_mix = {
        k: await message_mix(r, r.floor_turn, f, op_turns, FLOOR_MARKS)
        for k, f in TURN_KINDS.items()
    }
    rows = []
    for load, total, width in (
        ("sequential", sequential, 1),
        (f"{in_flight} in flight", concurrent, in_flight),
    ):
        for kind, fan in TURN_KINDS.items():
            eng: list[float] = []
            flo: list[float] = []
            for _ in range(chunks):
                for start, out in ((r.engine_turn, eng), (r.floor_turn, flo)):
                    await r.quiet()
                    b = await run_batch(start, fan, total // chunks, width, tag("o"))
                    out.extend(b.latencies)
            rows.append(OverheadRow(kind, load, Latency.of(eng), Latency.of(flo)))
    r.stop_workers()
    r.stop_floor()
    return OverheadResult(rows, engine_ops, floor_ops, engine_mix, floor_mix)


# --- throughput ----------------------------------------------------------------------------


@dataclass
class ThroughputRow:
    """One throughput run: engine (with n workers) or floor."""

    what: str
    turns: int
    in_flight: int
    wall_s: float
    steps_per_s: float
    turn_p50_ms: float
    processes: int  # worker processes (the floor: its one process)
    cores: int  # the machine's, os.cpu_count(): what the processes had to share with the server


async def throughput(
    r: Rig,
    turns: int = 1000,
    in_flight: int = 200,
    workers: Sequence[int] = (1, 2, 4),
    warm: int = 100,
    op_turns: int = 20,
) -> list[ThroughputRow]:
    """Steps per second of 7-step turns, ``in_flight`` sessions at once, with each number of
    worker processes in ``workers`` (``jetloop worker --processes N``)."""
    rows = []
    ops: OpCounts | None = None
    cores = os.cpu_count() or 0
    for n in workers:
        await r.start_worker_processes(n)
        await run_batch(r.engine_turn, 5, warm, 50, tag("warm"))
        if ops is None:
            ops = await count_ops(r, r.engine_turn, 5, op_turns, True)
        await r.quiet()
        b = await run_batch(r.engine_turn, 5, turns, in_flight, tag("t"))
        rows.append(
            ThroughputRow(
                f"engine, {n} worker process{'es' if n > 1 else ''}",
                turns,
                in_flight,
                b.wall,
                b.per_second(7),
                Latency.of(b.latencies).p50_ms,
                n,
                cores,
            )
        )
        await r.quiet()
        r.stop_workers()
    assert ops is not None, "no worker count given"
    await start_sized_floor(r, ops)
    await run_batch(r.floor_turn, 5, warm, 50, tag("warm"))
    await r.quiet()
    b = await run_batch(r.floor_turn, 5, turns, in_flight, tag("t"))
    rows.append(
        ThroughputRow(
            "floor, 1 process",
            turns,
            in_flight,
            b.wall,
            b.per_second(7),
            Latency.of(b.latencies).p50_ms,
            1,
            cores,
        )
    )
    await r.quiet()
    r.stop_floor()
    return rows


# --- history growth ------------------------------------------------------------------------


@dataclass
class HistoryRow:
    """Turns measured when a session's history held about ``history`` messages."""

    history: int
    turn: str
    latency: Latency
    bytes_per_step: float


async def history_growth(
    r: Rig, small: int = 10, large: int = 1000, samples: int = 10, warm: int = 40
) -> list[HistoryRow]:
    """Durable bytes per step and turn latency at a short and a long history.

    A 7-step turn adds 8 history entries (user, assistant with calls, 5 tool results,
    answer), a 1-step turn 2. At ``small``, ``samples`` sessions are each brought to about
    ``small`` entries and measured once per shape; at ``large``, one session is filled with
    7-step turns and measured ``samples`` times per shape. Bytes are the growth of
    ``state.bytes`` over every jetloop stream and bucket, the turn's trailing steps included.
    """
    await r.start_workers(1)
    await run_batch(r.engine_turn, 5, warm, 10, tag("warm"))
    rows: list[HistoryRow] = []
    short = [f"{tag('hs')}{i}" for i in range(samples)]
    for sid in short:
        await _fill(r, sid, small)
    long_sid = f"{tag('hl')}0"
    await _fill(r, long_sid, large)
    for kind, fan in TURN_KINDS.items():
        rows.append(await _measure(r, short, fan, kind, small))
        rows.append(await _measure(r, [long_sid] * samples, fan, kind, large))
    r.stop_workers()
    return rows


async def _fill(r: Rig, sid: str, entries: int) -> None:
    """Bring a session's history to about ``entries`` messages with real turns."""
    have = 0
    while have + 8 <= entries:
        await asyncio.wait_for(await r.engine_turn(sid, f"{sid}-fill{have}", 5), 60)
        have += 8
    while have + 2 <= entries:
        await asyncio.wait_for(await r.engine_turn(sid, f"{sid}-fill{have}", 0), 60)
        have += 2
    await r.quiet()


async def _measure(r: Rig, sids: list[str], fan: int, kind: str, history: int) -> HistoryRow:
    latencies: list[float] = []
    grown = 0
    for n, sid in enumerate(sids):
        before = await r.stored_bytes()
        t0 = time.perf_counter()
        t1 = await asyncio.wait_for(await r.engine_turn(sid, f"{sid}-m{fan}-{n}", fan), 60)
        latencies.append(t1 - t0)
        await r.quiet()
        grown += await r.stored_bytes() - before
    return HistoryRow(history, kind, Latency.of(latencies), grown / len(sids) / STEPS_OF[fan])


# --- waiting at scale ----------------------------------------------------------------------


@dataclass
class WaitingResult:
    """Sessions parked on approvals and timers, what they cost, how fast they got going."""

    approvals: int
    timers: int
    park_seconds: float
    worker_rss_mb_before: float
    worker_rss_mb_parked: float
    server_rss_mb_before: float
    server_rss_mb_parked: float
    store_mb_before: float
    store_mb_parked: float
    approvals_release_seconds: float
    timers_release_seconds: float  # from the scheduled second to the last turn's end
    timer_lateness_p50_s: float
    timer_lateness_p99_s: float


def rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


class Tally:
    """Sessions seen on a core subject (a re-emitted event counts once); ``reached(n)``
    waits until ``n`` were seen."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.changed = asyncio.Event()

    async def on(self, msg: Msg) -> None:
        self.seen.add((msg.headers or {}).get(H_SESSION, msg.subject))
        self.changed.set()

    async def reached(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.seen) < n:
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(self.seen)} of {n} seen in {timeout}s")
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                continue


async def waiting_at_scale(r: Rig, sessions: int = 2000, in_flight: int = 200) -> WaitingResult:
    """Half the sessions wait for an approval, half for a timer, all due at one wall-clock
    second; the worker's and server's memory and the store's size before and after parking;
    then every approval is granted at once, then the timers come due; for each kind, the
    time until every turn ended (for timers, from the second they were scheduled for)."""
    n_a, n_t = sessions // 2, sessions - sessions // 2
    [worker] = await r.start_workers(1)
    await run_batch(r.engine_turn, 5, 40, 10, tag("warm"))
    await r.quiet()
    server_pid = r.server.server_pid()
    assert server_pid is not None
    before = (rss_mb(worker.pid), rss_mb(server_pid), dir_mb(r.base / "store"))

    parked = Tally()
    fire_at: dict[str, float] = {}  # session → the second its timer is scheduled for

    async def timer_set(msg: Msg) -> None:
        ev = decode(Event, msg.data)
        fire_at[ev.session_id] = math.ceil(float(ev.data["due"]))  # the engine rounds up
        await parked.on(msg)

    subs = [
        await r.nc.subscribe("jl.event.*.approval.requested", cb=parked.on),
        await r.nc.subscribe("jl.event.*.timer.set", cb=timer_set),
    ]
    prefix = tag("p")
    sem = asyncio.Semaphore(in_flight)
    ends: dict[str, asyncio.Future[float]] = {}

    async def park(lo: int, hi: int, text: str) -> None:
        async def one(i: int) -> None:
            async with sem:
                sid = f"{prefix}{i}"
                ends[sid] = await r.send("parked", sid, sid, text)

        async with asyncio.TaskGroup() as tg:
            for i in range(lo, hi):
                tg.create_task(one(i))
        await parked.reached(hi, timeout=1200)

    t0 = time.perf_counter()
    await park(0, n_a, "approve")
    per_session = (time.perf_counter() - t0) / max(1, n_a)
    # Every timer due at one second, after all are parked and the approvals released
    # (about as long as parking them took), with a margin.
    due = math.ceil(time.time() + 10 + 3 * per_session * sessions)
    await park(n_a, sessions, f"timer_at {due}")
    park_seconds = time.perf_counter() - t0
    await r.quiet(timeout=600)
    after = (rss_mb(worker.pid), rss_mb(server_pid), dir_mb(r.base / "store"))
    for sub in subs:
        await sub.unsubscribe()

    sealer = Sealer([key_bytes(SEAL_KEY)])
    async with await Client.connect(r.server.url, sealer=sealer) as client:
        t_start = time.perf_counter()

        async def grant(i: int) -> None:
            async with sem:
                sid = f"{prefix}{i}"
                aid = approval_id_for(call_key(sid, turn_id_for(sid, sid), 0, 0))
                await client.approve(sid, aid, by="bench")

        async with asyncio.TaskGroup() as tg:
            for i in range(n_a):
                tg.create_task(grant(i))
        done = await asyncio.gather(*(ends[f"{prefix}{i}"] for i in range(n_a)))
        approvals_release = max(done) - t_start
    if time.time() > min(fire_at.values()):
        raise RuntimeError("timers came due before the approvals were released: raise the margin")
    timer_done = await asyncio.wait_for(
        asyncio.gather(*(ends[f"{prefix}{i}"] for i in range(n_a, sessions))),
        timeout=max(fire_at.values()) - time.time() + 600,
    )
    # perf_counter → wall clock, to compare with the second each timer was scheduled for.
    offset = time.time() - time.perf_counter()
    lateness = [
        t + offset - fire_at[f"{prefix}{i}"]
        for i, t in zip(range(n_a, sessions), timer_done, strict=True)
    ]
    r.stop_workers()
    return WaitingResult(
        approvals=n_a,
        timers=n_t,
        park_seconds=park_seconds,
        worker_rss_mb_before=before[0],
        worker_rss_mb_parked=after[0],
        server_rss_mb_before=before[1],
        server_rss_mb_parked=after[1],
        store_mb_before=before[2],
        store_mb_parked=after[2],
        approvals_release_seconds=approvals_release,
        timers_release_seconds=max(lateness),
        timer_lateness_p50_s=percentile(lateness, 50) or math.nan,
        timer_lateness_p99_s=percentile(lateness, 99) or math.nan,
    )


# --- the run -------------------------------------------------------------------------------

BENCHMARKS = ("overhead", "throughput", "history", "waiting", "profile", "peer", "limits")


@dataclass(frozen=True)
class Sizes:
    """How much each benchmark runs; ``QUICK`` is a smoke run."""

    sequential: int = 300
    concurrent: int = 1000
    throughput_turns: int = 1500
    throughput_in_flight: int = 200
    history_large: int = 1000
    history_samples: int = 10
    waiting_sessions: int = 2000
    profile_sequential: int = 300
    profile_concurrent: int = 600
    peer_sequential: int = 200
    peer_concurrent: int = 500
    # warm-up turns, turns that count operations, and how the overhead batches alternate
    warm: int = 40
    throughput_warm: int = 100
    op_turns: int = 20
    chunks: int = 4
    throughput_workers: tuple[int, ...] = (1, 2, 4)
    peer_workers: int = 1  # jetloop's worker processes beside the peers
    event_log: str = "folded"  # the session log's layout in every benchmark
    # When the rig's server syncs what it acknowledged (jetloop.services.durability): always,
    # as `jetloop up` runs it, unless --nats-sync says otherwise.
    nats_sync: str = durability.ALWAYS
    # peer: trace both servers' syncs to disk (jetloop.tooling.bench.syncs).
    count_syncs: bool = False
    # peer: also the floor of lever 1's write pattern (jetloop.tooling.bench.floor_lever1).
    lever1: bool = False
    limit_calls: int = 2000


# A smoke run: every benchmark on small numbers, well under a minute on 2 idle cores.
QUICK = Sizes(
    sequential=30,
    concurrent=100,
    throughput_turns=150,
    throughput_in_flight=50,
    history_large=100,
    history_samples=3,
    waiting_sessions=200,
    profile_sequential=60,
    profile_concurrent=120,
    peer_sequential=40,
    peer_concurrent=100,
    warm=10,
    throughput_warm=20,
    op_turns=5,
    chunks=2,
    throughput_workers=(1,),
    limit_calls=200,
)


class BenchFailed(RuntimeError):
    """A benchmark could not run to its end; ``name`` says which."""

    def __init__(self, name: str, cause: BaseException) -> None:
        lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
        why = lines[0] if lines else type(cause).__name__
        if len(lines) > 1:
            # A worker's log tail: its last line says what went wrong.
            why = f"{why.rstrip(':;')} … {lines[-1]}"
        super().__init__(f"the {name} benchmark failed: {why}")
        self.name = name


async def run_benchmarks(
    which: Sequence[str] = ("overhead", "throughput", "history"),
    *,
    sizes: Sizes = Sizes(),
    out_json: Path | str | None = None,
    work_dir: Path | None = None,
) -> BenchReport:
    """Run the named benchmarks (``BENCHMARKS``), each on a fresh server, and judge them."""
    unknown = set(which) - set(BENCHMARKS)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; choose from {BENCHMARKS}")
    peers, skipped = available() if "peer" in which else ([], [])
    if "peer" in which and not peers:
        raise ValueError("the peer benchmark has no peer to run: " + "; ".join(skipped))
    for sentence in skipped:
        print(f"jetloop bench peer: {sentence}", file=sys.stderr)
    began = time.monotonic()
    rep = BenchReport(machine=machine())
    for name in which:
        try:
            await _run_one(rep, name, sizes, work_dir, peers, skipped)
        except Exception as exc:  # every failure of a run is reported the same way
            raise BenchFailed(name, exc) from exc
    rep.targets = judge(rep)
    rep.wall_seconds = time.monotonic() - began
    if out_json is not None:
        text = json.dumps(rep.to_json(), indent=2, default=str) + "\n"
        await asyncio.to_thread(Path(out_json).write_text, text)
    return rep


async def _run_one(
    rep: BenchReport,
    name: str,
    sizes: Sizes,
    work_dir: Path | None,
    peers: list[str],
    skipped: list[str],
) -> None:
    """One benchmark on a rig of its own; its result goes into ``rep``."""
    wd = work_dir / name if work_dir is not None else None
    trace = sizes.count_syncs and name == "peer"
    async with rig(wd, sizes.event_log, sizes.nats_sync, sync_trace=trace) as r:
        if name == "overhead":
            rep.overhead = await engine_overhead(
                r,
                sizes.sequential,
                sizes.concurrent,
                chunks=sizes.chunks,
                warm=sizes.warm,
                op_turns=sizes.op_turns,
            )
        elif name == "throughput":
            rep.throughput = await throughput(
                r,
                sizes.throughput_turns,
                sizes.throughput_in_flight,
                workers=sizes.throughput_workers,
                warm=sizes.throughput_warm,
                op_turns=sizes.op_turns,
            )
        elif name == "history":
            rep.history = await history_growth(
                r,
                large=sizes.history_large,
                samples=sizes.history_samples,
                warm=sizes.warm,
            )
        elif name == "waiting":
            rep.waiting = await waiting_at_scale(r, sizes.waiting_sessions)
        elif name == "limits":
            rep.limits = await limit_cost(r, sizes.limit_calls)
        elif name == "peer":
            rep.peer = await peer_side_by_side(
                r,
                sizes.peer_sequential,
                sizes.peer_concurrent,
                chunks=sizes.chunks,
                peers=peers,
                skipped=skipped,
                workers=sizes.peer_workers,
                event_log=sizes.event_log,
                lever1=sizes.lever1,
            )
        else:
            # Kept after the run (the report names it): the text tree and pstats.
            out = (
                work_dir / "profile"
                if work_dir is not None
                else Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="jetloop-profile-"))
            )
            rep.profile = await profile_engine(
                r, out, sizes.profile_sequential, sizes.profile_concurrent
            )


def main(
    which: Sequence[str] = ("overhead", "throughput", "history"),
    quick: bool = False,
    out_json: Path | str | None = None,
    work_dir: Path | None = None,
    waiting_sessions: int | None = None,
    workers: int | None = None,
    event_log: str | None = None,
    nats_sync: str | None = None,
    count_syncs: bool = False,
    lever1: bool = False,
) -> int:
    """What ``jetloop bench`` runs: prints the tables; 0 if every measured target is met,
    1 if one is not, 2 if a benchmark could not run (each said in one line on stderr)."""
    from dataclasses import replace

    from jetloop.services.logs import configure

    configure("console", "warning")
    sizes = QUICK if quick else Sizes()
    if waiting_sessions is not None:
        sizes = replace(sizes, waiting_sessions=waiting_sessions)
    if workers is not None:
        sizes = replace(sizes, peer_workers=workers)
    if event_log is not None:
        sizes = replace(sizes, event_log=event_log)
    if count_syncs:
        sizes = replace(sizes, count_syncs=True)
    if lever1:
        sizes = replace(sizes, lever1=True)
    if nats_sync is not None:
        try:
            sizes = replace(sizes, nats_sync=durability.check(nats_sync))
        except ValueError as exc:
            print(f"jetloop bench: --nats-sync: {exc}", file=sys.stderr)
            return 2
    try:
        rep = asyncio.run(run_benchmarks(which, sizes=sizes, out_json=out_json, work_dir=work_dir))
    except ValueError as exc:
        print(f"jetloop bench: {exc}", file=sys.stderr)
        return 2
    except BenchFailed as exc:
        logs = f"logs in {work_dir}" if work_dir else "--keep DIR keeps the logs"
        print(f"jetloop bench: {exc} ({logs})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jetloop bench: interrupted", file=sys.stderr)
        return 130
    print(format_report(rep))
    missed = [t for t in rep.targets if not t.met]
    if missed:
        what = "; ".join(f"{t.name}: {t.measured}, wanted {t.target}" for t in missed)
        if quick:
            # A smoke run checks that every benchmark runs; its small samples judge nothing.
            print(
                f"jetloop bench --quick: ran; not judged, but {len(missed)} target(s) "
                f"would be missed: {what}",
                file=sys.stderr,
            )
            return 0
        print(f"jetloop bench: {len(missed)} target(s) not met: {what}", file=sys.stderr)
        return 1
    return 0
