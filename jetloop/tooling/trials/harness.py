"""A fault harness for tests on real processes: workers you can kill, stop and hold.

``WorkerProcess`` runs ``jetloop worker`` as a subprocess with JSON logs in a file, and
waits on its log lines (not on sleeps). Together with ``EmbeddedServer`` (SIGKILL and
restart on the same store) it is what the crash tests are made of; users can test their
own tools the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from jetloop.tooling.releases import BuiltRelease

LogLine = dict[str, Any]


@asynccontextmanager
async def work_dir(keep: Path | None, prefix: str) -> AsyncIterator[Path]:
    """Where a run keeps its logs and stores: ``keep`` (made if needed, left in place), or a
    temporary directory named ``<prefix>…``, removed afterwards."""
    if keep is not None:
        await asyncio.to_thread(keep.mkdir, parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        yield Path(d)


class WorkerProcess:
    def __init__(
        self,
        nats_url: str,
        app: str,
        log_path: Path,
        *,
        worker_id: str,
        env: Mapping[str, str] | None = None,
        pools: str | None = None,
        hold: str | None = None,
        release_file: Path | None = None,
        processes: int = 1,
        namespaces: str | None = None,
        release: BuiltRelease | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.release = release  # another release's worker (``jetloop.tooling.releases``)
        self.namespaces = namespaces  # ``--namespace``: ``all``, or one
        self.processes = processes  # > 1: a parent of that many worker processes
        self.app = app
        self.log_path = log_path
        self.worker_id = worker_id
        self.pools = pools
        self.env = dict(env or {})
        if hold:
            self.env["JETLOOP_FAULT_HOLD"] = hold
        if release_file is not None:
            self.env["JETLOOP_FAULT_RELEASE"] = str(release_file)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        env = {**os.environ, "JETLOOP_LOG_LEVEL": "debug", **self.env}
        cli = [sys.executable, "-m", "jetloop.services.cli"]
        if self.release is not None:
            env, cli = self.release.env(env), self.release.cli()
        argv = [
            *cli,
            "worker",
            "--app",
            self.app,
            "--nats",
            self.nats_url,
            *(["--pools", self.pools] if self.pools else []),
            "--id",
            self.worker_id,
            *(["--processes", str(self.processes)] if self.processes != 1 else []),
            *(["--namespace", self.namespaces] if self.namespaces else []),
        ]
        return self._spawn(argv, env)

    def _spawn(self, argv: list[str], env: dict[str, str]) -> Self:
        """The process, in a session of its own, its output appended to the log."""
        out = open(self.log_path, "ab")  # handed to the child
        self.proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        out.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL: the worker dies wherever it is."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait()

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def terminate(self, timeout: float = 30.0) -> int | None:
        if not self.alive():
            return self.proc.returncode if self.proc else None
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def lines(self) -> list[LogLine]:
        out: list[LogLine] = []
        if not self.log_path.exists():
            return out
        for raw in self.log_path.read_text(errors="replace").splitlines():
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(line, dict) and self._mine(line.get("worker", self.worker_id)):
                out.append(line)
        return out

    def _mine(self, worker: object) -> bool:
        """A line of this worker, or with ``processes`` > 1 of one of its children
        (``<id>-<i>``, see ``jetloop.services.processes``)."""
        if worker == self.worker_id:
            return True
        return self.processes > 1 and str(worker).startswith(f"{self.worker_id}-")

    def find(self, event: str, **match: Any) -> list[LogLine]:
        return [
            ln
            for ln in self.lines()
            if ln.get("event") == event and all(ln.get(k) == v for k, v in match.items())
        ]

    async def wait_for(
        self,
        event: str,
        timeout: float = 30.0,
        where: Callable[[LogLine], bool] | None = None,
        **match: Any,
    ) -> LogLine:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ln in self.find(event, **match):
                if where is None or where(ln):
                    return ln
            if not self.alive():
                raise RuntimeError(
                    f"worker {self.worker_id} exited ({self.proc.returncode if self.proc else '?'})"
                    f" before logging {event}; log tail:\n{self.tail()}"
                )
            await asyncio.sleep(0.05)
        raise TimeoutError(
            f"worker {self.worker_id} did not log {event} {match} in {timeout}s;"
            f" log tail:\n{self.tail()}"
        )

    def tail(self, n: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


class CommandWorker(WorkerProcess):
    """A worker started by a command of its own (a tool worker in another language, such as
    ``node workers/node/dist/src/cli.js --app tools.js``), given ``--id <worker id>`` and the
    environment; it logs JSON lines with ``event`` and ``worker`` as jetloop's workers do, so
    the same waits and finds read it."""

    def __init__(
        self,
        command: Sequence[str],
        log_path: Path,
        *,
        worker_id: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__("", "", log_path, worker_id=worker_id, env=env)
        self.command = list(command)

    def start(self) -> CommandWorker:
        return self._spawn([*self.command, "--id", self.worker_id], {**os.environ, **self.env})
