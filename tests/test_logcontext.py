"""A step's ids on its log lines (``jetloop.consumers.logcontext``): bound once per step,
merged only into lines that are written, never seen by another step."""

from __future__ import annotations

import asyncio
import io
import json

import structlog

from jetloop.consumers.logcontext import bind_step, end_step, merge_step, start_step, step_ids
from jetloop.services.logs import configure


def test_a_line_carries_the_step_ids_and_its_own_fields_win() -> None:
    """The ids come first; a field the line gives itself is not overwritten."""
    token = start_step(session="s1", turn="t1", seq=7)
    try:
        bind_step(call="s1.t1.0.0")
        merged = merge_step(None, "info", {"event": "x", "seq": 8})
    finally:
        end_step(token)
    assert merged == {"session": "s1", "turn": "t1", "seq": 8, "call": "s1.t1.0.0", "event": "x"}
    assert step_ids() == {}
    assert merge_step(None, "info", {"event": "y"}) == {"event": "y"}


async def test_steps_in_their_own_tasks_never_see_each_others_ids() -> None:
    """Two steps bind at once; a task a step started before a bind keeps what it saw."""
    seen: dict[str, dict[str, object]] = {}
    started = asyncio.Event()

    async def child(name: str) -> None:
        await started.wait()
        seen[name] = step_ids()

    async def step(name: str) -> None:
        token = start_step(step=name)
        try:
            kid = asyncio.create_task(child(f"{name}-child"))
            bind_step(attempt=2)
            await asyncio.sleep(0)
            seen[name] = step_ids()
            started.set()
            await kid
        finally:
            end_step(token)

    await asyncio.gather(step("a"), step("b"))
    assert seen == {
        "a": {"step": "a", "attempt": 2},
        "b": {"step": "b", "attempt": 2},
        "a-child": {"step": "a"},
        "b-child": {"step": "b"},
    }


def test_the_worker_log_chain_writes_the_ids() -> None:
    """``jetloop.services.logs.configure`` puts the ids on every JSON line a step writes, at any
    level that is written, and writes nothing for a level below the one set."""
    out = io.StringIO()
    saved = structlog.get_config()  # other tests in this process log with it
    configure("json", "info")
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=out))
    log = structlog.get_logger("t")
    token = start_step(session="s9", step="k")
    try:
        log.warning("step.something", why="because")
        log.debug("step.acked")
    finally:
        end_step(token)
        structlog.configure(**saved)
    [line] = [json.loads(ln) for ln in out.getvalue().splitlines()]
    assert line["session"] == "s9" and line["step"] == "k" and line["why"] == "because"
    assert line["event"] == "step.something" and line["level"] == "warning"
