"""Named points where a test can stop a step on purpose (crash-matrix cells by design).

``JETLOOP_FAULT_HOLD`` lists points (comma-separated); a worker that reaches one logs
``fault.hold`` with the point and waits there, keeping its lease by heartbeats, until the
file named by ``JETLOOP_FAULT_RELEASE`` exists (or forever). The test then SIGKILLs,
SIGSTOPs or releases it. With the variable unset a point costs one set lookup.

Points: turn_request.after_accept, run_model.in_call, run_model.before_commit,
run_model.after_commit, call_tool.before_mark, call_tool.in_tool, call_tool.before_commit,
call_tool.after_commit, call_tool.wait_over (an answer or a timer's firing is read, before the
call is settled), join.before_publish, poll_tool_task.in_poll, compact_context.in_call,
projector.before_commit, projector.before_ack.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import structlog

log = structlog.get_logger("jetloop.faults")


class Faults:
    def __init__(self, holds: frozenset[str] = frozenset(), release: Path | None = None) -> None:
        self.holds = holds
        self.release = release

    @classmethod
    def from_env(cls) -> Faults:
        raw = os.environ.get("JETLOOP_FAULT_HOLD", "")
        holds = frozenset(p.strip() for p in raw.split(",") if p.strip())
        rel = os.environ.get("JETLOOP_FAULT_RELEASE")
        return cls(holds, Path(rel) if rel else None)

    async def point(self, name: str) -> None:
        if name not in self.holds:
            return
        log.warning("fault.hold", point=name)
        while self.release is None or not self.release.exists():
            await asyncio.sleep(0.05)
        log.warning("fault.released", point=name)
