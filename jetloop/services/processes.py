"""Worker processes: a worker per core, each its own Python process, under one parent.

A worker is CPU-bound (docs/performance.md): one process uses one core, however many steps
it runs at once. ``jetloop worker --processes N`` and ``jetloop up --workers N``
(``JETLOOP_WORKER_PROCESSES``) run N of them. Each child is
``python -m jetloop.services.cli worker``
with a worker id of its own, ``<id>-<i>`` (claims, presence in ``jl_workers`` and logs name
it), the parent's settings in its environment (``Settings.as_env``) but the seal key kept in
the store directory (the child reads it there, as every process beside ``jetloop up`` does)
and, when the parent serves metrics on port P, its own metrics port P+i-1.

A child is a component of the parent's supervisor (``jetloop.services.supervisor``): one that exits
while nobody asked it to stop is logged (``component.failed``, ``worker.process_exited``)
and started again after a growing pause; the parent gives up, stopping the rest, only when a
child fails again and again right at start (an app that cannot run, a server that refuses
it). Stopping the parent sends each child SIGTERM, so each drains its steps as a lone worker
does, and SIGKILL to one still running a grace period after that.

The children run in a session of their own, so Ctrl-C in a terminal reaches only the parent,
which stops them in its order (``up`` stops the gateway before its workers); and they die
with the parent, even by ``kill -9`` (Linux, ``PR_SET_PDEATHSIG``), leaving their steps to
the rescue any dead worker's steps get. With N = 1 the worker runs in the process itself,
as it always did.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence

import structlog

from jetloop.services.embedded import die_with_parent
from jetloop.services.lifecycle import Service
from jetloop.services.settings import Settings, read_seal_key
from jetloop.services.supervisor import Component, Supervisor

log = structlog.get_logger("jetloop.processes")

# Beyond the drain: the time a stopping worker takes to withdraw its presence and close.
CLOSE_SECONDS = 15.0


class ChildExited(RuntimeError):
    """A worker process ended while nobody asked it to: the supervisor starts another."""


def child_id(base: str, number: int) -> str:
    """The worker id of child ``number`` (from 1) of a parent named ``base``."""
    return f"{base}-{number}"


class ChildWorker(Service):
    """One worker child process as a supervisor's component: ``run()`` starts it (and then it
    counts as started) and returns when it has stopped after ``stop_soon()``; it raises
    :class:`ChildExited` when the process ends on its own."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], worker_id: str, grace: float):
        super().__init__()
        self.argv = list(argv)
        self.env = env
        self.worker_id = worker_id
        self.grace = grace
        self.pid: int | None = None

    async def run(self) -> None:
        if self._stopping.is_set():
            return  # stopped before it began: nothing to start
        proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # one prctl call: safe between fork and exec
        )
        self.pid = proc.pid
        log.info("worker.process_started", child=self.worker_id, pid=proc.pid)
        self._started.set()
        exited = asyncio.ensure_future(proc.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((exited, stopping), return_when=asyncio.FIRST_COMPLETED)
            if not exited.done():
                proc.send_signal(signal.SIGTERM)  # drain, as a lone worker does on SIGTERM
                done, _ = await asyncio.wait((exited,), timeout=self.grace)
                if not done:
                    log.error("worker.process_kill", child=self.worker_id, after=self.grace)
                    proc.kill()
            await exited
        finally:
            stopping.cancel()
            if proc.returncode is None:  # cancelled (the supervisor's own stop timeout)
                proc.kill()
                exited.cancel()
                await proc.wait()
        how = exit_status(proc.returncode)
        if not self._stopping.is_set():
            log.error("worker.process_exited", child=self.worker_id, pid=proc.pid, status=how)
            raise ChildExited(f"worker {self.worker_id} (pid {proc.pid}) {how}")
        log.info("worker.process_stopped", child=self.worker_id, pid=proc.pid, status=how)


def exit_status(returncode: int | None) -> str:
    """How a process ended, in words."""
    if returncode is None:
        return "is running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def child_components(
    settings: Settings,
    base_id: str,
    numbers: Sequence[int],
    pools: Sequence[str] | None = None,
    log_format: str | None = None,
    name: str = "worker",
) -> list[Component]:
    """A supervisor's component for each child ``number``: ``<name>-<number>``, running
    ``jetloop worker --id <base_id>-<number>`` with ``settings`` (``log_format`` instead of
    theirs when given) and the pools given (default all)."""
    grace = settings.drain_seconds + CLOSE_SECONDS
    # The store directory's key is read there by the child (``jetloop.services.settings``):
    # kept out of its environment, which its own children (a tool's subprocess) inherit.
    stored_key = settings.seal_key is not None and settings.seal_key == read_seal_key(
        settings.store_dir
    )
    out = []
    for n in numbers:
        wid = child_id(base_id, n)
        argv = [sys.executable, "-m", "jetloop.services.cli", "worker", "--id", wid]
        if pools is not None:
            argv += ["--pools", ",".join(pools)]
        port = settings.metrics_port
        env = {
            **os.environ,
            **settings.as_env(
                worker_processes=1,
                worker_id=wid,
                metrics_port=port + n - 1 if port else port,
                log_format=log_format or settings.log_format,
                store_dir=settings.store_dir,
                seal_key=None if stored_key else settings.seal_key,
            ),
        }

        def factory(
            argv: list[str] = argv, env: dict[str, str] = env, wid: str = wid
        ) -> ChildWorker:
            return ChildWorker(argv, env, wid, grace)

        out.append(Component(f"{name}-{n}", factory))
    return out


async def run_worker_processes(
    settings: Settings, base_id: str, pools: Sequence[str] | None
) -> None:
    """``jetloop worker --processes N``: N children until SIGINT or SIGTERM, then each drains
    and the parent returns once all have stopped;
    :class:`~jetloop.services.supervisor.GaveUp` when a child cannot be kept running (the
    others stopped first)."""
    n = settings.worker_processes
    children = child_components(settings, base_id, range(1, n + 1), pools)
    sup = Supervisor(
        [children],
        stop_timeout=settings.drain_seconds + 2 * CLOSE_SECONDS,
        on_started=lambda: log.info("worker.processes", processes=n, worker=base_id),
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.stop_soon)
    try:
        await sup.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
