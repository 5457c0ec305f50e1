"""How a long-lived jetloop process (a worker, ``jetloop up``) runs: its event loop and its
garbage collector.

A worker is CPU-bound on small messages (docs/performance.md, issue 15), and two costs
outside jetloop's own code are cut here without changing what a step does:

- **the event loop**: uvloop, where it is installed (with jetloop on Linux), runs the same
  asyncio code with less CPU per callback and per socket write; ``JETLOOP_UVLOOP=false``
  keeps the standard loop.
- **the collector**: after start-up every object alive (modules, the app, connections) is
  moved out of the collector's sight (``gc.freeze``), so a full collection no longer walks
  them, and young objects are collected after ``JETLOOP_GC_THRESHOLD`` allocations instead
  of Python's 700: a step allocates thousands of short-lived objects, which reference
  counting frees; the collector is there only for cycles.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

log = structlog.get_logger("jetloop.runner")

# Python's own: what ``JETLOOP_GC_THRESHOLD`` replaces for generation 0 (the older
# generations keep theirs).
PYTHON_GC_THRESHOLD = 700


def loop_factory(use_uvloop: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when asked for and installed; None (the standard loop) otherwise."""
    if not use_uvloop:
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(coro: Coroutine[Any, Any, None], use_uvloop: bool = True) -> None:
    """``asyncio.run`` on the loop ``loop_factory`` picks."""
    with asyncio.Runner(loop_factory=loop_factory(use_uvloop)) as runner:
        runner.run(coro)


def settle_heap(threshold: int) -> None:
    """Once the process has started: collect what start-up left, freeze the survivors (they
    live as long as the process) and set generation 0's threshold."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)
    log.debug("runner.heap_settled", frozen=gc.get_freeze_count(), gc_threshold=threshold)


async def settle_when_started(started: Awaitable[None], threshold: int) -> None:
    """``settle_heap`` as soon as ``started`` is done (a service's ``wait_started``)."""
    await started
    settle_heap(threshold)


def loop_name() -> str:
    """The running loop's module, for the start line: ``uvloop`` or ``asyncio``."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]
