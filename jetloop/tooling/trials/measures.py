"""What a kill trial measures besides lost turns and duplicates, read from state.

- *Detection*: how long the engine took to notice the failure. After a worker kill, the
  seconds from the kill to the first ``agent.run.crash_resumed`` event that names the killed
  worker as the lost one: another worker has claimed a step the dead one held. A round in
  which the victim held no step has no detection value (it is counted as "n/a"). After a
  server restart, a takeover or a node restart no worker dies, so nothing is resumed:
  detection is then the seconds from the kill until the stream stored the first event of a
  turn in flight that was made after the kill, the engine moving again. The stream's own
  time is used there because an event made just after the kill by a worker that had not yet
  noticed it would otherwise count although it waited for the server like everything else.
- *False takeover*: a live holder's claim settled by another worker. Every loss a turn
  records (its ``lost`` list, ``worker/incarnation``) and every resumed event is checked
  against who was alive: the survivor always is, the victim is unless the round killed it,
  and a resume of the killed victim made before the kill is false as well.
- *Targets* (issues 14 and 31): worker kill detection p99 ≤ 1 s, ≤ 2 s with busy processes
  beside the workers; a worker killed together with the server: detection p99 ≤ the p99
  restart time + the lease + that slack (no one heard it die: its lease, counted from the
  server's return, finds it); server restart completion p99 ≤ the p99 restart time + 1 s;
  takeover completion p99 ≤ the p99 election time + 1 s, the election counted until every
  group the killed node led (the jetloop streams and their durable consumers) has a new
  leader, since a step needs each it touches; no false takeover, whatever failed.

All times are wall-clock (``time.time()``) on one machine: the harness records it at the
kill, workers stamp events with it (``Event.at``), the servers stamp what they store.
Used by ``jetloop.tooling.trials.run``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nats.errors import Error as NatsError
from nats.js import api
from nats.js.client import JetStreamContext

from jetloop.schemas import DecodeError, EventType
from jetloop.schemas.log import events_in
from jetloop.streams import topology

# Issue 14's numbers: detection after a worker kill, and the slack a recovery may take
# beyond the server's own restart or the cluster's election.
DETECTION_TARGET_SECONDS = 1.0
# Issue 31's: with busy processes beside the workers (``--load``), a dead worker is found
# within 2 s.
LOADED_DETECTION_TARGET_SECONDS = 2.0
SLACK_SECONDS = 1.0
# Failures that kill the round's victim worker (its resumes are expected, after the kill).
VICTIM_KILLED = ("worker_kill", "worker_kill+server_restart", "worker_kill+takeover")


@dataclass(frozen=True)
class SeenEvent:
    """One event of a round's sessions as the events stream holds it."""

    type: str
    turn_id: str | None
    at: float  # when a worker made it (Event.at)
    stored: float  # when the stream stored it (the server's clock)
    data: dict[str, Any]


async def read_events(
    js: JetStreamContext, session_ids: Iterable[str], timeout: float = 60.0
) -> list[SeenEvent]:
    """Every event of these sessions (history entries left out), oldest first per session."""
    out: list[SeenEvent] = []
    deadline = time.monotonic() + timeout
    for sid in session_ids:
        while True:
            try:
                out += await _session_events(js, sid)
                break
            except (NatsError, TimeoutError):
                # After a restart or an election the stream may answer a moment later.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    return out


async def _session_events(js: JetStreamContext, sid: str) -> list[SeenEvent]:
    subject = topology.session_events_filter(sid)
    cfg = api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.NONE,
        filter_subject=subject,
        inactive_threshold=30.0,
        mem_storage=True,
        num_replicas=1,
    )
    sub = await js.pull_subscribe(subject, stream=topology.EVENTS_STREAM, config=cfg)
    out: list[SeenEvent] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=1.0)
            except TimeoutError:
                break  # nothing (more) to read
            for m in msgs:
                try:
                    told = events_in(m.subject, m.data)  # (either layout of the log)
                except DecodeError:
                    continue
                stored = m.metadata.timestamp.timestamp()
                for ev in told:
                    out.append(SeenEvent(ev.type.value, ev.turn_id, ev.at, stored, ev.data))
            if not msgs or msgs[-1].metadata.num_pending == 0:
                break
    finally:
        try:
            await sub.unsubscribe()
        except NatsError:
            pass  # the consumer ages out by itself
    return out


def worker_detection(events: Iterable[SeenEvent], victim: str, kill_wall: float) -> float | None:
    """Seconds from the kill to the first resume of a step the killed worker held; None when
    no step of it was resumed (it held none)."""
    times = [
        e.at
        for e in events
        if e.type == EventType.CRASH_RESUMED.value
        and e.data.get("lost_worker") == victim
        and e.at >= kill_wall
    ]
    return min(times) - kill_wall if times else None


def engine_detection(
    events: Iterable[SeenEvent], in_flight: set[str], kill_wall: float
) -> float | None:
    """Seconds from the kill until the stream stored the first event, made after the kill,
    of a turn that was in flight; None when there was no turn in flight."""
    times = [e.stored for e in events if e.turn_id in in_flight and e.at > kill_wall]
    return max(0.0, min(times) - kill_wall) if times else None


