"""Peers side by side: jetloop's 7-step turn against the same turn on Restate and on DBOS
Transact.

The turn is the one of ``jetloop.tooling.bench.app``'s ``fan 5``: a model step that answers at once
asking for five calls, five no-op tool steps run in parallel, a model step that answers.

- On **Restate** (``jetloop/tooling/bench/restate``: the server from the npm package, the service on
  ``restate-sdk`` and hypercorn) it is a service handler whose seven steps are durable
  ``ctx.run`` steps, the five tool steps started together and gathered; a turn is one call on
  the server's HTTP ingress, driven from this process (``jetloop.tooling.bench.restate.side``).
- On **DBOS Transact** (the ``dbos`` package) it is an async workflow of async steps with a
  SQLite system database, where every step's result is checkpointed before the workflow goes
  on: the model steps are DBOS steps returning a canned answer (no I/O), the five tool steps
  are DBOS steps started together in call order and awaited with ``asyncio.gather`` (DBOS
  numbers a step when the step function is called, not when it is awaited, so the order of
  the calls fixes each step's id and a replay finds its checkpoint). DBOS is a library: its
  workflows run in the process that starts them, it keeps global state and threads of its
  own, so it runs in a subprocess of its own (``python -m jetloop.tooling.bench.peer``) on a SQLite
  file in a fresh temporary directory. A DBOS turn's latency is from starting the workflow
  (``DBOS.start_workflow_async``, which returns once the workflow is durably recorded) to its
  result (``handle.get_result()``), in that process.

A jetloop turn's latency is from publishing the turn request to its ``turn.completed``
event, as everywhere in ``jetloop.tooling.bench.run``. Every side is driven by
``bench_rig.run_batch``.
Each peer is optional: ``available`` says which are installed, and a sentence for each one
that is not (what to install); the others still run.

``peer_side_by_side`` runs all on the same loads (sequential, and many turns with
``in_flight`` at once), alternating jetloop's and each peer's batches in ``chunks`` so that a
change in the machine's background load hits all, and reports latency and steps per second
(7 steps per turn: 2 model, 5 tool) of each, the ratios of jetloop to each peer, and the load
average before and after. ``format_peer`` renders it.

Command line of the DBOS side alone (one DBOS process, a warm-up, then both loads; prints
one JSON object)::

    python -m jetloop.tooling.bench.peer --turns 200 --concurrent 500 --in-flight 50 --json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import math
import os
import sqlite3
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from jetloop.services import durability
from jetloop.services.settings import load_settings
from jetloop.tooling.bench import syncs as bench_syncs
from jetloop.tooling.bench.costs import Cost
from jetloop.tooling.bench.restate import side as restate_side
from jetloop.tooling.bench.rig import (
    STEPS_OF,
    TURN_KINDS,
    Latency,
    Rig,
    count_ops,
    run_batch,
    start_sized_floor,
    tag,
)

FAN = TURN_KINDS["7-step"]
STEPS = STEPS_OF[FAN]  # 2 model steps + 5 tool steps
WARM_TURNS, WARM_IN_FLIGHT = 40, 10  # as engine_overhead warms the engine up
DB_FILE = "dbos.sqlite"
STREAM_LIMIT = 64 * 1024 * 1024  # one reply line holds every latency of a batch
READY_SECONDS = 120.0
BATCH_SECONDS = 600.0
INSTALL_DBOS = "pip install -e '.[peer]'"


# --- results -------------------------------------------------------------------------------

JETLOOP, RESTATE, DBOS = "jetloop", "Restate", "DBOS"
# The same turn on raw JetStream (``jetloop.tooling.bench.floor``): the same CAS writes,
# publishes and acks as the engine's, nothing else; the floor a step's messages cannot go under.
FLOOR = "floor"
# Lever 1's write pattern on raw JetStream (``jetloop.tooling.bench.floor_lever1``): a step's
# commit is its successor's work item; what the engine would cost if it stored that alone.
FLOOR1 = "floor, lever 1"
# The systems whose every message and CPU second on this machine the bench can count.
METERED = (JETLOOP, FLOOR)


@dataclass
class Samples:
    """One system on one load, over all its batches: each turn's latency and the walls."""

    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def add(self, latencies_s: list[float], wall_s: float) -> None:
        self.latencies_s.extend(latencies_s)
        self.wall_s += wall_s


