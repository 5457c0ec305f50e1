"""Which agents are served, and by which live workers (``jl_agents``, ``jl_workers``).

Turns and steps are routed by agent (``jl.turn.<agent>.…``, ``jl.step.<pool>.<agent>.…``),
so a request for an agent that no worker serves would wait in its stream without a word.
The registry lets a client tell the three cases apart at once:

- ``unknown``: no worker has ever served the agent (a typo, or nothing deployed yet) —
  the client refuses to send;
- ``offline``: some worker served it once, none does now — the request is accepted and
  waits for a worker (the snapshot says so);
- ``live``: a worker that serves it refreshed its presence within ``PRESENCE_TTL``.

A worker writes ``agent.<name>`` once (create-if-absent) and refreshes ``worker.<id>``
(its agents and pools, its jetloop release, the highest schema version it reads and the step
kinds it runs) every third of the TTL; the bucket's TTL removes a dead worker's
presence by itself, and a worker that stops cleanly deletes its own. Presence is only a
hint for people and clients: the engine never decides who runs a step from it (the lease
and the state's CAS still do).

During a rolling upgrade the presence is how a release knows whether an older one still
serves the store: a worker of 0.1.0 names no release and reads schema version 1 only, so a
release that must not write a newer version while such a worker lives reads ``reads`` of
every presence first (docs/upgrading.md, "Rolling upgrades: the policy").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Literal

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from jetloop.schemas.codec import SCHEMA_VERSION
from jetloop.schemas.kinds import StepKind
from jetloop.streams import kvkeys
from jetloop.streams.topology import AGENTS_BUCKET, WORKERS_BUCKET
from jetloop.streams.topology import POOLS as ENGINE_POOLS

AgentStatus = Literal["unknown", "offline", "live"]
# What a presence of a release that did not say (0.1.0) reads.
FIRST_SCHEMA_VERSION = 1


def this_release() -> str | None:
    """The installed jetloop's version (None when it was not installed as a package)."""
    try:
        return package_version("jetloop")
    except PackageNotFoundError:
        return None


_RELEASE = this_release()


@dataclass(frozen=True)
class WorkerPresence:
    worker_id: str
    agents: tuple[str, ...]
    pools: tuple[str, ...]
    since: float
    release: str | None = None  # None: a release before 0.2.0, which did not say
    reads: int = FIRST_SCHEMA_VERSION  # the highest schema version it reads
    # The step kinds it runs; None: a release that did not say, which runs the kinds
    # there were before ``call_tools`` (``KINDS_BEFORE_SAYING``).
    kinds: tuple[str, ...] | None = None
    # The records it reads beyond those of its schema version (``RECORDS_READ``).
    records: tuple[str, ...] = ()

    def runs(self, kind: StepKind) -> bool:
        return kind.value in self.kinds if self.kinds is not None else kind in KINDS_BEFORE_SAYING


# Records a worker reads that an earlier release of the same schema version does not: a
# release writes one only while every live worker's presence lists it. ``step_reads``: a
# model step's reads kept together (``jetloop.schemas.StepReads``). ``results_entry``: a
# step's results in one history entry (``HistoryEntry.parts``).
STEP_READS = "step_reads"
RESULTS_ENTRY = "results_entry"
RECORDS_READ = (STEP_READS, RESULTS_ENTRY)
# The pauses before listing the workers again when a listing misses the asking worker's own
# presence (``every_worker_takes``); after the last, it says no.
LISTING_RETRIES = (0.05, 0.1, 0.2)


# The kinds of step every release runs, also those whose presence does not list its kinds.
KINDS_BEFORE_SAYING = frozenset(StepKind) - {StepKind.CALL_TOOLS}