def false_takeovers(
    turn_losses: Mapping[str, Iterable[str]],
    events: Iterable[SeenEvent],
    alive: set[str],
    killed: str | None,
    kill_wall: float,
) -> list[str]:
    """The losses of a round that took a claim from a worker that was alive.

    ``turn_losses``: each turn's ``lost`` list (``worker/incarnation``); ``alive``: workers
    alive throughout the round; ``killed``: the worker the round killed, whose losses are
    false only when resumed before the kill. A resume of a step whose worker had stopped on
    purpose (its drain ran out: ``drained``) is no loss; ``drained_resumes`` counts them. Nor
    is one of a step its live holder had stopped working on (its delivery ended unfinished, the
    holder itself said so: ``abandoned``); ``abandoned_resumes`` counts them.
    """
    resumed_at: dict[tuple[str, str], list[float]] = {}
    for turn_id, lost in turn_losses.items():
        for lid in lost:
            resumed_at.setdefault((turn_id, lid), [])
    for e in events:
        if e.type != EventType.CRASH_RESUMED.value or e.turn_id is None:
            continue
        if e.data.get("drained") is True or e.data.get("abandoned") is True:
            continue
        lid = f"{e.data.get('lost_worker')}/{e.data.get('lost_incarnation', '')}"
        resumed_at.setdefault((e.turn_id, lid), []).append(e.at)
    out: list[str] = []
    for (turn_id, lid), ats in sorted(resumed_at.items()):
        worker = lid.partition("/")[0]
        if worker in alive:
            out.append(f"{turn_id} lost {lid}: {worker} was alive")
        elif worker == killed and any(at < kill_wall for at in ats):
            early = kill_wall - min(ats)
            out.append(f"{turn_id} lost {lid}: resumed {early:.2f}s before {worker} was killed")
    return out


def drained_resumes(events: Iterable[SeenEvent]) -> int:
    """How many steps were taken over from a worker whose drain ran out (a deploy's
    hand-over of a step longer than the drain: resumed, not counted as a loss)."""
    return sum(
        1 for e in events if e.type == EventType.CRASH_RESUMED.value and e.data.get("drained")
    )


def abandoned_resumes(events: Iterable[SeenEvent]) -> int:
    """How many steps were resumed after their live holder's delivery ended unfinished (an
    outage outlasting its writes' retries): not a loss, not a false takeover, counted."""
    return sum(
        1 for e in events if e.type == EventType.CRASH_RESUMED.value and e.data.get("abandoned")
    )


@dataclass
class Target:
    """One of issue 14's targets, for one failure of a run."""

    failure: str
    measure: str
    value: float | None
    limit: float | None
    met: bool

    def text(self) -> str:
        value = "-" if self.value is None else _num(self.measure, self.value)
        limit = "?" if self.limit is None else _num(self.measure, self.limit)
        verdict = "met" if self.met else "NOT MET"
        return f"{self.failure} {self.measure} {value} (target ≤ {limit}): {verdict}"


def _num(measure: str, v: float) -> str:
    return f"{v:g}" if measure == "false takeovers" else f"{v:.2f}s"


def _target(failure: str, measure: str, value: float | None, limit: float | None) -> Target:
    # Nothing measured (no round of the kind had a value) is reported, not failed.
    met = value is None or (limit is not None and value <= limit)
    return Target(failure, measure, value, limit, met)


def targets(
    failure: str, row: Mapping[str, Any], lease: float, loaded: bool = False
) -> list[Target]:
    """The targets that apply to ``failure``, judged on its summary ``row`` (p99 values and
    the count of false takeovers, as ``jetloop.tooling.trials.run`` sums a failure's rounds);
    ``loaded``: busy processes ran beside the workers."""
    out: list[Target] = []
    detect = LOADED_DETECTION_TARGET_SECONDS if loaded else DETECTION_TARGET_SECONDS
    if failure == "worker_kill":
        out.append(_target(failure, "detection p99", row["detection_p99"], detect))
    if failure == "worker_kill+server_restart":
        # The server was down when the worker died: no one heard its connection close, and
        # a live worker may still be connecting again. The dead one's step is taken at its
        # lease, counted from the server's return, within the detection slack.
        restart = row["restart_p99"]
        limit = None if restart is None else restart + lease + detect
        out.append(_target(failure, "detection p99", row["detection_p99"], limit))
    if failure == "server_restart":
        restart = row["restart_p99"]
        limit = None if restart is None else restart + SLACK_SECONDS
        out.append(_target(failure, "completion p99", row["completion_p99"], limit))
    if failure == "takeover":
        election = row["election_p99"]
        limit = None if election is None else election + SLACK_SECONDS
        out.append(_target(failure, "completion p99", row["completion_p99"], limit))
    # Whatever failed, a live worker keeps its step: a server restart, an election or a busy
    # machine is never evidence that a worker died.
    out.append(_target(failure, "false takeovers", float(row["false_takeovers"]), 0.0))
    return out
