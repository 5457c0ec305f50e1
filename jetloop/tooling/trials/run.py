"""Kill trials: real processes killed at random moments, judged from state.

One module on purpose: a round's driver, its judge and its report share the turn records
they build, and read as one story of a trial; what is measured beyond lost turns and
duplicates (detection, false takeovers, the targets) is read in ``jetloop.tooling.trials.measures``.

Each round starts a fresh *victim* worker beside a *survivor* that runs throughout (each serves
the three namespaces of ``jetloop.tooling.trials.servers.NAMESPACES``; the round's sessions are
spread over them, one client each), keeps a few sessions busy with turns that mix reads,
idempotent writes, single-attempt writes (with and without a reader), approvals (granted here),
timers and task polls, and at a random moment 0.2–4 s after the victim is up applies the mode's
failure:

- ``worker_kill``: SIGKILL the victim;
- ``server_restart``: SIGKILL nats-server and restart it on its store directory;
- ``kill_and_restart``: SIGKILL the victim and nats-server together and restart the server,
  with a *replacement* worker started just before the kill (as a supervisor would), so that
  it connects while the survivor may still be connecting again;
- ``takeover``: on a 3-node cluster (R3), SIGKILL the node leading ``JL_STEPS``; it is
  restarted on its store once a new leader is elected;
- ``mixed``: on the 3-node cluster, each round picks a worker kill, a node restart (a random
  node, restarted at once), a takeover, or a worker kill and a takeover together;
- ``deploy``: a rolling deploy of new agent code: two workers of the other app version (v1
  ``tests.apps:app``, v2 ``tests.apps:app_v2``: other instructions, the same tools) start,
  then the victim and the survivor are stopped with SIGTERM one after the other, each
  draining its steps; the first new worker is the survivor from then on. Nobody dies, so any
  loss recorded is a false takeover (a drain must hand its steps on, losing none);
- ``upgrade``: a rolling upgrade of jetloop itself, the same as ``deploy`` but with the app
  kept and the release changed: each round's victim and survivor run the previous release
  (``jetloop.tooling.releases.PREVIOUS``, built from its commit), and the two workers that
  replace them run this one. Between rounds, with nothing in flight, the survivor is put back
  on the previous release. The previous release serves the default namespace only, so every
  session of this mode is there;
- ``power_loss``: the machine loses power (``jetloop.tooling.trials.power``): nats-server and
  every worker SIGKILLed at once, what the store had not synced to disk discarded, the server
  restarted on what is left and new workers started. The harness, a client elsewhere, sends
  again every turn it had no answer for (the same request id, as the docs allow), and at the
  end reads back every turn it saw completed: one that is gone was lost;
- ``cluster_power_loss``: on the 3-node cluster, each node on such a disk, each round either
  cuts all three nodes and every worker at once, or crashes one node's OS (killed, its
  unsynced data discarded, restarted) while another node is paused;
- ``cluster_faults``: on the 3-node cluster with each node in a network namespace of its own,
  each round strikes one network fault between the nodes (a partition of the leader or of a
  follower, one-way loss, delay with loss, a flapping link, the leader paused) for a few
  seconds and heals it (``jetloop.tooling.trials.faults``);
- ``control``: nothing fails. Its "completion" is what the turns in flight at a random
  moment take anyway (their timers, approvals, polls, model rounds): the part of every other
  mode's completion that no failure caused.

Every turn is judged from state (``Client.turn``, call records, the events stream) and from
the vendor's SQLite log, never from worker logs. Per failure the report gives:

- *lost* turns: a turn that does not end within the deadline or ends failed or cancelled
  (``outcome_unknown`` for a single-attempt write in doubt is a legitimate end);
- *duplicates*: a vendor write applied twice for one idempotency key, or a single-attempt
  write requested twice with one key;
- *reverted decisions*: an approval the harness granted that was asked for again (a power
  cut took the decision back);
- *detection*: from the kill until the engine noticed. After a worker kill, until another
  worker resumed a step the dead one held (its ``agent.run.crash_resumed`` event); rounds in
  which the victim held no step have none and are counted "n/a". When no worker died (a
  server restart, a takeover, a node restart), until the first event of a turn in flight
  made after the kill was stored: the engine moving again;
- *completion*: from the kill to the end of every turn that was in flight when it came;
- *false takeovers*: losses a turn recorded (or resumes) of a worker that was alive: the
  survivor at any time, the victim when the round did not kill it or before it was killed;
- the *restart time* of a server (kill until it accepts connections again) and the
  *election time* of a takeover (kill until every stream and consumer the killed node
  led, ``JL_STEPS`` among them, has a new leader).

``load`` busy processes (``jetloop.tooling.trials.load``) spin beside the workers for the
whole run: a machine with other work on it, where a live worker is slow but not dead.

Targets: no lost turn, no duplicate, no false takeover whatever failed; worker kill
detection p99 ≤ 1 s (≤ 2 s with load); a worker killed with the server: detection p99 ≤ the
p99 restart time + the lease + that slack; server restart completion p99 ≤ the p99 restart
time + 1 s; takeover completion p99 ≤ the p99 election time + 1 s. p50/p99 are nearest
rank over every value measured (rounds for detection, turns in flight for completion).

Every server knows the system account and its ``watch`` user (``jetloop.tooling.trials.servers``),
and every worker is given the password (``JETLOOP_NATS_WATCH_PASSWORD``), so a worker that
watches for closed connections can hand a dead worker's steps on before its lease lapses.
``system_account=False`` (``--no-system-account``) measures a user's own or a managed NATS
instead: no watch user on the servers and no password for the workers, who then find a dead
worker's steps by the slower paths; the report says so in its header, and the targets stay
what they are (what the slower paths must meet).

This module only wires processes together (docs/design.md, convention 1): the engine is driven
through the public client, the harness (``WorkerProcess``; ``EmbeddedServer`` and ``LocalCluster``
through ``jetloop.tooling.trials.servers``) and the test app ``tests.apps:app`` the workers load.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nats.errors import Error as NatsError

from jetloop.schemas import (
    CallState,
    DecodeError,
    TurnPhase,
    call_key,
    idempotency_key,
)
from jetloop.schemas.errors import ControlError
from jetloop.schemas.log import events_in
from jetloop.services import durability
from jetloop.services.client import Client, TurnHandle
from jetloop.services.embedded import server_binary
from jetloop.services.logs import configure
from jetloop.streams import topology
from jetloop.streams.connection import connect
from jetloop.streams.seal import Sealer, key_bytes
from jetloop.tooling.releases import BuiltRelease, build
from jetloop.tooling.trials import MODES
from jetloop.tooling.trials.faults import NETWORK_FAULTS, FaultCluster
from jetloop.tooling.trials.harness import WorkerProcess
from jetloop.tooling.trials.harness import work_dir as work_dir_of
from jetloop.tooling.trials.load import busy
from jetloop.tooling.trials.measures import (
    VICTIM_KILLED,
    Target,
    abandoned_resumes,
    drained_resumes,
    engine_detection,
    false_takeovers,
    read_events,
    targets,
    worker_detection,
)
from jetloop.tooling.trials.power import (
    CLUSTER_POWER_FAILURES,
    KILLS_WORKERS,
    PowerCluster,
    PowerCutUnavailable,
    PowerServer,
)
from jetloop.tooling.trials.servers import (
    NAMESPACES,
    Cluster,
    Kill,
    Servers,
    SingleServer,
    worker_env,
)

MIXED_FAILURES = ("worker_kill", "node_restart", "takeover", "worker_kill+takeover")
POWER_MODES = ("power_loss", "cluster_power_loss")
# A call's grant: the decision's time, and when the harness last granted it.
Approvals = dict[str, tuple[float | None, float]]
REGRANT_SECONDS = 1.0
# The rounds of the lazy-sync control run beside a power mode's (``main``).
CONTROL_ROUNDS = 3

APP = "tests.apps:app"
# What a deploy round replaces the workers with, and back (``deploy``).
APP_V2 = "tests.apps:app_v2"
AGENT = "tester"
LEASE_SECONDS = 2.0
# Any key will do: the harness (approvals through the client) and the workers share it.
SEAL_KEY = "5e" * 32
KILL_WINDOW = (0.2, 4.0)
SESSIONS_PER_ROUND = 4
# How often the harness reads a turn record: the resolution of a completion measured
# without its end event.
POLL_SECONDS = 0.05
# From the kill, how long a turn in flight may take to end before it counts as lost.
DEADLINES = {
    "control": 40.0,
    "worker_kill": 40.0,
    "server_restart": 60.0,
    "worker_kill+server_restart": 60.0,
    "node_restart": 60.0,
    "takeover": 90.0,
    "worker_kill+takeover": 90.0,
    "worker_drain": 60.0,
    "power_cut": 90.0,
    "cluster_power_cut": 120.0,
    "node_crash+pause": 120.0,
    "node_crash+partition": 120.0,
    **dict.fromkeys(NETWORK_FAULTS, 90.0),
}
# How long a drained worker may take to exit before the round says so (its drain is 5 s).
DRAIN_EXIT_SECONDS = 30.0
# Vendor operations that change something; reads, notes and polls may repeat by design.
WRITE_OPS = ("write", "slow", "guarded", "once", "once_read", "task_start")
SINGLE_ATTEMPT_OPS = ("once", "once_read")
# ``slow`` (an idempotent write that takes 0.3 s) widens the window a kill can land in.
TOOLS = ("read", "write", "slow", "once", "once_read", "guarded", "wait", "export")
WORKER_START_SECONDS = 60.0


# --- the report ---------------------------------------------------------------------------


@dataclass
class TurnTrial:
    """One turn of a round, as the harness saw it (times are seconds from the round start)."""

    session_id: str
    turn_id: str
    request_id: str
    tools: list[list[str]]
    sent_at: float
    ended_at: float | None = None
    status: str | None = None
    error: str | None = None
    calls: dict[str, int] = field(default_factory=dict)
    in_flight: bool = False
    completion: float | None = None  # seconds from the kill to its end, if in flight
    lost: list[str] = field(default_factory=list)  # the record's losses: worker/incarnation
    resent: bool = False  # sent again after a power cut (no answer heard)
    vanished: str | None = None  # seen completed, then gone or changed after a power cut
    reverted: list[str] = field(default_factory=list)  # approvals granted, then asked again


@dataclass
class RoundTrial:
    """One round: its failure, when it came, and the turns it caught."""

    round: int
    failure: str
    kill_after: float
    kill_at: float
    victim: str
    replacement: str | None = None  # the worker started in the victim's place, if any
    kill_wall: float = math.inf  # time.time() of the kill, the clock events carry
    election: float | None = None  # the kill until all the killed node led has new leaders
    steps_election: float | None = None  # the kill until JL_STEPS alone has a new leader
    # Groups the struck node led that had no new leader when the harness stopped waiting:
    # the round's election is then not timed.
    leaderless: list[str] = field(default_factory=list)
    restart: float | None = None  # seconds from the kill until the server accepted clients
    detection: float | None = None  # seconds from the kill until the engine noticed
    false_takeovers: list[str] = field(default_factory=list)
    drained_resumes: int = 0  # steps taken over from a worker whose drain ran out
    # Steps resumed after their live holder's delivery ended unfinished (not a loss).
    abandoned_resumes: int = 0
    survivor: str | None = None  # the worker started after a power cut took every worker
    # Workers on a node the failure paused: cut off past their lease, taken for dead by
    # design; their steps taken over are not counted false (docs/design.md).
    cut_off: list[str] = field(default_factory=list)
    turns: list[TurnTrial] = field(default_factory=list)

    @property
    def lost_turns(self) -> list[TurnTrial]:
        """Turns that did not complete, or completed and were gone after a power cut."""
        return [t for t in self.turns if t.status != "completed" or t.vanished is not None]

    @property
    def in_flight(self) -> list[TurnTrial]:
        return [t for t in self.turns if t.in_flight]


@dataclass
class Duplicate:
    """A write the vendor applied (or a single-attempt write it received) twice for a key."""

    op: str
    idempotency_key: str
    applied: int
    call: str | None


@dataclass
class Report:
    """The verdict of a run of trials; ``ok`` when every target is met."""

    mode: str
    rounds: int
    seed: int
    lease_seconds: float
    load: int  # busy processes beside the workers (jetloop.tooling.trials.load)
    turns: int
    in_flight: int
    lost: list[str]
    duplicates: list[Duplicate]
    stray_keys: list[str]
    call_states: dict[str, int]
    # Over every round of the run, whatever its failure (``by_failure`` splits them).
    detection_p50: float | None
    detection_p99: float | None
    detection_max: float | None
    detection_na: int  # rounds without a detection value (the victim held no step)
    completion_p50: float | None
    completion_p99: float | None
    completion_max: float | None
    false_takeovers: list[str]
    by_failure: dict[str, dict[str, Any]]
    targets: list[Target]
    wall_seconds: float
    machine: dict[str, str]
    trials: list[RoundTrial]
    # ``upgrade``: the release the old workers ran (``<version> (<commit>)``).
    upgraded_from: str | None = None
    # When the servers synced what they acknowledged (jetloop.services.durability).
    sync: str = durability.ALWAYS
    reverted: list[str] = field(default_factory=list)  # decided approvals asked again
    # A lazy-sync run beside a power mode's, to show the harness can fail: its verdict is
    # that it did fail (``bites``).
    control: bool = False
    # Whether the servers had the system account's watch user and the workers its password
    # (off: ``--no-system-account``, workers hear no connection close).
    system_account: bool = True

    @property
    def targets_ok(self) -> bool:
        return all(t.met for t in self.targets)

    @property
    def harmed(self) -> bool:
        """Something a durable engine must never do happened: a lost turn, a write made
        twice, a decision reverted."""
        return bool(self.lost or self.duplicates or self.reverted)

    @property
    def ok(self) -> bool:
        if self.control:
            return self.harmed  # the control must show the harm the default prevents
        return not self.harmed and self.targets_ok

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["targets_ok"] = self.targets_ok
        return data


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (``p`` in 0–100): an observed value, never interpolated."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    try:
        version = subprocess.run(
            [server_binary(), "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        version = "?"
    return {
        "cpus": str(os.cpu_count()),
        "python": platform.python_version(),
        "nats_server": version,
        "platform": platform.platform(),
        "load_1m": f"{os.getloadavg()[0]:.2f}",
    }


# --- the workload --------------------------------------------------------------------------


def _call(tool: str, name: str) -> dict[str, Any]:
    if tool == "wait":
        return {"tool": tool, "args": {"seconds": 1}}
    if tool == "export":
        return {"tool": tool, "args": {"name": name, "polls": 2}}
    if tool == "slow":
        return {"tool": tool, "args": {"name": name, "seconds": 0.3}}
    return {"tool": tool, "args": {"name": name}}


def plan_turn(rng: random.Random, tag: str, covering: bool = False) -> list[list[dict[str, Any]]]:
    """The steps of one turn for the test model: 1–2 model steps of 1–3 parallel calls.

    ``covering`` gives the turn that has every kind once (the first turn of each round), so
    every round exercises every step kind whatever the seed.
    """
    if covering:
        groups = [["write", "once", "once_read", "read"], ["guarded", "wait", "export", "slow"]]
    else:
        groups = [
            [rng.choice(TOOLS) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 2))
        ]
    return [
        [_call(tool, f"{tag}-{k}-{i}") for i, tool in enumerate(group)]
        for k, group in enumerate(groups)
    ]


def script_text(steps: list[list[dict[str, Any]]]) -> str:
    """The user text that makes ``tests.apps``' scripted model run these steps."""
    return json.dumps({"steps": steps, "answer": "done"})