@dataclass
class SystemRun:
    """One system on one load: latency (ms) and steps per second."""

    latency: Latency
    steps_per_s: float

    @classmethod
    def of(cls, s: Samples) -> SystemRun:
        return cls(Latency.of(s.latencies_s), len(s.latencies_s) * STEPS / s.wall_s)


@dataclass
class PeerRow:
    """Every system on one load, jetloop first."""

    load: str
    turns: int  # of each system
    in_flight: int
    systems: dict[str, SystemRun]

    def ratios(self, peer: str, of: str = JETLOOP) -> tuple[float, float, float]:
        """``of`` (jetloop) ÷ ``peer``: p50, p99 (below 1, ``of``'s turns are faster) and
        steps per second (above 1, ``of`` runs more)."""
        j, p = self.systems[of], self.systems[peer]
        return (
            j.latency.p50_ms / p.latency.p50_ms,
            j.latency.p99_ms / p.latency.p99_ms,
            j.steps_per_s / p.steps_per_s,
        )


@dataclass
class PeerResult:
    """The rows, what each peer ran on, the peers left out, and the machine's load."""

    rows: list[PeerRow]
    peers: list[str]  # the peers that ran, in the order of their batches
    versions: dict[str, str]  # system → what ran (versions, store)
    skipped: list[str]  # a sentence per peer not installed: what to install
    dbos: dict[str, Any] | None  # DbosSide.stats() of the run, when DBOS ran
    restate_journal_per_turn: dict[str, float] | None  # journal entries by type, per turn
    load_before: tuple[float, float, float]  # os.getloadavg(): 1, 5, 15 minutes
    load_after: tuple[float, float, float]
    cores: int
    chunks: int  # batches of each system per load, alternating
    steps_per_turn: int = STEPS
    workers: int = 1  # jetloop's worker processes
    # load → system (jetloop, floor) → per turn: server messages in and out, CPU ms of the
    # server, the workers and the driving client (jetloop.tooling.bench.costs).
    costs: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)
    event_log: str = "folded"  # the layout of jetloop's session log (jetloop.schemas.log)
    nats_sync: str = durability.ALWAYS  # when jetloop's server syncs (services.durability)
    # load → system → syncs per turn by where (jetloop.tooling.bench.syncs), when counted.
    syncs: dict[str, dict[str, bench_syncs.Syncs]] = field(default_factory=dict)
    # Steps each worker runs at once, by pool, as its settings resolve in the bench's
    # environment (which its workers inherit): model, tool, session.
    pools: tuple[int, int, int] = (0, 0, 0)


def worker_pools() -> tuple[int, int, int]:
    """The pool sizes a worker started from this environment runs with (its settings, read
    as the worker reads them)."""
    s = load_settings()
    return s.model_concurrency, s.tool_concurrency, s.session_concurrency


@dataclass
class DbosBatch:
    """What the DBOS process measured for one batch (latencies in ms)."""

    latencies_ms: list[float]
    wall_s: float

    @classmethod
    def of(cls, data: dict[str, Any]) -> DbosBatch:
        return cls([float(v) for v in data["latencies_ms"]], float(data["wall_s"]))


def available() -> tuple[list[str], list[str]]:
    """The peers installed here, and a sentence for each one that is not."""
    peers, skipped = [], []
    why = restate_side.missing()
    if why is None:
        peers.append(RESTATE)
    else:
        skipped.append(why)
    if importlib.util.find_spec("dbos") is None:
        skipped.append(f"DBOS skipped: dbos not installed; to run it: {INSTALL_DBOS}")
    else:
        peers.append(DBOS)
    return peers, skipped


