"""Crash-test a user's agent: its own app and tools, killed at every step boundary it reaches.

``crash_test`` (``jetloop trials --app``, ``jetloop.testing.crash_test``) runs real workers of
the user's app (``jetloop.tooling.crashtest.worker_app``: the tools watched, the model
scripted if asked) on a nats-server of its own with a store of its own, and:

1. **discovers** the step boundaries: the messages are sent once, in one session, with every
   point of ``POINTS`` planned to pass (``JETLOOP_FAULT_PLAN``), so the worker logs each time
   a step of that conversation reaches one (which point, the how-manieth, for which step);
2. kills **systematically**: one round per boundary (``--quick``: the first of each point for
   each tool and step kind), each a new session with the same messages; the one worker alive
   holds at that boundary (the ``n``-th arrival at the point in that session) and is then
   SIGKILLed, and a new worker takes over — or, in ``server_restart``, the server is
   SIGKILLed and restarted on its store while the worker holds, and the worker goes on.
   Rounds run in batches of ``BATCH`` sessions, all held at their boundaries before the one
   kill of the batch; the new worker is the next batch's, moved to its boundaries by the plan
   file;
3. kills **at random**: ``rounds`` more rounds, each killing the worker at a random moment
   within the time the discovery took;
4. **judges** (``jetloop.tooling.crashtest.judge``) from the tool ledger and the events.

Every worker serves all pools; nothing else serves the app while the test runs. Kills are
real (SIGKILL), as is the server. A call held for approval is approved, and a question
answered (``ANSWER``), by the test itself as soon as it is asked: what a crash does to the
wait and to the decision is the engine's, and tested in its own suite.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from nats.errors import Error as NatsError

from jetloop.agents.agent import App, load_app
from jetloop.schemas import EventType
from jetloop.schemas.errors import JetloopError
from jetloop.services.client import Client, TurnFailed
from jetloop.streams import topology
from jetloop.streams.connection import connect
from jetloop.streams.seal import Sealer, key_bytes
from jetloop.tooling.crashtest.judge import CrashReport, Round, TurnSeen, judge
from jetloop.tooling.crashtest.ledger import RUNNING, Ledger, call_key_of
from jetloop.tooling.crashtest.script import Message, ScriptError, read_script
from jetloop.tooling.crashtest.worker_app import SPEC
from jetloop.tooling.trials.harness import CommandWorker, WorkerProcess
from jetloop.tooling.trials.harness import work_dir as work_dir_of
from jetloop.tooling.trials.servers import SingleServer, worker_env

# The step boundaries a crash test kills at (docs/crash-matrix.md names them; ``tool.running``
# is the ledger's: the tool's invocation recorded, its function about to run).
POINTS = (
    "run_model.in_call",
    "run_model.after_commit",
    "call_tool.before_mark",
    "call_tool.in_tool",
    RUNNING,
    "call_tool.before_commit",
    "call_tool.after_commit",
    "join.before_publish",
    "join.after_publish",
)
log = structlog.get_logger("jetloop.crashtest")

MODES = ("worker_kill", "server_restart")
LEASE_SECONDS = 2.0
SEAL_KEY = "c7" * 32
TURN_SECONDS = 60.0  # how long one turn may take, kills included, before it counts as lost
HOLD_SECONDS = 30.0  # how long a round waits for its boundary before it says it was missed
WORKER_START_SECONDS = 60.0
# Boundaries held at once, one session each, and killed by one kill (``boundary_batch``);
# the workers' slots are raised above it so held steps never starve the others.
BATCH = 16
SLOTS = str(4 * BATCH)
ANSWER = "yes"  # what the test answers every question with
DECIDER = "crash-test"


@dataclass
class Boundary:
    """One place a step of the conversation reached: the ``nth`` arrival at ``point``."""

    point: str
    nth: int
    kind: str  # the step's kind
    tool: str | None  # the tool of a call's step

    @property
    def label(self) -> str:
        return f"{self.point} #{self.nth} ({self.tool or self.kind})"


@dataclass
class Run:
    """The processes and files of one crash test."""

    app_spec: str
    app: App
    messages: list[Message]
    base: Path
    server: SingleServer
    script: Path | None
    # A worker in another language for the app's tools of pools of their own (its command,
    # ``--tool-worker``), started, held and killed beside each Python worker.
    tool_command: list[str] | None = None
    worker: WorkerProcess | None = None
    tool_worker: WorkerProcess | None = None
    started: int = 0
    rounds: list[Round] = field(default_factory=list)

    @property
    def plan(self) -> Path:
        return self.base / "plan.json"

    @property
    def release(self) -> Path:
        return self.base / "release"

    @property
    def ledger(self) -> Ledger:
        return Ledger(self.base / "ledger.sqlite")

    def set_plan(self, holds: Sequence[str], passing: bool = False) -> None:
        # Written whole under another name, then moved in place: a worker never reads half.
        draft = self.plan.with_suffix(".draft")
        draft.write_text(json.dumps({"holds": list(holds), "pass": passing}))
        draft.replace(self.plan)

    def new_worker(self) -> WorkerProcess:
        self.started += 1
        env = {
            "JETLOOP_LEASE_SECONDS": str(LEASE_SECONDS),
            "JETLOOP_SEAL_KEY": SEAL_KEY,
            "JETLOOP_LOG_LEVEL": "info",
            "JETLOOP_DRAIN_SECONDS": "2",
            "JETLOOP_MODEL_CONCURRENCY": SLOTS,
            "JETLOOP_TOOL_CONCURRENCY": SLOTS,
            "JETLOOP_SESSION_CONCURRENCY": SLOTS,
            # The credentials of this run's own server (never those of a `jetloop up` store
            # in the working directory: the README's first look leaves one there) and its watch
            # user.
            **worker_env(self.server),
            "JETLOOP_CRASHTEST_APP": self.app_spec,
            "JETLOOP_CRASHTEST_LEDGER": str(self.ledger.path),
            "JETLOOP_FAULT_PLAN": str(self.plan),
            "JETLOOP_FAULT_RELEASE": str(self.release),
        }
        if self.script is not None:
            env["JETLOOP_CRASHTEST_SCRIPT"] = str(self.script)
        name = f"w{self.started}"
        self.worker = WorkerProcess(
            self.server.url, SPEC, self.base / f"{name}.log", worker_id=name, env=env
        ).start()
        if self.tool_command is not None:
            tools_env = {
                **env,
                "JETLOOP_NATS_URL": ",".join(self.server.urls_as("default")),
                "JETLOOP_CRASHTEST_INVOCATIONS": str(self.ledger.lines_path),
            }
            self.tool_worker = CommandWorker(
                self.tool_command, self.base / f"{name}t.log", worker_id=f"{name}t", env=tools_env
            ).start()
        return self.worker

    async def fresh_worker(self) -> WorkerProcess:
        w = self.new_worker()
        await self.started_all()
        return w

    async def started_all(self) -> None:
        """Until the current worker (and its tool worker) say they started."""
        for w in (self.worker, self.tool_worker):
            if w is not None:
                await w.wait_for("worker.started", timeout=WORKER_START_SECONDS)

    def holds(self, **match: Any) -> list[dict[str, Any]]:
        """The ``fault.hold`` lines of the current worker and its tool worker."""
        return [
            ln for w in (self.worker, self.tool_worker) if w for ln in w.find("fault.hold", **match)
        ]

    def kill(self) -> None:
        """SIGKILL to the current worker and its tool worker."""
        for w in (self.worker, self.tool_worker):
            if w is not None:
                w.kill()

    def agent_of(self, m: Message) -> str:
        if m.agent is not None:
            return m.agent
        names = list(self.app.agents)
        if len(names) != 1:
            raise ScriptError(
                f"the app has {len(names)} agents ({', '.join(names)}): give each message"
                ' its agent, as a JSON list of {"agent", "text"}'
            )
        return names[0]


async def decide(c: Client, session: str, done: asyncio.Event) -> None:
    """Approve every call held for approval, answer every question, as they come, until
    ``done``. (An event, not a cancel: a cancel that lands as a read inside ``wait_for``
    finishes can be lost on Python 3.11, and the loop would go on for ever.)"""
    while not done.is_set():
        try:
            snap = await c.snapshot(session)
            if snap is not None:
                for a in snap.approvals:
                    if a.status == "pending":
                        await c.approve(session, a.approval_id, by=DECIDER)
                for q in snap.questions:
                    if q.answer is None:
                        await c.answer(session, q.question_id, ANSWER, by=DECIDER)
        except (JetloopError, NatsError, TimeoutError) as exc:
            # Decided meanwhile, or the server is restarting: looked at again next time.
            log.warning("crashtest.decide_later", session=session, error=str(exc))
        try:
            await asyncio.wait_for(done.wait(), 0.2)
        except TimeoutError:
            pass


async def converse(c: Client, run: Run, session: str) -> list[TurnSeen]:
    """Send the messages in order to ``session``, each once the turn before it ended."""
    done = asyncio.Event()
    decider = asyncio.create_task(decide(c, session, done))
    try:
        return await _converse(c, run, session)
    finally:
        done.set()
        await decider


async def _converse(c: Client, run: Run, session: str) -> list[TurnSeen]:
    seen: list[TurnSeen] = []
    for m in run.messages:
        h = await c.send(run.agent_of(m), session, m.text)
        t = TurnSeen(session, h.turn_id, m.text)
        seen.append(t)
        try:
            res = await c.wait(h, timeout=TURN_SECONDS)
            t.status = res.status.value
        except TurnFailed as exc:
            t.status, t.error = exc.turn.status.value, exc.turn.error
        except TimeoutError:
            t.status = None
            return seen  # lost: the rest of the conversation would wait behind it
    return seen


async def discover(c: Client, run: Run) -> tuple[list[Boundary], list[TurnSeen], float]:
    """Every boundary one clean conversation reaches, in order, and how long it took."""
    session = "discover"
    run.set_plan([f"{p}@{session}" for p in POINTS], passing=True)
    w = run.worker
    assert w is not None
    began = time.monotonic()
    turns = await converse(c, run, session)
    took = time.monotonic() - began
    run.set_plan([])
    tool_of = {call_key_of(i): i.tool for i in await asyncio.to_thread(run.ledger.invocations)}
    found = [
        Boundary(
            str(ln["point"]),
            int(ln["nth"]),
            str(ln.get("kind", "")),
            tool_of.get(str(ln.get("call", ""))),
        )
        for ln in sorted(run.holds(session=session), key=lambda ln: str(ln.get("timestamp", "")))
        if "nth" in ln
    ]
    return found, turns, took


async def boundary_batch(
    c: Client, run: Run, batch: list[tuple[int, Boundary]], mode: str, rng: random.Random
) -> list[Round]:
    """One kill for a batch of boundaries: each in a session of its own, all held at once.

    Every session holds at its boundary (the ``nth`` arrival at its point in that session)
    while the others go on to theirs; once all hold, one kill strikes each exactly there.
    A kill costs a new worker's start and its first look around (a few seconds): paid once
    per batch, not once per boundary."""
    w = run.worker
    assert w is not None
    await asyncio.to_thread(run.release.unlink, missing_ok=True)
    rounds = {f"k{i}": Round(session=f"k{i}", mode=mode, boundary=b.label) for i, b in batch}
    run.set_plan([f"{b.point}@k{i}#{b.nth}" for i, b in batch])
    talks = {s: asyncio.create_task(converse(c, run, s)) for s in rounds}
    deadline = time.monotonic() + HOLD_SECONDS
    waiting = set(rounds)
    while waiting and time.monotonic() < deadline and w.alive():
        for ln in run.holds():
            if "planned" in ln:
                waiting.discard(str(ln.get("session")))
        await asyncio.sleep(0.05)
    for s in waiting:
        rounds[s].missed = True  # the conversation took another path this time
    if len(waiting) < len(rounds):
        killed_at = time.time()
        for r in rounds.values():
            if not r.missed:
                r.killed_at = killed_at
        if mode == "worker_kill":
            run.kill()
            run.set_plan([])
            run.new_worker()  # takes the held steps over; the next batch's worker
        else:
            await run.server.fail("server_restart", w, rng)
            await asyncio.to_thread(run.release.touch)  # the held worker goes on
    for s, talk in talks.items():
        rounds[s].turns = await talk
    run.set_plan([])
    if run.worker is not None and run.worker is not w:
        await run.started_all()
    return list(rounds.values())


async def random_round(
    c: Client, run: Run, i: int, within: float, rng: random.Random, mode: str = "worker_kill"
) -> Round:
    """A conversation struck at a random moment: its worker killed (and a new one started),
    or, in ``server_restart``, the server restarted under the worker that goes on."""
    session = f"r{i}"
    w = run.worker
    assert w is not None
    run.set_plan([])
    rnd = Round(session=session, mode=mode, boundary=None)
    talk = asyncio.create_task(converse(c, run, session))
    # The random moment is the point of the round, not a wait for a condition.
    await asyncio.sleep(rng.uniform(0.0, within))
    rnd.killed_at = time.time()
    if mode == "worker_kill":
        run.kill()
        await run.fresh_worker()
    else:
        await run.server.fail("server_restart", w, rng)
    rnd.turns = await talk
    return rnd


async def crash_test(
    app: str,
    messages: Sequence[Message],
    *,
    model_script: Path | None = None,
    mode: str = "worker_kill",
    rounds: int = 0,
    seed: int | None = None,
    quick: bool = False,
    vendor_dedupes: Sequence[str] = (),
    pure: Sequence[str] = (),
    work_dir: Path | None = None,
    json_out: Path | None = None,
    tool_worker: Sequence[str] | None = None,
) -> CrashReport:
    """Crash-test the app ``app`` (``module:attr``) on ``messages``; see the module doc.
    ``tool_worker``: the command of a worker in another language that makes the app's tools
    of pools of their own (given ``--id <name>`` and the run's environment, and killed with
    each Python worker); it keeps the crash test's ledger in ``JETLOOP_CRASHTEST_INVOCATIONS``
    and holds at the fault points its plan names (``JETLOOP_FAULT_PLAN``)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} for an app's crash test; modes: {MODES}")
    if rounds < 0:
        raise ValueError("rounds must be 0 or more")
    if model_script is not None:
        read_script(model_script)  # a bad script is named here, not in a worker's log
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    loaded = load_app(app)
    began = time.monotonic()
    async with work_dir_of(work_dir, "jetloop-crashtest-") as base:
        server = SingleServer(base)
        run = Run(app, loaded, list(messages), base, server, model_script)
        run.tool_command = list(tool_worker) if tool_worker else None
        for m in run.messages:
            run.agent_of(m)  # every message names an agent the app has, or it is said now
        await asyncio.to_thread(run.ledger.create)
        run.set_plan([])
        try:
            await server.start()
            nc = await connect([server.url], "jetloop-crashtest-topology")
            try:
                cfg = topology.TopologyConfig(replicas=1, lease_seconds=LEASE_SECONDS)
                await topology.apply(nc.jetstream(), cfg)
            finally:
                await nc.close()
            await run.fresh_worker()
            sealer = Sealer([key_bytes(SEAL_KEY)])
            # As the default namespace's workers of this run's server, whatever a store in
            # the working directory says.
            urls = server.urls_as("default")
            async with await Client.connect(urls, sealer=sealer) as c:
                found, clean, took = await discover(c, run)
                chosen = list(enumerate(_first_of_each(found) if quick else found))
                for at in range(0, len(chosen), BATCH):
                    batch = chosen[at : at + BATCH]
                    run.rounds += await boundary_batch(c, run, batch, mode, rng)
                for i in range(rounds):
                    run.rounds.append(await random_round(c, run, i, max(took, 0.2), rng, mode))
                events = await _events(c, [clean[0].session, *(r.session for r in run.rounds)])
            invocations = await asyncio.to_thread(run.ledger.invocations)
        finally:
            run.kill()
            server.close()
        report = judge(
            app=app,
            loaded=loaded,
            mode=mode,
            seed=seed,
            quick=quick,
            boundaries=[b.label for b in found],
            clean=clean,
            rounds=run.rounds,
            invocations=invocations,
            events=events,
            vendor_dedupes=set(vendor_dedupes),
            pure=set(pure),
            seconds=time.monotonic() - began,
            workers=run.started,
        )
    if json_out is not None:
        await asyncio.to_thread(
            json_out.write_text, json.dumps(report.to_json(), indent=2, default=str) + "\n"
        )
    return report


def _first_of_each(found: list[Boundary]) -> list[Boundary]:
    """``--quick``: the first arrival at each point, and at each tool's call points once."""
    seen: set[tuple[str, str]] = set()
    out = []
    for b in found:
        key = (b.point, b.tool or b.kind)
        if key not in seen:
            seen.add(key)
            out.append(b)
    return out


async def _events(c: Client, sessions: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The events the judge reads, per session: call outcomes and turn ends."""
    wanted = (EventType.CALL_OUTCOME.value, EventType.TURN_COMPLETED.value)
    out: list[tuple[str, dict[str, Any]]] = []
    for s in sessions:
        async for e in c.events(s, wanted, follow=False):
            out.append((e.type, {**e.data, "session": s, "turn": e.turn_id}))
    return out


def default_seed() -> int:
    return int(os.environ.get("JETLOOP_KILL_SEED", str(random.randrange(1 << 30))))