# --- a run ---------------------------------------------------------------------------------


class Trials:
    """One run: the servers, the survivor, a client; ``round()`` runs one round."""

    def __init__(
        self,
        mode: str,
        servers: Servers,
        base: Path,
        rng: random.Random,
        seed: int,
        control: bool = False,
    ) -> None:
        self.mode = mode
        self.control = control
        self.servers = servers
        self.base = base
        self.rng = rng
        self.seed = seed
        self.vendor_db = base / "vendor.sqlite"
        # One client per namespace; each session runs in one of them (``_client``).
        self.clients: dict[str, Client] = {}
        self.namespace_of: dict[str, str] = {}
        self.survivor: WorkerProcess | None = None
        self.victims: list[WorkerProcess] = []
        # Every call the harness planned, by its idempotency key: to name a duplicate.
        self.calls_by_key: dict[str, str] = {}
        # The app version the workers run now (a deploy round switches it), and every worker
        # started: none dies in a deploy, so a loss of any of them is a false takeover.
        self.app = APP
        self.started: set[str] = set()
        # ``upgrade``: the release the old workers run (None: every worker runs this one),
        # and the one the survivor runs now.
        self.previous: BuiltRelease | None = None
        self.survivor_release: BuiltRelease | None = None
        # Each turn's user text by request id: what a client sends again after a power cut.
        self.texts: dict[str, str] = {}

    def _worker(
        self, name: str, app: str | None = None, release: BuiltRelease | None = None
    ) -> WorkerProcess:
        env = {
            "JETLOOP_LEASE_SECONDS": str(LEASE_SECONDS),
            "JETLOOP_VENDOR_DB": str(self.vendor_db),
            "JETLOOP_SEAL_KEY": SEAL_KEY,
            "JETLOOP_REPLICAS": str(self.servers.replicas),
            "JETLOOP_DRAIN_SECONDS": "5",
            "JETLOOP_LOG_LEVEL": "info",
            # The credentials of every namespace (each worker serves them all) and the
            # system account's watch user, unless the run is without it.
            **worker_env(self.servers),
        }
        self.started.add(name)
        return WorkerProcess(
            self.servers.url,
            app or self.app,
            self.base / f"{name}.log",
            worker_id=name,
            env=env,
            # A release without namespaces serves the default one, all it knows.
            namespaces="all" if release is None else None,
            release=release,
        ).start()

    def _client(self, session_id: str) -> Client:
        return self.clients[self.namespace_of[session_id]]

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Trials]:
        """Topology, survivor and clients up; everything stopped and closed on the way out."""
        cfg = topology.TopologyConfig(replicas=self.servers.replicas, lease_seconds=LEASE_SECONDS)
        for ns in NAMESPACES:
            urls = self.servers.urls_as(ns)
            nc = await connect(urls, "jetloop-trials-topology")
            try:
                await topology.apply(nc.jetstream(), cfg, set_replicas=True)
            finally:
                await nc.close()
        if self.mode == "upgrade":
            self.previous = await asyncio.to_thread(build, self.base / "releases")
        self.survivor_release = self.previous
        self.survivor = self._worker("survivor", release=self.previous)
        try:
            await self.survivor.wait_for("worker.started", timeout=WORKER_START_SECONDS)
            sealer = Sealer([key_bytes(SEAL_KEY)])
            try:
                for ns in NAMESPACES:
                    self.clients[ns] = await Client.connect(self.servers.urls_as(ns), sealer=sealer)
                yield self
            finally:
                for c in self.clients.values():
                    await c.close()
        finally:
            for v in self.victims:
                v.kill()
            self.survivor.kill()

    def failure_of(self, r: int) -> str:
        if self.mode == "mixed":
            return self.rng.choice(MIXED_FAILURES)
        if self.mode == "kill_and_restart":
            return "worker_kill+server_restart"
        if self.mode in ("deploy", "upgrade"):
            return "worker_drain"
        if self.mode == "power_loss":
            return "power_cut"
        if self.mode == "cluster_faults":
            # In turn, so that a run of N rounds gives every fault N / len(faults) of them.
            assert isinstance(self.servers, FaultCluster)
            return self.servers.faults[r % len(self.servers.faults)]
        if self.mode == "cluster_power_loss":
            assert isinstance(self.servers, PowerCluster)
            # In turn, as cluster_faults; the control cuts all three: one node's crash beside
            # a cut-off one leaves the third node whole, from which the cluster recovers even
            # on the lazy default.
            failures = self.servers.failures
            return failures[0] if self.control else failures[r % len(failures)]
        return self.mode

    async def round(self, r: int) -> RoundTrial:
        """Start a victim, keep sessions busy, fail at a random moment, judge every turn."""
        failure = self.failure_of(r)
        kill_after = self.rng.uniform(*KILL_WINDOW)
        plans = [
            [plan_turn(self.rng, f"r{r}s{s}t{k}", covering=(s == 0 and k == 0)) for k in range(64)]
            for s in range(SESSIONS_PER_ROUND)
        ]
        if self.survivor_release is not self.previous:
            await self._survivor_back(r)
        victim = self._worker(f"victim{r}", release=self.previous)
        self.victims.append(victim)
        await victim.wait_for("worker.started", timeout=WORKER_START_SECONDS)
        start = time.monotonic()
        trial = RoundTrial(
            round=r,
            failure=failure,
            kill_after=kill_after,
            kill_at=math.inf,
            victim=victim.worker_id,
        )
        stop_sending = asyncio.Event()
        replacement: WorkerProcess | None = None
        deadline: list[float] = []  # set at the kill: [monotonic deadline]
        sids = [f"{self.mode[:2]}{r}s{s}" for s in range(SESSIONS_PER_ROUND)]
        for s, sid in enumerate(sids):
            spread = NAMESPACES if self.previous is None else ("default",)
            self.namespace_of[sid] = spread[s % len(spread)]

        async with asyncio.TaskGroup() as tg:
            for s, sid in enumerate(sids):
                tg.create_task(
                    self._session(sid, plans[s], start, stop_sending, deadline, trial.turns)
                )
            # The random kill moment is the point of the trial, not a wait for a condition.
            await asyncio.sleep(kill_after)
            if failure != "worker_drain":  # a deploy keeps them coming until its SIGTERMs
                stop_sending.set()
            if failure == "worker_kill+server_restart":
                # As a supervisor would: a new worker in the dead one's place. Started just
                # before the kill, it connects while the restarted server is new and the
                # survivor may still be connecting again: a worker that looks around at
                # start must not take the survivor for dead.
                replacement = self._worker(f"replacement{r}")
                self.victims.append(replacement)  # killed on the way out, whatever happens
                trial.replacement = replacement.worker_id
            if failure == "worker_drain":
                kill, replacement = await self._deploy(r, victim, trial, stop_sending)
            elif failure in KILLS_WORKERS:
                kill = await self._power_cut(r, failure, victim, trial)
            else:
                kill = await self.servers.fail(failure, victim, self.rng)
            if failure in (*KILLS_WORKERS, *CLUSTER_POWER_FAILURES):
                await self._send_again(trial)
            trial.kill_at = kill.at - start
            trial.kill_wall = kill.wall
            trial.restart = kill.restart
            trial.cut_off = sorted(kill.cut_off)
            deadline.append(kill.at + DEADLINES[failure])
        elected = await self.servers.heal()
        if elected is not None:
            trial.steps_election = elected.steps
            trial.leaderless = list(elected.leaderless)
            if not elected.leaderless:
                trial.election = elected.every_group
        victim.kill()
        if replacement is not None:
            replacement.kill()
        for t in trial.turns:
            t.in_flight = t.sent_at < trial.kill_at and (
                t.ended_at is None or t.ended_at > trial.kill_at
            )
            if t.in_flight and t.ended_at is not None:
                t.completion = t.ended_at - trial.kill_at
        await self._judge_from_events(trial, sids)
        return trial

    async def _power_cut(
        self, r: int, failure: str, victim: WorkerProcess, trial: RoundTrial
    ) -> Kill:
        """Every worker dies with the servers (SIGKILL, all at once), the servers' disks lose
        what they had not synced and restart; then new workers start, as a machine that
        boots again starts its services. The new survivor serves the rounds after."""
        assert self.survivor is not None
        for w in (self.survivor, *self.victims):
            w.signal(signal.SIGKILL)
        kill = await self.servers.fail(failure, victim, self.rng)
        for w in (self.survivor, *self.victims):
            w.kill()  # reaped
        self.victims.append(self.survivor)  # killed again on the way out: harmless
        self.survivor = self._worker(f"survivor{r}")
        trial.survivor = self.survivor.worker_id
        await self.survivor.wait_for("worker.started", timeout=WORKER_START_SECONDS)
        return kill

    async def _send_again(self, trial: RoundTrial) -> None:
        """As a client that heard no answer: send every turn in flight again, with its
        request id (the docs call that harmless: it must never run a turn twice)."""
        for t in trial.turns:
            if t.ended_at is not None:
                continue
            handle = await self._send(t.session_id, t.request_id, [time.monotonic() + 30.0])
            t.resent = True
            if handle.turn_id != t.turn_id:
                t.error = f"sent again as another turn {handle.turn_id}"

    async def _send(self, sid: str, rid: str, deadline: Sequence[float]) -> TurnHandle:
        """Send the turn of request ``rid`` (its text from ``texts``); one that meets a failure
        is sent again with the same request id, as a client that heard nothing does, until it
        is heard or ``deadline[0]`` (monotonic) passes. ``deadline`` is set once a failure
        struck (a round's list, filled at the kill): empty, an error is the harness's own."""
        while True:
            try:
                return await self._client(sid).send(
                    AGENT, sid, self.texts[rid], request_id=rid, will_wait=False
                )
            except (NatsError, TimeoutError, OSError):
                if not deadline or time.monotonic() > deadline[0]:
                    raise
                await asyncio.sleep(0.2)  # the servers are coming back: try again

    async def read_back(self, rounds: Sequence[RoundTrial]) -> None:
        """After power cuts: every turn seen completed must still be completed, with the
        same answer state; one that is gone or changed was lost."""
        for rnd in rounds:
            for t in rnd.turns:
                if t.status != "completed":
                    continue
                client = self._client(t.session_id)
                turn = None
                for _ in range(5):
                    try:
                        turn = await asyncio.wait_for(client.turn(t.session_id, t.turn_id), 5.0)
                        break
                    except (NatsError, TimeoutError, OSError):
                        await asyncio.sleep(0.5)  # a busy server after a restart
                if turn is None:
                    t.vanished = "gone after a power cut"
                elif turn.status.value != "completed":
                    t.vanished = f"{turn.status.value} after a power cut"

    async def _deploy(
        self, r: int, victim: WorkerProcess, trial: RoundTrial, stop_sending: asyncio.Event
    ) -> tuple[Kill, WorkerProcess]:
        """A rolling deploy: workers of the other app version first, then every old worker
        stopped with SIGTERM, one after the other, each let drain and exit. Turns keep
        coming until the first SIGTERM."""
        assert self.survivor is not None
        if self.mode == "deploy":
            self.app = APP_V2 if self.app == APP else APP
        new = [self._worker(f"deploy{r}a"), self._worker(f"deploy{r}b")]
        for w in new:
            await w.wait_for("worker.started", timeout=WORKER_START_SECONDS)
        stop_sending.set()
        kill = Kill.now()
        for old in (victim, self.survivor):
            old.signal(signal.SIGTERM)
            assert old.proc is not None
            try:
                await asyncio.to_thread(old.proc.wait, DRAIN_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                trial.false_takeovers.append(f"{old.worker_id} did not exit after its drain")
                old.kill()
        self.victims.append(self.survivor)  # gone; listed to be sure it is
        self.survivor, self.survivor_release = new[0], None
        self.victims.append(new[1])  # killed on the way out, as the victims are
        trial.replacement = new[1].worker_id
        return kill, new[1]

    async def _survivor_back(self, r: int) -> None:
        """``upgrade``, between rounds (nothing in flight): a survivor of the previous
        release in place of the current release's, which is stopped with SIGTERM."""
        assert self.survivor is not None
        old = self._worker(f"survivor{r}", release=self.previous)
        await old.wait_for("worker.started", timeout=WORKER_START_SECONDS)
        self.survivor.signal(signal.SIGTERM)
        self.victims.append(self.survivor)  # killed on the way out if it has not exited
        self.survivor, self.survivor_release = old, self.previous

    async def _judge_from_events(self, trial: RoundTrial, sids: list[str]) -> None:
        """Detection and false takeovers, from the round's events and turn records."""
        assert self.survivor is not None
        events = [
            e
            for ns, c in self.clients.items()
            for e in await read_events(c.js, [s for s in sids if self.namespace_of[s] == ns])
        ]
        power = trial.failure in KILLS_WORKERS
        killed = trial.victim if trial.failure in VICTIM_KILLED or power else None
        if killed is not None and not power:
            trial.detection = worker_detection(events, killed, trial.kill_wall)
        else:
            in_flight = {t.turn_id for t in trial.in_flight}
            trial.detection = engine_detection(events, in_flight, trial.kill_wall)
        alive = {self.survivor.worker_id} | ({trial.victim} if killed is None else set())
        if power:  # every worker died: the one started after is the only one alive since
            alive = {self.survivor.worker_id}
        alive -= set(trial.cut_off)
        if trial.replacement is not None:
            alive.add(trial.replacement)
        if trial.failure == "worker_drain":
            alive |= self.started  # a deploy kills nobody
        losses = {t.turn_id: t.lost for t in trial.turns}
        trial.drained_resumes = drained_resumes(events)
        trial.abandoned_resumes = abandoned_resumes(events)
        trial.false_takeovers += false_takeovers(losses, events, alive, killed, trial.kill_wall)

    async def _session(
        self,
        sid: str,
        plans: list[list[list[dict[str, Any]]]],
        start: float,
        stop_sending: asyncio.Event,
        deadline: list[float],
        out: list[TurnTrial],
    ) -> None:
        """Send turns one after the other until the kill; follow each to its end."""
        for k, steps in enumerate(plans):
            if stop_sending.is_set():
                return
            rid = f"{sid}-{k}"
            self.texts[rid] = script_text(steps)
            sent = time.monotonic() - start
            # Followed by reading its record (``_follow``), not ``Client.wait``.
            handle = await self._send(sid, rid, deadline)
            for n, group in enumerate(steps):
                for i, c in enumerate(group):
                    key = idempotency_key(sid, handle.turn_id, n, i, self.namespace_of[sid])
                    self.calls_by_key[key] = f"{call_key(sid, handle.turn_id, n, i)} {c['tool']}"
            t = TurnTrial(
                session_id=sid,
                turn_id=handle.turn_id,
                request_id=rid,
                tools=[[c["tool"] for c in group] for group in steps],
                sent_at=sent,
            )
            out.append(t)
            await self._follow(t, steps, start, deadline)
            if t.status != "completed":
                return  # a lost turn: the session's next turn would only queue behind it

    async def _follow(
        self,
        t: TurnTrial,
        steps: list[list[dict[str, Any]]],
        start: float,
        deadline: list[float],
    ) -> None:
        """Poll the turn record until it ends (approving held calls on the way) or the
        deadline after the kill passes."""
        client = self._client(t.session_id)
        approved: Approvals = {}
        while True:
            if deadline and time.monotonic() > deadline[0]:
                t.error = "did not end within the deadline after the kill"
                return
            try:
                # A read sent just before a server died waits out its own timeout; a short
                # one here sends a fresh read instead.
                turn = await asyncio.wait_for(client.turn(t.session_id, t.turn_id), 1.0)
                if turn is not None:
                    t.lost = list(turn.lost)
                if turn is not None and turn.status.terminal:
                    t.ended_at = await self._end_time(t, turn.status.value, start)
                    t.status = turn.status.value
                    t.error = turn.error
                    await self._settled_calls(t, steps)
                    return
                if turn is not None and turn.phase == TurnPhase.CALLS:
                    await asyncio.wait_for(self._approve(t, turn.model_step, steps, approved), 2.0)
            except (NatsError, TimeoutError, OSError, ControlError):
                # An outage (or a decision that met a cluster still settling): the client
                # rides it out; look again.
                pass
            await asyncio.sleep(POLL_SECONDS)

    async def _end_time(self, t: TurnTrial, status: str, start: float) -> float:
        """When the turn ended: the time on its end event (written by a worker on this
        machine) if it can be read, else when the harness saw the end. The harness can see
        it late (a read that rode out a restart); the event says when the state changed."""
        client = self._client(t.session_id)
        seen = time.monotonic() - start
        end = f"turn.{status}"
        # (In the folded log ``turn.completed`` rides in the last answer: jetloop.schemas.log.)
        subjects = [topology.event_subject(t.session_id, end)]
        if status == "completed":
            subjects.append(topology.history_subject(t.session_id, "assistant"))
        event = None
        for subject in subjects:
            try:
                raw = await asyncio.wait_for(
                    client.js.get_msg(topology.EVENTS_STREAM, subject=subject), 5.0
                )
                told = events_in(raw.subject or subject, raw.data or b"")
            except (NatsError, TimeoutError, DecodeError):
                continue
            event = next((e for e in told if e.type.value == end), None)
            if event is not None:
                break
        if event is None or event.turn_id != t.turn_id:
            return seen
        wall_to_monotonic = time.monotonic() - time.time()
        return min(seen, event.at + wall_to_monotonic - start)

    async def _approve(
        self, t: TurnTrial, n: int, steps: list[list[dict[str, Any]]], approved: Approvals
    ) -> None:
        """Grant every held call of the step, as a person watching the session would.

        A call still held after its grant is granted again (at most every ``REGRANT_SECONDS``:
        the worker may simply not have moved it on yet). The first decision wins, so the
        repeat returns the decision already taken; one with another time means the first
        was taken back (a power cut), and the person was asked twice: ``t.reverted``."""
        client = self._client(t.session_id)
        if n >= len(steps):
            return
        for i, c in enumerate(steps[n]):
            ckey = call_key(t.session_id, t.turn_id, n, i)
            if c["tool"] != "guarded":
                continue
            first = approved.get(ckey)
            if first is not None and time.monotonic() - first[1] < REGRANT_SECONDS:
                continue
            rec = await client.call(t.session_id, t.turn_id, n, i)
            if rec is not None and rec.state == CallState.AWAITING_APPROVAL and rec.approval_id:
                decision = await client.approve(t.session_id, rec.approval_id, by="trials")
                if first is not None and decision.decided_at != first[0]:
                    t.reverted.append(ckey)
                decided = decision.decided_at if first is None else first[0]
                approved[ckey] = (decided, time.monotonic())

    async def _settled_calls(self, t: TurnTrial, steps: list[list[dict[str, Any]]]) -> None:
        client = self._client(t.session_id)
        states: Counter[str] = Counter()
        for n, group in enumerate(steps):
            for i in range(len(group)):
                rec = await client.call(t.session_id, t.turn_id, n, i)
                states[rec.state.value if rec is not None else "not_made"] += 1
        t.calls = dict(states)


def vendor_duplicates(db: Path, calls_by_key: dict[str, str]) -> tuple[list[Duplicate], list[str]]:
    """Writes applied twice for one key, and write keys no planned call owns (a key that
    changed between attempts would show up here)."""
    if not db.exists():
        return [], []
    marks = ",".join("?" for _ in WRITE_OPS)
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        # With dedupe the vendor logs a repeat as deduped; without it (single-attempt ops)
        # every request applies, so two undeduped requests for one key are two effects.
        rows = con.execute(
            f"SELECT op, idem_key, COUNT(*) FROM requests WHERE deduped = 0 AND op IN ({marks})"
            " GROUP BY op, idem_key HAVING COUNT(*) > 1",
            WRITE_OPS,
        ).fetchall()
        keys = con.execute(
            f"SELECT DISTINCT idem_key FROM requests WHERE op IN ({marks})", WRITE_OPS
        ).fetchall()
    finally:
        con.close()
    dups = [Duplicate(str(op), str(k), int(n), calls_by_key.get(str(k))) for op, k, n in rows]
    stray = sorted(str(k) for (k,) in keys if str(k) not in calls_by_key)
    return dups, stray


async def run_trials(
    mode: str,
    rounds: int,
    seed: int,
    out_json: Path | str | None,
    *,
    work_dir: Path | None = None,
    load: int = 0,
    sync: str = durability.ALWAYS,
    control: bool = False,
    system_account: bool = True,
) -> Report:
    """Run ``rounds`` rounds of ``mode`` (one of ``MODES``) and judge them, with ``load``
    busy processes beside the workers throughout (``jetloop.tooling.trials.load``), on
    servers that sync as ``sync`` says (``jetloop.services.durability``). ``control``: the
    run is a control, whose verdict is that it shows harm (``Report.ok``).
    ``system_account``: False runs the servers without the system account's watch user and
    the workers without its password (``jetloop.tooling.trials.servers``).

    ``seed`` fixes the kill moments, failures and turn plans (not the scheduler). The report
    is written as JSON to ``out_json`` when given; worker and server logs stay in
    ``work_dir`` when given (else a temporary directory, removed afterwards).
    """
    if mode not in MODES:
        raise ValueError(f"unknown trial mode {mode!r}; modes are {', '.join(MODES)}")
    if rounds < 1:
        raise ValueError("trials need at least one round")
    info = machine()  # the load before the busy processes start
    with busy(load):
        async with work_dir_of(work_dir, "jetloop-trials-") as base:
            return await _run(
                mode, rounds, seed, out_json, base, load, info, sync, control, system_account
            )


async def _run(
    mode: str,
    rounds: int,
    seed: int,
    out_json: Path | str | None,
    base: Path,
    load: int,
    info: dict[str, str],
    sync: str = durability.ALWAYS,
    control: bool = False,
    system_account: bool = True,
) -> Report:
    """One run on its work directory: servers up, the rounds, the verdict."""
    began = time.monotonic()
    rng = random.Random(seed)
    servers: Servers
    if mode == "power_loss":
        servers = PowerServer(base, sync, system_account=system_account)
    elif mode == "cluster_power_loss":
        servers = PowerCluster(base, sync, system_account=system_account)
    elif mode == "cluster_faults":
        servers = FaultCluster(base, sync, system_account=system_account)
    elif mode in ("takeover", "mixed"):
        servers = Cluster(base, sync, system_account=system_account)
    else:
        servers = SingleServer(base, sync, system_account=system_account)
    try:
        await servers.start()
        trials = Trials(mode, servers, base, rng, seed, control)
        done: list[RoundTrial] = []
        async with trials.running():
            for r in range(rounds):
                done.append(await trials.round(r))
            if mode in POWER_MODES:
                await trials.read_back(done)
        old = trials.previous
        upgraded_from = f"{old.release.version} ({old.release.commit[:7]})" if old else None
        dups, stray = await asyncio.to_thread(
            vendor_duplicates, trials.vendor_db, trials.calls_by_key
        )
    finally:
        servers.close()
    turns = [t for rnd in done for t in rnd.turns]
    lost = [
        f"round {rnd.round} {t.session_id}/{t.turn_id} {t.status or 'not ended'}: {t.error}"
        for rnd in done
        for t in rnd.turns
        if t.status != "completed"
    ] + [
        f"round {rnd.round} {t.session_id}/{t.turn_id} completed, then {t.vanished}"
        for rnd in done
        for t in rnd.turns
        if t.vanished is not None
    ]
    states: Counter[str] = Counter()
    for t in turns:
        states.update(t.calls)
    by_failure: dict[str, dict[str, Any]] = {}
    judged: list[Target] = []
    for failure in sorted({rnd.failure for rnd in done}):
        row = summarize([rnd for rnd in done if rnd.failure == failure])
        by_failure[failure] = row
        judged += targets(failure, row, LEASE_SECONDS, loaded=load > 0)
    whole = summarize(done)
    info["load_1m_end"] = f"{os.getloadavg()[0]:.2f}"
    if isinstance(servers, FaultCluster | PowerCluster) and servers.left_out:
        info["left_out"] = "; ".join(servers.left_out)  # faults this machine cannot make
    report = Report(
        mode=mode,
        rounds=rounds,
        seed=seed,
        lease_seconds=LEASE_SECONDS,
        load=load,
        turns=len(turns),
        in_flight=sum(1 for t in turns if t.in_flight),
        lost=lost,
        duplicates=dups,
        stray_keys=stray,
        call_states=dict(states),
        detection_p50=whole["detection_p50"],
        detection_p99=whole["detection_p99"],
        detection_max=whole["detection_max"],
        detection_na=whole["detection_na"],
        completion_p50=whole["completion_p50"],
        completion_p99=whole["completion_p99"],
        completion_max=whole["completion_max"],
        false_takeovers=[
            f"round {rnd.round} {what}" for rnd in done for what in rnd.false_takeovers
        ],
        by_failure=by_failure,
        targets=judged,
        wall_seconds=time.monotonic() - began,
        machine=info,
        trials=done,
        upgraded_from=upgraded_from,
        sync=sync,
        reverted=[
            f"round {rnd.round} {ckey}: granted, then asked again"
            for rnd in done
            for t in rnd.turns
            for ckey in t.reverted
        ],
        control=control,
        system_account=system_account,
    )
    if out_json is not None:
        text = json.dumps(report.to_json(), indent=2, default=str) + "\n"
        await asyncio.to_thread(Path(out_json).write_text, text)
    return report


def _spread(name: str, values: list[float]) -> dict[str, float | None]:
    return {
        f"{name}_p50": percentile(values, 50),
        f"{name}_p99": percentile(values, 99),
        f"{name}_max": max(values) if values else None,
    }


def summarize(rounds: Sequence[RoundTrial]) -> dict[str, Any]:
    """The numbers of some rounds: counts, and p50/p99/max of each measured time."""
    completions = [t.completion for rnd in rounds for t in rnd.turns if t.completion is not None]
    detections = [rnd.detection for rnd in rounds if rnd.detection is not None]
    return {
        "rounds": len(rounds),
        "in_flight": sum(len(rnd.in_flight) for rnd in rounds),
        "lost": sum(len(rnd.lost_turns) for rnd in rounds),
        **_spread("detection", detections),
        "detection_na": len(rounds) - len(detections),
        **_spread("completion", completions),
        "false_takeovers": sum(len(rnd.false_takeovers) for rnd in rounds),
        **_spread("restart", [rnd.restart for rnd in rounds if rnd.restart is not None]),
        **_spread("election", [rnd.election for rnd in rounds if rnd.election is not None]),
        # How long each turn in flight took past the election its round waited for.
        **_spread(
            "past_election",
            [
                t.completion - rnd.election
                for rnd in rounds
                if rnd.election is not None
                for t in rnd.turns
                if t.completion is not None
            ],
        ),
        **_spread(
            "steps_election",
            [rnd.steps_election for rnd in rounds if rnd.steps_election is not None],
        ),
        "leaderless": [
            f"round {rnd.round}: {', '.join(rnd.leaderless)}" for rnd in rounds if rnd.leaderless
        ],
    }


# --- printing ------------------------------------------------------------------------------


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def _three(row: dict[str, Any], name: str) -> str:
    p50, p99, top = row[f"{name}_p50"], row[f"{name}_p99"], row[f"{name}_max"]
    return f"p50 {_s(p50)} p99 {_s(p99)} max {_s(top)}"


def format_reports(reports: Sequence[Report]) -> str:
    """The summary table of one or more runs, then each run's failures, targets and rounds."""
    head = (
        f"{'mode':<15}{'rounds':>7}{'turns':>7}{'in flight':>10}{'lost':>6}{'dup':>5}"
        f"{'unknown':>9}{'false':>7}{'det p50':>9}{'det p99':>9}{'det max':>9}{'n/a':>5}"
        f"{'end p50':>9}{'end p99':>9}{'end max':>9}  verdict"
    )
    lines = [head, "-" * len(head)]
    for rep in reports:
        verdict = "met" if rep.ok else "NOT MET"
        if rep.control:
            verdict = "bites (control)" if rep.ok else "DID NOT BITE (control)"
        lines.append(
            f"{rep.mode:<15}{rep.rounds:>7}{rep.turns:>7}{rep.in_flight:>10}{len(rep.lost):>6}"
            f"{len(rep.duplicates):>5}{rep.call_states.get('outcome_unknown', 0):>9}"
            f"{len(rep.false_takeovers):>7}"
            f"{_s(rep.detection_p50):>9}{_s(rep.detection_p99):>9}{_s(rep.detection_max):>9}"
            f"{rep.detection_na:>5}"
            f"{_s(rep.completion_p50):>9}{_s(rep.completion_p99):>9}{_s(rep.completion_max):>9}"
            f"  {verdict}"
        )
    lines.append(
        "det = detection (kill → the lost step claimed again, or the engine moving again);"
        " end = completion (kill → the turn ends); false = false takeovers;"
        " n/a = rounds without detection"
    )
    if any(rep.mode in POWER_MODES for rep in reports):
        lines.append(
            "power modes: lost counts turns seen completed and gone after a cut too; a control"
            " run syncs lazily (nats-server's default) and must show the harm the default"
            " sync prevents"
        )
    for rep in reports:
        lines.append("")
        busy_note = f", {rep.load} busy processes beside" if rep.load else ", no added load"
        sync_note = f", sync_interval {rep.sync}" + (" (control)" if rep.control else "")
        lines.append(
            f"{rep.mode} (seed {rep.seed}, {rep.wall_seconds:.0f}s{busy_note}{sync_note},"
            f" 1-min load {rep.machine.get('load_1m')} at its start,"
            f" {rep.machine.get('load_1m_end')} at its end)"
        )
        if rep.machine.get("left_out"):
            lines.append(f"  {rep.machine['left_out']}")
        if not rep.system_account:
            lines.append(
                "  system account off: no watch user on the servers, no watch password for"
                " the workers (no disconnect advisories heard: dead workers found by leases"
                " and sweeps)"
            )
        if rep.upgraded_from:
            lines.append(f"  old workers: release {rep.upgraded_from}; new workers: this one")
        for failure, f in rep.by_failure.items():
            lines.append(
                f"  {failure:<22} rounds {f['rounds']:>3}  in flight {f['in_flight']:>3}"
                f"  lost {f['lost']}  false takeovers {f['false_takeovers']}"
            )
            lines.append(f"    detection  {_three(f, 'detection')}  n/a {f['detection_na']} rounds")
            lines.append(f"    completion {_three(f, 'completion')}")
            if f["restart_p50"] is not None:
                lines.append(f"    restart    {_three(f, 'restart')}")
            if f["election_p50"] is not None:
                lines.append(f"    election   {_three(f, 'election')} (every group it led)")
                if f["steps_election_p50"] is not None:
                    lines.append(f"    JL_STEPS   {_three(f, 'steps_election')}")
                lines.append(f"    completion past the election {_three(f, 'past_election')}")
            for where in f["leaderless"]:
                lines.append(f"    NO NEW LEADER while the node was cut off, {where}")
        for target in rep.targets:
            lines.append(f"  target {target.text()}")
        if rep.harmed and not rep.control:
            lines.append("  target no lost turn, no duplicate, no reverted decision: NOT MET")
        if rep.control:
            lines.append(
                f"  control: {len(rep.lost)} lost, {len(rep.duplicates)} duplicated,"
                f" {len(rep.reverted)} reverted: "
                + ("the harness bites" if rep.ok else "NOTHING WENT WRONG: it did not bite")
            )
        for rnd in rep.trials:
            rec = [t.completion for t in rnd.in_flight if t.completion is not None]
            server = ""
            if rnd.restart is not None:
                server = f"  restart {_s(rnd.restart)}"
            if rnd.election is not None:
                steps = (
                    "" if rnd.steps_election is None else f"{_s(rnd.steps_election)} (JL_STEPS), "
                )
                server = f"  new leaders after {steps}{_s(rnd.election)} (all)"
            elif rnd.leaderless:
                server = f"  no new leader for {len(rnd.leaderless)} group(s)"
            lines.append(
                f"  round {rnd.round:>3} {rnd.failure:<22} kill at {rnd.kill_after:4.2f}s"
                f"  turns {len(rnd.turns):>3}  in flight {len(rnd.in_flight):>2}"
                f"  detection {_s(rnd.detection) if rnd.detection is not None else 'n/a'}"
                f"  completion max {_s(max(rec) if rec else None)}"
                f"  false {len(rnd.false_takeovers)}{server}"
                + (f"  drained resumes {rnd.drained_resumes}" if rnd.drained_resumes else "")
                + (f"  abandoned resumes {rnd.abandoned_resumes}" if rnd.abandoned_resumes else "")
                + (
                    f"  cut off (their node paused, partitioned or one end of a broken link)"
                    f" {','.join(rnd.cut_off)}"
                    if rnd.cut_off
                    else ""
                )
            )
        for what in rep.lost:
            lines.append(f"  LOST {what}")
        for d in rep.duplicates:
            lines.append(f"  DUPLICATE {d.op} {d.idempotency_key} x{d.applied} ({d.call})")
        for what in rep.reverted:
            lines.append(f"  REVERTED {what}")
        for what in rep.false_takeovers:
            lines.append(f"  FALSE TAKEOVER {what}")
        if rep.stray_keys:
            lines.append(f"  stray vendor keys (no planned call): {len(rep.stray_keys)}")
    return "\n".join(lines)


def main(
    modes: Sequence[str] = ("worker_kill",),
    rounds: int | None = None,
    seed: int | None = None,
    out_json: Path | str | None = None,
    work_dir: Path | None = None,
    load: int = 0,
    sync: str = durability.ALWAYS,
    control_rounds: int = CONTROL_ROUNDS,
    system_account: bool = True,
) -> int:
    """What ``jetloop trials`` runs: each mode in turn; prints the table; 0 if all targets met.

    ``rounds`` defaults to ``JETLOOP_TRIALS`` (else 10), ``seed`` to ``JETLOOP_KILL_SEED``
    (else random, and printed). With several modes, ``out_json`` holds a list of reports.
    ``sync``: when the servers sync what they acknowledged (always, as ``jetloop up``). A
    power mode run on ``always`` is followed by ``control_rounds`` rounds of a control on
    nats-server's lazy default, which must show harm (0: no control).
    ``system_account``: False runs every mode without the system account's watch user.
    """
    if rounds is None:
        rounds = int(os.environ.get("JETLOOP_TRIALS", "10"))
    if seed is None:
        seed = int(os.environ.get("JETLOOP_KILL_SEED", str(random.randrange(1 << 30))))
    off = "" if system_account else " (system account off: workers hear no disconnects)"
    print(f"JETLOOP_KILL_SEED={seed} JETLOOP_TRIALS={rounds}{off}", flush=True)

    async def go() -> list[Report]:
        out = []
        for i, mode in enumerate(modes):
            wd = work_dir / mode if work_dir is not None else None
            out.append(
                await run_trials(
                    mode,
                    rounds,
                    seed + i,
                    None,
                    work_dir=wd,
                    load=load,
                    sync=sync,
                    system_account=system_account,
                )
            )
            if mode in POWER_MODES and sync == durability.ALWAYS and control_rounds > 0:
                wd = work_dir / f"{mode}-control" if work_dir is not None else None
                out.append(
                    await run_trials(
                        mode,
                        control_rounds,
                        seed + i,
                        None,
                        work_dir=wd,
                        load=load,
                        sync=durability.SERVER_DEFAULT,
                        control=True,
                        system_account=system_account,
                    )
                )
        return out

    configure("console", "warning")  # the client's own log lines would drown the table
    try:
        reports = asyncio.run(go())
    except PowerCutUnavailable as exc:
        print(f"jetloop trials: {exc}", file=sys.stderr)
        return 2
    print(format_reports(reports))
    if out_json is not None:
        body: Any = [r.to_json() for r in reports]
        Path(out_json).write_text(json.dumps(body, indent=2, default=str) + "\n")
    return 0 if all(r.ok for r in reports) else 1