# --- side by side (the jetloop process) ----------------------------------------------------


class DbosPeer:
    """The DBOS process in serve mode: one JSON line per batch asked for on its stdin, one
    JSON line back on its stdout; its stderr (DBOS's logs) goes to ``log``."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self._log_file: IO[bytes] | None = None
        self.hello: dict[str, Any] = {}

    async def start(self) -> None:
        self._log_file = await asyncio.to_thread(self.log.open, "wb")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jetloop.tooling.bench.peer",
            "--serve",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._log_file,
            limit=STREAM_LIMIT,
            start_new_session=True,
        )
        self.hello = await self._reply(READY_SECONDS)
        if not self.hello.get("ready"):
            raise RuntimeError(f"the DBOS process did not start: {self.hello} (see {self.log})")

    async def ask(self, request: dict[str, Any], timeout: float = BATCH_SECONDS) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None, "not started"
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        await self.proc.stdin.drain()
        return await self._reply(timeout)

    async def batch(self, turns: int, in_flight: int) -> DbosBatch:
        return DbosBatch.of(await self.ask({"turns": turns, "in_flight": in_flight}))

    async def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None, "not started"
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            code = await self.proc.wait()
            raise RuntimeError(f"the DBOS process exited ({code}); see {self.log}")
        data: dict[str, Any] = json.loads(line)
        if "error" in data:
            raise RuntimeError(f"the DBOS process failed: {data['error']} (see {self.log})")
        return data

    async def stop(self) -> None:
        """Close its stdin (it shuts DBOS down and exits), else kill it."""
        if self.proc is not None:
            if self.proc.stdin is not None and not self.proc.stdin.is_closing():
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
            self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


BatchRunner = Callable[[int, int], Awaitable[tuple[list[float], float]]]


async def peer_side_by_side(
    r: Rig,
    sequential: int = 200,
    concurrent: int = 500,
    in_flight: int = 50,
    chunks: int = 4,
    peers: list[str] | None = None,
    skipped: list[str] | None = None,
    workers: int = 1,
    floor: bool = True,
    event_log: str = "folded",
    lever1: bool = False,
) -> PeerResult:
    """The 7-step turn on jetloop (``workers`` worker processes) and on each installed peer
    (Restate, DBOS),
    sequential and ``in_flight`` at once, their batches alternating in ``chunks``; each
    system is warmed up first, and the jetloop side is quiet (every trailing step acked)
    before each batch of any system. With ``floor`` the raw JetStream floor runs the same
    batches too, and with ``lever1`` the floor of lever 1's write pattern
    (``jetloop.tooling.bench.floor_lever1``); the messages and CPU time of jetloop's batches
    and the floor's are counted (``PeerResult.costs``). On a rig whose server's syncs are
    traced (``Rig.sync_trace``), Restate's server is traced too, and the syncs per turn of
    each are counted (``PeerResult.syncs``); the rig is closed at the end then."""
    if peers is None:
        peers, skipped = available()
    load_before = os.getloadavg()
    pools = worker_pools()
    await r.start_workers(workers)
    restate_base = r.base / "restate"
    tracing = r.sync_trace is not None
    restate_trace = restate_base / "restate-syncs.trace"
    restate = (
        restate_side.RestateSide(
            restate_base, wrap=bench_syncs.prefix(restate_trace) if tracing else None
        )
        if RESTATE in peers
        else None
    )
    windows: list[bench_syncs.Window] = []
    # (load, system) → stream → messages stored during its batches (counted when tracing).
    stored: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    dbos = DbosPeer(r.base / "dbos.log") if DBOS in peers else None
    versions: dict[str, str] = {}
    try:

        async def jetloop_batch(turns: int, width: int) -> tuple[list[float], float]:
            # Through the public API, as the peers are driven through theirs.
            b = await run_batch(r.api_turn, FAN, turns, width, tag("peer"))
            return b.latencies, b.wall

        runners: dict[str, BatchRunner] = {JETLOOP: jetloop_batch}
        await jetloop_batch(WARM_TURNS, WARM_IN_FLIGHT)
        if floor:
            # Sized to store what the engine stores per write and per message.
            engine_ops = await count_ops(r, r.engine_turn, FAN, 20, True)
            await start_sized_floor(r, engine_ops)

            async def floor_batch(turns: int, width: int) -> tuple[list[float], float]:
                b = await run_batch(r.floor_turn, FAN, turns, width, tag("floor"))
                return b.latencies, b.wall

            await floor_batch(WARM_TURNS, WARM_IN_FLIGHT)
            spread = (
                f", its state and log spread over {r.floor_shards} buckets and streams by session"
                if r.floor_shards > 1
                else ""
            )
            versions[FLOOR] = (
                f"the raw JetStream floor (the engine's writes, publishes, acks){spread}"
            )
            runners[FLOOR] = floor_batch
        if floor and lever1:
            await r.start_floor1(engine_ops)

            async def floor1_batch(turns: int, width: int) -> tuple[list[float], float]:
                b = await run_batch(r.floor1_turn, FAN, turns, width, tag("floor1"))
                return b.latencies, b.wall

            await floor1_batch(WARM_TURNS, WARM_IN_FLIGHT)
            versions[FLOOR1] = (
                "lever 1's write pattern on raw JetStream (a step's commit is its successor's"
                " work item)"
            )
            runners[FLOOR1] = floor1_batch
        if restate is not None:
            side = restate

            async def restate_batch(turns: int, width: int) -> tuple[list[float], float]:
                b = await run_batch(side.start_turn, FAN, turns, width, tag("restate"))
                return b.latencies, b.wall

            await restate.start()
            v = restate.versions()
            versions[RESTATE] = (
                f"Restate {v['restate_server']} (restate-sdk {v['restate_sdk']} on hypercorn"
                f" {v['hypercorn']})"
            )
            await restate_batch(WARM_TURNS, WARM_IN_FLIGHT)
            runners[RESTATE] = restate_batch
        if dbos is not None:
            peer = dbos

            async def dbos_batch(turns: int, width: int) -> tuple[list[float], float]:
                b = await peer.batch(turns, width)
                return [ms / 1000 for ms in b.latencies_ms], b.wall_s

            await dbos.start()  # launches DBOS and warms it up the same way
            versions[DBOS] = f"DBOS Transact {dbos.hello['dbos_version']} (SQLite)"
            runners[DBOS] = dbos_batch
        rows = []
        meters = {JETLOOP: r.meter(engine=True), FLOOR: r.meter(engine=False)}
        costs: dict[str, dict[str, dict[str, float | None]]] = {}
        for load, total, width in (
            ("sequential", sequential, 1),
            (f"{in_flight} in flight", concurrent, in_flight),
        ):
            samples = {name: Samples() for name in runners}
            spent = {name: Cost() for name in runners if name in METERED}
            for _ in range(chunks):
                for name, run in runners.items():
                    await r.quiet()
                    before = await meters[name].read() if name in spent else None
                    seqs = await r.last_seqs() if tracing and name in spent else None
                    began = time.time()
                    samples[name].add(*await run(total // chunks, width))
                    if before is not None:
                        # Once the trailing steps are acked too: they are the turn's.
                        await r.quiet()
                        spent[name].add(before, await meters[name].read(), total // chunks)
                    windows.append(
                        bench_syncs.Window(name, load, began, time.time(), total // chunks)
                    )
                    if seqs is not None:
                        now = await r.last_seqs()
                        for stream, seq in now.items():
                            stored[(load, name)][stream] += seq - seqs.get(stream, 0)
            costs[load] = {name: c.per_turn() for name, c in spent.items()}
            rows.append(
                PeerRow(
                    load=load,
                    turns=len(samples[JETLOOP].latencies_s),
                    in_flight=width,
                    systems={name: SystemRun.of(s) for name, s in samples.items()},
                )
            )
        dbos_stats = await dbos.ask({"stats": True}) if dbos is not None else None
        journal = await restate.journal_per_turn() if restate is not None else None
    finally:
        if dbos is not None:
            await dbos.stop()
        if restate is not None:
            await restate.stop()
        r.stop_floor()
        r.stop_workers()
    syncs: dict[str, dict[str, bench_syncs.Syncs]] = {}
    if tracing:
        ours = bench_syncs.per_turn(
            await r.traced_syncs(),
            [w for w in windows if w.system in (JETLOOP, FLOOR, FLOOR1)],
            bench_syncs.nats_where,
            stored,
        )
        theirs = bench_syncs.per_turn(
            await asyncio.to_thread(bench_syncs.read, restate_trace),
            [w for w in windows if w.system == RESTATE],
            bench_syncs.restate_where(restate_base / "data"),
        )
        syncs = {load: {**ours.get(load, {}), **theirs.get(load, {})} for load in ours}
    return PeerResult(
        rows=rows,
        peers=[p for p in runners if p != JETLOOP],
        versions=versions,
        skipped=list(skipped or []),
        dbos=dbos_stats,
        restate_journal_per_turn=journal,
        load_before=load_before,
        load_after=os.getloadavg(),
        cores=os.cpu_count() or 0,
        chunks=chunks,
        workers=workers,
        costs=costs,
        event_log=event_log,
        nats_sync=r.sync,
        syncs=syncs,
        pools=pools,
    )


def _load(avg: tuple[float, float, float]) -> str:
    return " / ".join(f"{v:.2f}" for v in avg)


def format_peer(result: PeerResult) -> str:
    """The side by side as Markdown tables (as ``bench.format_report``'s tables): each
    system's figures, then jetloop ÷ each peer."""
    if not result.rows:
        return "### Peers side by side: none ran\n\n" + "\n".join(result.skipped)
    systems = list(result.rows[0].systems)
    title = ", ".join(result.versions.get(s, s) for s in systems if s != JETLOOP)
    header = " | ".join(f"{w.load} p50 | {w.load} p99 | steps/s {w.load}" for w in result.rows)
    lines = [
        f"### Peers side by side: the 7-step turn, jetloop against {title}",
        "",
        f"| system | {header} | turns |",
        "|---|" + "---:|" * (3 * len(result.rows) + 1),
    ]
    for name in systems:
        cells = " | ".join(
            f"{_ms(w.systems[name].latency.p50_ms)} | {_ms(w.systems[name].latency.p99_ms)} |"
            f" {w.systems[name].steps_per_s:,.0f}"
            for w in result.rows
        )
        turns = "+".join(str(w.systems[name].latency.n) for w in result.rows)
        label = name
        if name == JETLOOP:
            label = "**jetloop**" + (f", {result.workers} workers" if result.workers > 1 else "")
            # The layout a new deployment has (folded) goes without saying.
            label += ", separate log" if result.event_log == "separate" else ""
            if result.nats_sync != durability.ALWAYS:
                label += f", syncs every {result.nats_sync}"
        lines.append(f"| {label} | {cells} | {turns} |")
    lines += [
        "",
        f"| jetloop ÷ | {header} |",
        "|---|" + "---:|" * (3 * len(result.rows)),
    ]
    for name in systems:
        if name == JETLOOP:
            continue
        cells = " | ".join(" | ".join(f"{x:.2f}×" for x in w.ratios(name)) for w in result.rows)
        lines.append(f"| {name} | {cells} |")
    if FLOOR1 in systems and RESTATE in systems:
        # What lever 1 could reach, against the peer to beat, measured in the same run.
        cells = " | ".join(
            " | ".join(f"{x:.2f}×" for x in w.ratios(RESTATE, of=FLOOR1)) for w in result.rows
        )
        lines += ["", f"| {FLOOR1} ÷ | {header} |", "|---|" + "---:|" * (3 * len(result.rows))]
        lines.append(f"| {RESTATE} | {cells} |")
    notes = [
        f"Latencies in ms; {result.steps_per_turn} steps per turn; each system's batches"
        f" alternate in {result.chunks} chunks per load, jetloop's quiet (every trailing step"
        " acked) before each batch of any system. A jetloop turn runs from Client.send until"
        " Client.wait returns (jetloop's public API), through"
        + (" one worker" if result.workers == 1 else f" {result.workers} worker processes")
        + " (a worker runs at once up to {} model, {} tool and {} session steps:"
        " JETLOOP_MODEL_CONCURRENCY, _TOOL_, _SESSION_).".format(*result.pools)
        + f" Its session log is {result.event_log} (JETLOOP_EVENT_LOG); its nats-server"
        + (
            " syncs to disk before it acknowledges (sync_interval always, JETLOOP_NATS_SYNC),"
            " as Restate's server syncs its log."
            if result.nats_sync == durability.ALWAYS
            else f" syncs every {result.nats_sync} (JETLOOP_NATS_SYNC): a power cut would"
            " lose what it acknowledged since, which Restate's server would keep."
        )
    ]
    if RESTATE in systems:
        per = result.restate_journal_per_turn or {}
        runs = per.get("Command: Run", math.nan)
        notes.append(
            f"A Restate turn is one POST on its ingress (with an idempotency key) until the"
            f" answer; {runs:.1f} ctx.run journal entries per turn."
        )
    if DBOS in systems and result.dbos is not None:
        d = result.dbos
        notes.append(
            "A DBOS turn runs from start_workflow_async to get_result in DBOS's own process;"
            f" {float(d['checkpoints_per_turn']):.1f} step checkpoints per turn, SQLite"
            f" journal_mode={d['journal_mode']}, synchronous={d['synchronous']} (DBOS's"
            f" defaults), {int(d['sqlite_bytes']) / 1e6:.1f} MB after the run."
        )
    notes.append(
        f"Load average (1 / 5 / 15 min) on {result.cores} cores:"
        f" {_load(result.load_before)} at the start, {_load(result.load_after)} at the end."
    )
    lines += ["", " ".join(notes)]
    lines += _cost_lines(result)
    lines += bench_syncs.format_syncs(result.syncs)
    if result.skipped:
        lines += ["", *result.skipped]
    return "\n".join(lines)


def _cost_lines(result: PeerResult) -> list[str]:
    """What a turn cost, per system the bench can count (jetloop, the floor), per load."""
    if not result.costs:
        return []
    lines = [
        "",
        "| per turn | server msgs in | server msgs out | server CPU ms | worker CPU ms |"
        " client CPU ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for load, systems in result.costs.items():
        for name, c in systems.items():
            cells = " | ".join(
                "n/a" if c[k] is None else f"{c[k]:,.1f}"
                for k in ("in_msgs", "out_msgs", "server_cpu_ms", "worker_cpu_ms", "client_cpu_ms")
            )
            lines.append(f"| {name}, {load} | {cells} |")
    lines += [
        "",
        "Messages are the server's per-connection counters over each batch (every connection"
        " but the bench's probe, the client's included), until the batch's trailing steps were"
        " acked; CPU is each process's user + system time (/proc) over the same span (the"
        " workers: jetloop's worker processes, or the floor's one). The client is the"
        " bench's driver: for jetloop, Client.send and Client.wait (a read before the send, a"
        " subscription to the session's turn events and a read of the turn record at its"
        " end); for the floor, a publish and a core subscription.",
    ]
    return lines


def _ms(v: float) -> str:
    return f"{v:,.1f}"


# --- the DBOS process ----------------------------------------------------------------------

TurnWorkflow = Callable[[str], Awaitable[str]]


def _dbos() -> Any:
    """The ``dbos`` package, imported here only: it is an optional extra (not installed in
    CI), and the import must not run in the jetloop process. Typed ``Any`` on purpose, so
    that mypy checks this module alike with and without the package."""
    return importlib.import_module("dbos")


def _register_turn(dbos: Any) -> TurnWorkflow:
    """The 7-step turn as a DBOS workflow; registered before DBOS is launched."""

    async def model(text: str, results: list[dict[str, Any]]) -> dict[str, Any]:
        # As bench_app.fan_script: ``fan <n>`` asks for n no-op calls, then answers.
        words = text.split()
        if not results and len(words) == 2 and words[0] == "fan":
            calls = [{"name": "noop", "arguments": {}} for _ in range(int(words[1]))]
            return {"text": "calling", "tool_calls": calls}
        return {"text": "ok", "tool_calls": []}

    async def noop(arguments: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    model_step = dbos.DBOS.step(name="model")(model)
    noop_step = dbos.DBOS.step(name="noop")(noop)

    async def turn(text: str) -> str:
        first = await model_step(text, [])
        # Calling a step function takes its step id (in the order of the calls); the
        # tasks then run the five steps, and their checkpoints, concurrently.
        tasks = [asyncio.create_task(noop_step(c["arguments"])) for c in first["tool_calls"]]
        results = list(await asyncio.gather(*tasks))
        answer: dict[str, Any] = await model_step(text, results)
        return str(answer["text"])

    workflow: TurnWorkflow = dbos.DBOS.workflow(name="turn")(turn)
    return workflow


class DbosSide:
    """DBOS launched on a SQLite file in ``work``, the turn registered, turns driven."""

    def __init__(self, work: Path) -> None:
        self.dbos = _dbos()
        self.db_path = work / DB_FILE
        self.turn = _register_turn(self.dbos)

    def launch(self) -> None:
        config = {
            "name": "jetloop-peer",
            "system_database_url": f"sqlite:///{self.db_path}",
            "log_level": "WARNING",
        }
        self.dbos.DBOS(config=config)
        self.dbos.DBOS.launch()

    def destroy(self) -> None:
        self.dbos.DBOS.destroy()

    async def start_turn(self, sid: str, rid: str, fan: int) -> asyncio.Future[float]:
        """Start one turn (returns once DBOS recorded the workflow); the future resolves
        when its result is back."""
        with self.dbos.SetWorkflowID(rid):
            handle = await self.dbos.DBOS.start_workflow_async(
                self.turn, f"fan {fan}" if fan else "hello"
            )

        async def result() -> float:
            answer = await handle.get_result()
            if answer != "ok":
                raise RuntimeError(f"turn {rid} answered {answer!r}")
            return time.perf_counter()

        return asyncio.ensure_future(result())

    async def batch(self, turns: int, in_flight: int) -> dict[str, Any]:
        b = await run_batch(self.start_turn, FAN, turns, in_flight, tag("dbos"))
        return {
            "turns": turns,
            "in_flight": in_flight,
            "latencies_ms": [s * 1000 for s in b.latencies],
            "wall_s": b.wall,
            "steps_per_s": b.per_second(STEPS),
        }

    async def warm_up(self) -> None:
        await self.batch(WARM_TURNS, WARM_IN_FLIGHT)

    def stats(self) -> dict[str, Any]:
        """The package version and, from the SQLite file: its size (with its journal),
        its journal mode and sync level, step checkpoints per workflow."""
        size = sum(
            p.stat().st_size
            for p in self.db_path.parent.iterdir()
            if p.name.startswith(DB_FILE) and p.is_file()
        )
        con = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True)
        try:
            journal = con.execute("PRAGMA journal_mode").fetchone()[0]
            sync = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(
                con.execute("PRAGMA synchronous").fetchone()[0], "?"
            )
            workflows = con.execute(
                "SELECT COUNT(*) FROM workflow_status WHERE name = 'turn'"
            ).fetchone()[0]
            steps = con.execute(
                "SELECT COUNT(*) FROM operation_outputs o JOIN workflow_status w"
                " ON o.workflow_uuid = w.workflow_uuid WHERE w.name = 'turn'"
            ).fetchone()[0]
        finally:
            con.close()
        return {
            "dbos_version": metadata.version("dbos"),
            "sqlite_bytes": size,
            "journal_mode": str(journal),
            "synchronous": sync,
            "workflows": int(workflows),
            "checkpoints_per_turn": steps / workflows if workflows else float("nan"),
        }


def _protocol_out() -> IO[str]:
    """The real stdout, for the JSON lines; fd 1 is pointed at stderr, so that whatever
    else writes to stdout (logs, warnings) cannot garble them."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return out


def _say(out: IO[str], data: dict[str, Any]) -> None:
    out.write(json.dumps(data) + "\n")
    out.flush()


async def _one_shot(args: argparse.Namespace, out: IO[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="jetloop-peer-") as tmp:
        side = DbosSide(Path(tmp))
        side.launch()
        try:
            await side.warm_up()
            loads = {
                "sequential": await side.batch(args.turns, 1),
                f"{args.in_flight} in flight": await side.batch(args.concurrent, args.in_flight),
            }
            stats = side.stats()
        finally:
            side.destroy()
    report = {**stats, "steps_per_turn": STEPS, "warm_up_turns": WARM_TURNS, "loads": loads}
    if args.json:
        _say(out, report)
    else:
        for load, b in loads.items():
            lat = Latency.of([ms / 1000 for ms in b["latencies_ms"]])
            out.write(
                f"{load}: {b['turns']} turns, p50 {lat.p50_ms:.1f} ms, p99 {lat.p99_ms:.1f} ms,"
                f" {b['steps_per_s']:,.0f} steps/s\n"
            )
        out.write(f"dbos {stats['dbos_version']}, sqlite {stats['sqlite_bytes']:,} B\n")


async def _serve(out: IO[str]) -> None:
    """Launch and warm up, say ``ready``; then one reply per request line until EOF:
    ``{"turns": n, "in_flight": k}`` runs a batch, ``{"stats": true}`` reports."""
    with tempfile.TemporaryDirectory(prefix="jetloop-peer-") as tmp:
        side = DbosSide(Path(tmp))
        side.launch()
        try:
            await side.warm_up()
            _say(out, {"ready": True, "dbos_version": metadata.version("dbos")})
            while line := await asyncio.to_thread(sys.stdin.readline):
                try:
                    req = json.loads(line)
                    if req.get("stats"):
                        _say(out, side.stats())
                    else:
                        _say(out, await side.batch(int(req["turns"]), int(req["in_flight"])))
                except Exception as e:  # the parent hears of it and stops
                    _say(out, {"error": f"{type(e).__name__}: {e}"})
        finally:
            side.destroy()


def main(argv: list[str] | None = None) -> int:
    """``python -m jetloop.tooling.bench.peer``: the DBOS side, one shot or (``--serve``) driven
    by ``peer_side_by_side``."""
    p = argparse.ArgumentParser(prog="python -m jetloop.tooling.bench.peer", description=__doc__)
    p.add_argument("--turns", type=int, default=200, help="sequential turns")
    p.add_argument("--concurrent", type=int, default=500, help="turns of the concurrent load")
    p.add_argument("--in-flight", type=int, default=50, help="turns at once in that load")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--serve", action="store_true", help="batches on request (stdin/stdout)")
    args = p.parse_args(argv)
    out = _protocol_out()
    try:
        asyncio.run(_serve(out) if args.serve else _one_shot(args, out))
    except Exception as e:
        if args.serve:
            _say(out, {"error": f"{type(e).__name__}: {e}"})
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
