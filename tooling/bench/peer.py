"""A peer side by side: jetloop's 7-step turn against the same turn on DBOS Transact.

The turn is the one of ``tooling.bench.app``'s ``fan 5``: a model step that answers at once
asking for five calls, five no-op tool steps run in parallel, a model step that answers. On
DBOS Transact (the ``dbos`` package, an optional extra) it is an async workflow of async
steps with a SQLite system database, where every step's result is checkpointed before the
workflow goes on: the model steps are DBOS steps returning a canned answer (no I/O), the
five tool steps are DBOS steps started together in call order and awaited with
``asyncio.gather`` (DBOS numbers a step when the step function is called, not when it is
awaited, so the order of the calls fixes each step's id and a replay finds its checkpoint).

DBOS is a library: its workflows run in the process that starts them, it keeps global state
and threads of its own, so it runs in a subprocess of its own (``python -m
tooling.bench.peer``) on a SQLite file in a fresh temporary directory. A DBOS turn's latency
is from starting the workflow (``DBOS.start_workflow_async``, which returns once the workflow
is durably recorded) to its result (``handle.get_result()``), in that process; a jetloop
turn's is from publishing the turn request to its ``turn.completed`` event, as everywhere in
``tooling.bench.run``. Both sides are driven by ``bench_rig.run_batch``.

``peer_side_by_side`` runs both on the same loads (sequential, and many turns with
``in_flight`` at once), alternating jetloop and DBOS batches in ``chunks`` so that a change
in the machine's background load hits both, and reports latency and steps per second (7
steps per turn: 2 model, 5 tool) of each and their ratios. ``format_peer`` renders it.

Command line (one DBOS process, a warm-up, then both loads; prints one JSON object)::

    python -m tooling.bench.peer --turns 200 --concurrent 500 --in-flight 50 --json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from tooling.bench.rig import STEPS_OF, TURN_KINDS, Latency, Rig, run_batch, tag

FAN = TURN_KINDS["7-step"]
STEPS = STEPS_OF[FAN]  # 2 model steps + 5 tool steps
WARM_TURNS, WARM_IN_FLIGHT = 40, 10  # as engine_overhead warms the engine up
DB_FILE = "dbos.sqlite"
STREAM_LIMIT = 64 * 1024 * 1024  # one reply line holds every latency of a batch
READY_SECONDS = 120.0
BATCH_SECONDS = 600.0


# --- results -------------------------------------------------------------------------------


@dataclass
class PeerRow:
    """jetloop and DBOS on one load: latency, steps per second, and jetloop ÷ DBOS."""

    load: str
    turns: int
    in_flight: int
    jetloop: Latency
    dbos: Latency
    jetloop_steps_per_s: float
    dbos_steps_per_s: float
    ratio_p50: float  # jetloop p50 ÷ DBOS p50: below 1, jetloop's turns are faster
    ratio_p99: float
    ratio_steps_per_s: float  # jetloop ÷ DBOS: above 1, jetloop runs more steps per second


@dataclass
class PeerResult:
    """The rows, and what the DBOS side ran on."""

    rows: list[PeerRow]
    dbos_version: str
    sqlite_bytes: int  # the system database's files after every turn of the run
    sqlite_journal_mode: str  # DBOS's defaults, not tuned: what a user gets
    sqlite_synchronous: str
    dbos_checkpoints_per_turn: float  # step results recorded per workflow (expected: 7)
    chunks: int  # batches of each side per load, alternating
    steps_per_turn: int = STEPS


@dataclass
class DbosBatch:
    """What the DBOS process measured for one or more batches (latencies in ms)."""

    latencies_ms: list[float]
    wall_s: float

    def add(self, other: DbosBatch) -> None:
        self.latencies_ms.extend(other.latencies_ms)
        self.wall_s += other.wall_s

    @classmethod
    def of(cls, data: dict[str, Any]) -> DbosBatch:
        return cls([float(v) for v in data["latencies_ms"]], float(data["wall_s"]))


def peer_row(
    load: str, turns: int, in_flight: int, jl: list[float], jl_wall: float, db: DbosBatch
) -> PeerRow:
    """A row from jetloop's latencies (seconds) and walls and DBOS's batch."""
    j, d = Latency.of(jl), Latency.of([ms / 1000 for ms in db.latencies_ms])
    j_sps = len(jl) * STEPS / jl_wall
    d_sps = len(db.latencies_ms) * STEPS / db.wall_s
    return PeerRow(
        load=load,
        turns=turns,
        in_flight=in_flight,
        jetloop=j,
        dbos=d,
        jetloop_steps_per_s=j_sps,
        dbos_steps_per_s=d_sps,
        ratio_p50=j.p50_ms / d.p50_ms,
        ratio_p99=j.p99_ms / d.p99_ms,
        ratio_steps_per_s=j_sps / d_sps,
    )


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
            "tooling.bench.peer",
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


async def peer_side_by_side(
    r: Rig, sequential: int = 200, concurrent: int = 500, in_flight: int = 50, chunks: int = 4
) -> PeerResult:
    """The 7-step turn on jetloop (one worker) and on DBOS, sequential and ``in_flight`` at
    once, their batches alternating in ``chunks``; each side is warmed up first, and the
    jetloop side is quiet (every trailing step acked) before each batch of either."""
    await r.start_workers(1)
    peer = DbosPeer(r.base / "dbos.log")
    try:
        await run_batch(r.engine_turn, FAN, WARM_TURNS, WARM_IN_FLIGHT, tag("warm"))
        await peer.start()  # launches DBOS and warms it up the same way
        rows = []
        for load, total, width in (
            ("sequential", sequential, 1),
            (f"{in_flight} in flight", concurrent, in_flight),
        ):
            jl: list[float] = []
            jl_wall = 0.0
            db = DbosBatch([], 0.0)
            for _ in range(chunks):
                await r.quiet()
                b = await run_batch(r.engine_turn, FAN, total // chunks, width, tag("peer"))
                jl.extend(b.latencies)
                jl_wall += b.wall
                await r.quiet()
                db.add(await peer.batch(total // chunks, width))
            rows.append(peer_row(load, len(jl), width, jl, jl_wall, db))
        stats = await peer.ask({"stats": True})
    finally:
        await peer.stop()
        r.stop_workers()
    return PeerResult(
        rows=rows,
        dbos_version=str(stats["dbos_version"]),
        sqlite_bytes=int(stats["sqlite_bytes"]),
        sqlite_journal_mode=str(stats["journal_mode"]),
        sqlite_synchronous=str(stats["synchronous"]),
        dbos_checkpoints_per_turn=float(stats["checkpoints_per_turn"]),
        chunks=chunks,
    )


def format_peer(result: PeerResult) -> str:
    """The side by side as a Markdown table (as ``bench.format_report``'s tables)."""
    lines = [
        f"### Peer side by side: the 7-step turn, jetloop against DBOS Transact"
        f" {result.dbos_version} (SQLite system database)",
        "",
        "| load | jetloop p50 | jetloop p99 | DBOS p50 | DBOS p99 | ratio p50 | ratio p99 |"
        " jetloop steps/s | DBOS steps/s | ratio steps/s | turns |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in result.rows:
        lines.append(
            f"| {w.load} | {w.jetloop.p50_ms:.1f} | {w.jetloop.p99_ms:.1f} |"
            f" {w.dbos.p50_ms:.1f} | {w.dbos.p99_ms:.1f} | {w.ratio_p50:.2f}× |"
            f" {w.ratio_p99:.2f}× | {w.jetloop_steps_per_s:,.0f} | {w.dbos_steps_per_s:,.0f} |"
            f" {w.ratio_steps_per_s:.2f}× | {w.jetloop.n} |"
        )
    lines += [
        "",
        f"Latencies in ms; ratios are jetloop ÷ DBOS ({result.steps_per_turn} steps per turn;"
        f" each side's batches alternate in {result.chunks} chunks per load). A jetloop turn"
        " runs from a client's publish to its turn.completed event, through one worker; a"
        " DBOS turn from start_workflow_async to get_result in DBOS's own process. DBOS:"
        f" {result.dbos_checkpoints_per_turn:.1f} step checkpoints per turn, SQLite"
        f" journal_mode={result.sqlite_journal_mode}, synchronous={result.sqlite_synchronous}"
        f" (DBOS's defaults), {result.sqlite_bytes / 1e6:.1f} MB after the run.",
    ]
    return "\n".join(lines)


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
    """``python -m tooling.bench.peer``: the DBOS side, one shot or (``--serve``) driven
    by ``peer_side_by_side``."""
    p = argparse.ArgumentParser(prog="python -m tooling.bench.peer", description=__doc__)
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
