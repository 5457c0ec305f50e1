"""A supervisor: the components of one process, each restarted when it fails.

``jetloop up`` runs nats-server, a worker, the gateway and the projector in one process; one part
falling over must not take the others with it (docs/design.md, convention 4: a supervisor owns the
components). Each :class:`Component` names a *factory*: a
:class:`~jetloop.services.lifecycle.Service` is single-use, so every restart builds a new instance.

A component fails when its ``run()`` raises, or returns while nobody asked it to stop.
The failure is logged once (``component.failed``, with ``component`` and ``error``) and
the component is built and run again after a pause: 0.5 s, doubling up to 30 s, back to
0.5 s once an instance has run for ``healthy_after`` seconds. The others keep running.

Restarting cannot help, and the supervisor gives up (:class:`GaveUp`, one line naming the
component, after stopping everything in order), when

- the component's ``fatal`` says so for the error (a configuration error: a port in use),
- its factory raises (it cannot even be built), or
- it failed ``give_up_after`` times in a row within ``window`` seconds (a crash loop: with
  the growing pause only failures that come right at start can do that).

Components are started in *stages*: a stage once every component of the one before has
started (the server before the services that use it). ``stop()`` stops the stages in
reverse order, the components of a stage together, each draining in its own ``run()``. A stage
still stopping after ``slow_stop`` seconds is logged once (``component.stopping_slowly``) with
where every task of the process is waiting, so a stop that hangs says on what.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from jetloop.services.lifecycle import Service

log = structlog.get_logger("jetloop.supervisor")


class Part(Protocol):
    """What a supervisor runs: a ``Service`` (docs/design.md, convention 3) with its ``run()``."""

    async def run(self) -> None: ...

    async def wait_started(self) -> None: ...

    def stop_soon(self) -> None: ...


def _never_fatal(exc: BaseException) -> str | None:
    return None


@dataclass(frozen=True)
class Component:
    """A part of the process: a name for the logs and a factory for fresh instances.

    ``fatal`` maps an error of ``run()`` to a one-line reason to give up (configuration
    errors that a restart repeats), or ``None`` to restart.
    """

    name: str
    factory: Callable[[], Part]
    fatal: Callable[[BaseException], str | None] = _never_fatal


class GaveUp(Exception):
    """A component that restarting cannot help; the message is one line naming it."""

    def __init__(self, component: str, reason: str) -> None:
        super().__init__(reason)
        self.component = component


def describe(exc: BaseException) -> str:
    """One line for an error: the first leaf of an exception group, with its type."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def waiting_tasks() -> list[str]:
    """Every unfinished task of the running loop with the coroutines it is awaiting through,
    outermost first: ``name: services/worker.py:290 run > asyncio/locks.py:213 wait``
    (``Task.get_stack`` gives only the outermost)."""
    found = []
    for task in asyncio.all_tasks():
        if task.done():
            continue
        chain = []
        coro: Any = task.get_coro()
        while coro is not None:
            f = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if f is None:
                break
            where = "/".join(Path(f.f_code.co_filename).parts[-2:])
            chain.append(f"{where}:{f.f_lineno} {f.f_code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        found.append(f"{task.get_name()}: {' > '.join(chain) or '(not started)'}")
    return sorted(found)


@dataclass
class _Slot:
    component: Component
    started: asyncio.Event = field(default_factory=asyncio.Event)
    instance: Part | None = None
    task: asyncio.Task[None] | None = None
    restarts: int = 0


class Supervisor(Service):
    def __init__(
        self,
        stages: Sequence[Sequence[Component]],
        *,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        healthy_after: float = 30.0,
        give_up_after: int = 5,
        window: float = 20.0,
        stop_timeout: float = 60.0,
        slow_stop: float = 10.0,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.stages = [[_Slot(c) for c in stage] for stage in stages]
        names = [s.component.name for stage in self.stages for s in stage]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must differ: {names}")
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.healthy_after = healthy_after
        self.give_up_after = give_up_after
        self.window = window
        self.stop_timeout = stop_timeout
        self.slow_stop = slow_stop
        self.on_started = on_started
        self._gave_up: GaveUp | None = None
        self._bug: BaseException | None = None

    def instance(self, name: str) -> Part | None:
        """The running instance of a component (``None`` between restarts)."""
        for stage in self.stages:
            for slot in stage:
                if slot.component.name == name:
                    return slot.instance
        raise KeyError(name)

    async def run(self) -> None:
        """Start stage by stage, keep every component running until ``stop()``; then stop
        the stages in reverse. Raises :class:`GaveUp` once everything has stopped, if a
        component could not be kept running."""
        started: list[list[_Slot]] = []
        try:
            for stage in self.stages:
                started.append(stage)
                for slot in stage:
                    slot.task = asyncio.create_task(
                        self._keep(slot), name=f"component:{slot.component.name}"
                    )
                await self._wait_stage(stage)
                if self._stopping.is_set():
                    break
            else:
                self._started.set()
                if self.on_started is not None:
                    self.on_started()
            await self._stopping.wait()
        finally:
            for stage in reversed(started):
                await self._stop_stage(stage)
        if self._bug is not None:
            raise self._bug
        if self._gave_up is not None:
            raise self._gave_up

    async def _wait_stage(self, stage: list[_Slot]) -> None:
        """Until every component of the stage has started once, or the supervisor stops."""
        for slot in stage:
            waits = [
                asyncio.create_task(slot.started.wait()),
                asyncio.create_task(self._stopping.wait()),
            ]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in waits:
                    t.cancel()
                await asyncio.wait(waits)
            if self._stopping.is_set():
                return

    async def _stop_stage(self, stage: list[_Slot]) -> None:
        tasks = [s.task for s in stage if s.task is not None]
        for slot in stage:
            if slot.instance is not None:
                slot.instance.stop_soon()
        if not tasks:
            return
        began = time.monotonic()
        _, pending = await asyncio.wait(tasks, timeout=min(self.slow_stop, self.stop_timeout))
        if pending:
            log.warning(
                "component.stopping_slowly",
                components=[t.get_name() for t in pending],
                after=self.slow_stop,
                waiting=waiting_tasks(),
            )
            left = self.stop_timeout - (time.monotonic() - began)
            _, pending = await asyncio.wait(pending, timeout=max(left, 0.0))
        for t in pending:
            log.error("component.stop_timeout", component=t.get_name(), after=self.stop_timeout)
            t.cancel()
        if pending:
            await asyncio.wait(pending)
        for t in tasks:
            exc = None if t.cancelled() else t.exception()
            if exc is not None and self._bug is None:
                self._bug = exc  # _keep catches what run() raises: a bug of its own

    def _give_up(self, name: str, reason: str) -> None:
        log.error("component.gave_up", component=name, reason=reason)
        if self._gave_up is None:
            self._gave_up = GaveUp(name, reason)
        self.stop_soon()

    async def _keep(self, slot: _Slot) -> None:
        """Run the component, and again after each failure, until the supervisor stops."""
        c = slot.component
        delay = self.backoff
        failures: deque[float] = deque(maxlen=self.give_up_after)  # times of the last ones
        in_a_row = 0
        while not self._stopping.is_set():
            try:
                svc = c.factory()
            except Exception as exc:
                self._give_up(c.name, f"{c.name} cannot be built: {describe(exc)}")
                return
            slot.instance = svc
            began = time.monotonic()
            error: BaseException | None = None
            watch = asyncio.create_task(self._mark_started(slot, svc))
            try:
                await svc.run()
            except Exception as exc:
                error = exc
            finally:
                slot.instance = None
                watch.cancel()
                await asyncio.wait([watch])
            if self._stopping.is_set():
                if error is not None:
                    log.warning(
                        "component.stopped_with_error", component=c.name, error=describe(error)
                    )
                return
            reason = describe(error) if error is not None else "run() returned unasked"
            if error is not None and (fatal := c.fatal(error)):
                log.error("component.failed", component=c.name, error=reason)
                self._give_up(c.name, fatal)
                return
            now = time.monotonic()
            if now - began >= self.healthy_after:
                delay = self.backoff
                failures.clear()
                in_a_row = 0
            failures.append(now)
            in_a_row += 1
            log.error(
                "component.failed",
                component=c.name,
                error=reason,
                in_a_row=in_a_row,
                restart_in=delay,
            )
            if len(failures) == self.give_up_after and now - failures[0] <= self.window:
                self._give_up(
                    c.name,
                    f"{c.name} failed {self.give_up_after} times in {now - failures[0]:.0f} s; "
                    f"last: {reason}",
                )
                return
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
                return
            except TimeoutError:
                pass
            delay = min(delay * 2, self.max_backoff)
            slot.restarts += 1
            log.info("component.restarting", component=c.name, restarts=slot.restarts)

    @staticmethod
    async def _mark_started(slot: _Slot, svc: Part) -> None:
        await svc.wait_started()
        slot.started.set()