class Registry:
    def __init__(self, agents: KeyValue, workers: KeyValue) -> None:
        self._agents = agents
        self._workers = workers
        self._known: set[str] = set()

    @classmethod
    async def open(cls, js: JetStreamContext) -> Registry:
        return cls(await js.key_value(AGENTS_BUCKET), await js.key_value(WORKERS_BUCKET))

    async def declare(self, agents: Iterable[str], by: str) -> None:
        """Record ``agents`` as served (once each): done by every worker at start, and by a
        deploy that declares an app before its workers run (``jetloop topology --app``)."""
        for agent in agents:
            if agent in self._known:
                continue
            try:
                await self._agents.create(
                    f"agent.{agent}", json.dumps({"declared_by": by, "at": time.time()}).encode()
                )
            except KeyWrongLastSequenceError:
                pass  # declared before
            self._known.add(agent)

    async def advertise(
        self, worker_id: str, agents: Iterable[str], pools: Iterable[str], since: float
    ) -> None:
        """Say this worker is alive and serves ``agents``; record each agent once."""
        agents = tuple(sorted(agents))
        await self.declare(agents, f"worker {worker_id}")
        body = {
            "agents": list(agents),
            "pools": sorted(pools),
            "since": since,
            "release": _RELEASE,
            "reads": SCHEMA_VERSION,
            "kinds": sorted(StepKind),
            "records": list(RECORDS_READ),
        }
        await self._workers.put(f"worker.{worker_id}", json.dumps(body).encode())

    async def withdraw(self, worker_id: str) -> None:
        """A clean stop: the presence goes now instead of when its TTL runs out."""
        try:
            await self._workers.delete(f"worker.{worker_id}")
        except NatsError:
            pass  # the TTL removes it

    async def workers(self) -> list[WorkerPresence]:
        """Every live worker's presence, read in one listing of the bucket."""
        out = []
        # (Only ``worker.`` keys: the bucket also holds each process's held messages,
        # ``jetloop.streams.holds``.)
        for entry in await kvkeys.entries(self._workers, "worker.>"):
            if not entry.value:
                continue
            try:
                body = json.loads(entry.value)
            except ValueError:
                continue  # not a presence this code reads
            if not isinstance(body, dict):
                continue
            out.append(
                WorkerPresence(
                    worker_id=entry.key.removeprefix("worker."),
                    agents=tuple(body.get("agents", ())),
                    pools=tuple(body.get("pools", ())),
                    since=float(body.get("since", 0.0)),
                    release=body.get("release"),
                    reads=int(body.get("reads", FIRST_SCHEMA_VERSION)),
                    kinds=tuple(body["kinds"]) if isinstance(body.get("kinds"), list) else None,
                    records=tuple(r for r in body.get("records", ()) if isinstance(r, str))
                    if isinstance(body.get("records"), list)
                    else (),
                )
            )
        return out

    async def every_worker_takes(self, kind: StepKind, me: str) -> tuple[bool, frozenset[str]]:
        """Whether every live worker runs steps of ``kind``, and the records
        (``RECORDS_READ``) every one reads, from one listing: a release writes a kind or a
        record that older ones do not take only then (docs/upgrading.md, "Rolling upgrades:
        the policy"). ``me``, the asking worker, has its presence written: a listing without
        it is not complete (nats-py's KV watch can end before the entries it was sent): it
        is listed again after a moment (``LISTING_RETRIES``), and one still without it says
        no to the kind and to every record. (Said no at its start, a worker would write the
        older forms until its next presence refresh.)"""
        workers = await self.workers()
        for wait in LISTING_RETRIES:
            if any(w.worker_id == me for w in workers):
                break
            await asyncio.sleep(wait)
            workers = await self.workers()
        if not any(w.worker_id == me for w in workers):
            return False, frozenset()
        # A worker of pools of their own only (a tool served elsewhere, maybe by another
        # language) meets neither: its calls always travel one message each, are never
        # kept with a step's reads, and it reads no history. One that lists no pools is
        # counted.
        workers = [w for w in workers if not w.pools or set(w.pools) & set(ENGINE_POOLS)]
        read_by_all = frozenset(r for r in RECORDS_READ if all(r in w.records for w in workers))
        return all(w.runs(kind) for w in workers), read_by_all

    async def declared(self) -> list[str]:
        """Every agent ever served, sorted."""
        keys = await kvkeys.keys(self._agents, "agent.>")
        return sorted(k.removeprefix("agent.") for k in keys if k.startswith("agent."))

    async def known(self, agent: str) -> bool:
        """Has any worker ever served ``agent``? (Remembered once true: it stays true.)"""
        if agent not in self._known:
            try:
                await self._agents.get(f"agent.{agent}")
            except KeyNotFoundError:
                return False
            self._known.add(agent)
        return True

    async def status(self, agent: str) -> AgentStatus:
        """``live`` when the live workers that list ``agent`` serve every engine pool between
        them (its turns can run), ``offline`` when they do not (none, or only workers of a
        pool of their own), ``unknown`` when no worker ever served it."""
        if not await self.known(agent):
            return "unknown"
        served: set[str] = set()
        for w in await self.workers():
            if agent in w.agents:
                # A presence without pools is of a release before they were listed, whose
                # workers served every engine pool.
                served.update(w.pools or ENGINE_POOLS)
        return "live" if served.issuperset(ENGINE_POOLS) else "offline"
