"""Named points where a test can stop a step on purpose (crash-matrix cells by design).

``JETLOOP_FAULT_HOLD`` lists points (comma-separated); a worker that reaches one logs
``fault.hold`` with the point and waits there, keeping its lease by heartbeats, until the
file named by ``JETLOOP_FAULT_RELEASE`` exists (or forever). The test then SIGKILLs,
SIGSTOPs or releases it. With the variable unset a point costs one set lookup.

``JETLOOP_FAULT_FAIL`` lists points too: the first time this process reaches one it raises
``InjectedOutage`` there (a NATS timeout, which the worker outlives as it outlives an outage
longer than its writes are tried again), so the step's delivery ends with its claim still
recorded, as it does when a store write fails past its retries; later arrivals pass.

``JETLOOP_FAULT_PLAN`` names a file of holds that may change while the worker runs (the
crash test of a user's agent, ``jetloop.tooling.crashtest``, moves one worker from round to
round with it): JSON ``{"holds": ["<point>@<session>#<k>", …], "pass": false}``, each entry
holding the ``k``-th time (from 1; every time without ``#k``) this process reaches
``point`` for a step of ``session``. The file is read again when it changes. With
``"pass": true`` a matching point is logged and not held: how a test lists the points a
conversation reaches.

Points: turn_request.after_accept, run_model.in_call, run_model.before_commit,
run_model.after_commit, call_tool.before_mark, call_tool.in_tool, call_tool.before_commit,
call_tool.after_commit, call_tool.wait_over (an answer or a timer's firing is read, before the
call is settled), join.before_publish, join.after_publish (a step's kept reads joined: what
follows is published, the message not yet acked), poll_tool_task.in_poll, compact_context.in_call,
projector.before_commit, projector.before_ack.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from nats.errors import TimeoutError as NatsTimeoutError

from jetloop.consumers.logcontext import step_ids

log = structlog.get_logger("jetloop.faults")


class InjectedOutage(NatsTimeoutError):
    """Raised at a point of ``JETLOOP_FAULT_FAIL``: an outage the process outlives."""


@dataclass(frozen=True)
class PlannedHold:
    """One entry of a plan: ``point@session#k``."""

    point: str
    session: str
    nth: int | None = None  # None: every time

    @classmethod
    def parse(cls, entry: str) -> PlannedHold:
        where, _, nth = entry.partition("#")
        point, _, session = where.partition("@")
        return cls(point, session, int(nth) if nth else None)

    def __str__(self) -> str:
        return f"{self.point}@{self.session}" + (f"#{self.nth}" if self.nth else "")


@dataclass
class Plan:
    """The holds of ``JETLOOP_FAULT_PLAN``, as its file says now."""

    path: Path
    holds: dict[tuple[str, str], list[PlannedHold]] = field(default_factory=dict)
    passing: bool = False
    _stamp: tuple[int, int] | None = None
    # How often this process reached each (point, session) a plan named.
    reached: Counter[tuple[str, str]] = field(default_factory=Counter)

    def current(self) -> None:
        """Read the file again if it changed (a missing or unreadable file holds nothing)."""
        try:
            st = self.path.stat()
        except OSError:
            self.holds, self._stamp = {}, None
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            body = json.loads(self.path.read_text())
            entries = [PlannedHold.parse(str(e)) for e in body.get("holds", [])]
        except (OSError, ValueError, AttributeError):
            self.holds = {}
            return
        self.passing = body.get("pass") is True
        self.holds = {}
        for e in entries:
            self.holds.setdefault((e.point, e.session), []).append(e)

    def match(self, point: str) -> PlannedHold | None:
        """The entry this arrival at ``point`` meets, if any (counted once per arrival)."""
        self.current()
        if not self.holds:
            return None
        session = str(step_ids().get("session", ""))
        entries = self.holds.get((point, session))
        if not entries:
            return None
        self.reached[(point, session)] += 1
        n = self.reached[(point, session)]
        return next((e for e in entries if e.nth is None or e.nth == n), None)


class Faults:
    def __init__(
        self,
        holds: frozenset[str] = frozenset(),
        release: Path | None = None,
        plan: Path | None = None,
        fails: frozenset[str] = frozenset(),
    ) -> None:
        self.holds = holds
        self.release = release
        self.plan = Plan(plan) if plan is not None else None
        self.fails = set(fails)  # each fails once: removed when it does

    @classmethod
    def from_env(cls) -> Faults:
        holds = _points("JETLOOP_FAULT_HOLD")
        rel = os.environ.get("JETLOOP_FAULT_RELEASE")
        plan = os.environ.get("JETLOOP_FAULT_PLAN")
        fails = _points("JETLOOP_FAULT_FAIL")
        return cls(holds, Path(rel) if rel else None, Path(plan) if plan else None, fails)

    async def point(self, name: str) -> None:
        if name in self.fails:
            self.fails.discard(name)
            log.warning("fault.fail", point=name)
            raise InjectedOutage
        if self.plan is not None:
            planned = self.plan.match(name)
            if planned is not None:
                n = self.plan.reached[(planned.point, planned.session)]
                log.warning("fault.hold", point=name, planned=str(planned), nth=n)
                if self.plan.passing:
                    return
                await self._held(name)
                return
        if name not in self.holds:
            return
        log.warning("fault.hold", point=name)
        await self._held(name)

    async def _held(self, name: str) -> None:
        while self.release is None or not self.release.exists():
            await asyncio.sleep(0.05)
        log.warning("fault.released", point=name)


def _points(variable: str) -> frozenset[str]:
    raw = os.environ.get(variable, "")
    return frozenset(p.strip() for p in raw.split(",") if p.strip())
