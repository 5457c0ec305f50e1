"""The Restate side of ``jetloop bench peer``: a Restate server, the turn service on
hypercorn, and turns invoked over the server's HTTP ingress.

What runs, all on loopback and on ports picked free at start:

- **restate-server**, the native binary that the npm package ``@restatedev/restate-server``
  ships (``npm ci --prefix jetloop/tooling/bench/restate`` puts it under ``node_modules`` here, with
  install scripts off by this folder's ``.npmrc``; ``JETLOOP_RESTATE_SERVER`` may name another
  binary). It runs with its defaults except where the benchmark needs otherwise: every
  listener bound to 127.0.0.1 over TCP only (no Unix sockets), its data in the run's work
  directory (``--base-dir``), telemetry off (``RESTATE_DISABLE_TELEMETRY``: the daily usage
  ping), plain logs to a file. One thing no setting turns off: at start the server asks
  GitHub once for its latest release (``check_if_latest_version`` in its ``main.rs``);
  offline that lookup fails and the server goes on.
- **hypercorn** serving ``jetloop.tooling.bench.restate.service:app`` (the ``restate-sdk``
  ASGI app),
  registered as a deployment through the admin API (``POST /deployments``) before any turn
  is timed; the server discovers the turn service from it.
- **the driver**, in the benchmark's own process beside jetloop's driver: a turn is one
  ``POST /turn/run`` on the ingress with an ``idempotency-key`` (the turn's request id, as a
  jetloop request carries its ``Nats-Msg-Id`` and a DBOS workflow its id), and the response is
  the turn's answer; its latency runs from the request to the response.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import platform
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import aiohttp

from jetloop.services.embedded import free_port

HERE = Path(__file__).resolve().parent
SERVER_ENV = "JETLOOP_RESTATE_SERVER"
PYTHON_PACKAGES = ("restate", "hypercorn")  # import names of restate-sdk and hypercorn
INSTALL = "pip install -e '.[peer]' && npm ci --prefix jetloop/tooling/bench/restate"
START_SECONDS = 60.0
TURN_SECONDS = 60.0
SERVICE_APP = "jetloop.tooling.bench.restate.service:app"


def server_binary() -> Path | None:
    """The restate-server binary: ``JETLOOP_RESTATE_SERVER``, else the one the npm package
    installed for this platform under ``node_modules``; None when there is none."""
    named = os.environ.get(SERVER_ENV)
    if named:
        return Path(named) if Path(named).is_file() else None
    system = {"Linux": "linux", "Darwin": "darwin"}.get(platform.system())
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower()
    )
    if system is None or arch is None:
        return None
    path = HERE / "node_modules" / "@restatedev" / f"restate-server-{system}-{arch}" / "bin"
    binary = path / "restate-server"
    return binary if binary.is_file() else None


def missing() -> str | None:
    """What is not installed for the Restate side, as a sentence; None when all is."""
    lacking = []
    if server_binary() is None:
        lacking.append("the restate-server binary")
    lacking += [
        {"restate": "restate-sdk"}.get(p, p)
        for p in PYTHON_PACKAGES
        if importlib.util.find_spec(p) is None
    ]
    if not lacking:
        return None
    return f"Restate skipped: {', '.join(lacking)} not installed; to run it: {INSTALL}"


def server_env(base: Path, ingress: int, admin: int, fabric: int) -> dict[str, str]:
    """The server's settings, by its ``RESTATE_*`` variables (``--dump-config`` shows them)."""
    # The caller's own RESTATE_* settings (a config file among them) stay out.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("RESTATE_")}
    return {
        **inherited,
        "RESTATE_DISABLE_TELEMETRY": "true",
        "RESTATE_NODE_NAME": "bench",
        "RESTATE_LISTEN_MODE": "tcp",
        "RESTATE_BIND_IP": "127.0.0.1",
        "RESTATE_BIND_PORT": str(fabric),
        "RESTATE_ADVERTISED_ADDRESS": f"http://127.0.0.1:{fabric}/",
        "RESTATE_INGRESS__BIND_ADDRESS": f"127.0.0.1:{ingress}",
        "RESTATE_ADMIN__BIND_ADDRESS": f"127.0.0.1:{admin}",
        "RESTATE_LOG_FORMAT": "compact",
        "RESTATE_LOG_DISABLE_ANSI_CODES": "true",
    }


class RestateSide:
    """The server and the service started in ``base``, the deployment registered, turns
    invoked; ``stop`` ends both processes (each in a process group of its own)."""

    def __init__(self, base: Path, wrap: list[str] | None = None) -> None:
        """``wrap``: a command the server runs under (``jetloop.tooling.bench.syncs``)."""
        binary = server_binary()
        if binary is None:
            raise RuntimeError(missing() or "no restate-server binary")
        self.binary = binary
        self.base = base
        self.wrap = wrap or []
        self.ingress, self.admin, self.fabric, self.service_port = (
            free_port(),
            free_port(),
            free_port(),
            free_port(),
        )
        self.server: subprocess.Popen[bytes] | None = None
        self.service: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []
        self.http: aiohttp.ClientSession | None = None
        self.server_version = ""

    @property
    def ingress_url(self) -> str:
        return f"http://127.0.0.1:{self.ingress}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin}"

    def versions(self) -> dict[str, str]:
        return {
            "restate_server": self.server_version,
            "restate_sdk": metadata.version("restate-sdk"),
            "hypercorn": metadata.version("hypercorn"),
        }

    async def start(self) -> None:
        out = await asyncio.to_thread(
            subprocess.run, [str(self.binary), "--version"], capture_output=True, check=True
        )
        self.server_version = out.stdout.decode().split()[-1]
        self.base.mkdir(parents=True, exist_ok=True)
        self.server = self._spawn(
            [*self.wrap, str(self.binary), "--no-logo", "--base-dir", str(self.base / "data")],
            "restate-server.log",
            server_env(self.base, self.ingress, self.admin, self.fabric),
        )
        self.service = self._spawn(
            [
                sys.executable,
                "-m",
                "hypercorn",
                "--bind",
                f"127.0.0.1:{self.service_port}",
                "--log-level",
                "warning",
                SERVICE_APP,
            ],
            "restate-service.log",
            dict(os.environ),
        )
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await self._wait_ready()
        await self._register()

    def _spawn(self, argv: list[str], log: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        f = (self.base / log).open("wb")
        self._logs.append(f)
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path.cwd(),
            start_new_session=True,
        )

    async def _wait_ready(self) -> None:
        """Until the admin API answers ``/health`` and the service accepts connections."""
        assert self.http is not None
        deadline = time.monotonic() + START_SECONDS
        for url in (f"{self.admin_url}/health", f"{self.ingress_url}/restate/health"):
            while True:
                self._check_alive()
                try:
                    async with self.http.get(url) as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Restate did not answer {url} (see {self.base})")
                await asyncio.sleep(0.1)
        while True:
            self._check_alive()
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.service_port)
                writer.close()
                await writer.wait_closed()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"hypercorn did not listen (see {self.base})") from None
                await asyncio.sleep(0.1)

    def _check_alive(self) -> None:
        for name, proc in (("restate-server", self.server), ("hypercorn", self.service)):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}); logs in {self.base}")

    async def _register(self) -> None:
        """Register the service's deployment (the server discovers ``turn`` from it)."""
        assert self.http is not None
        body = {"uri": f"http://127.0.0.1:{self.service_port}"}
        async with self.http.post(f"{self.admin_url}/deployments", json=body) as resp:
            text = await resp.text()
            if resp.status >= 300:
                raise RuntimeError(f"registering the deployment failed ({resp.status}): {text}")

    async def start_turn(self, sid: str, rid: str, fan: int) -> asyncio.Future[float]:
        """Invoke one turn; the future resolves when its answer is back."""
        assert self.http is not None
        http = self.http
        url = f"{self.ingress_url}/turn/run"
        text = f"fan {fan}" if fan else "hello"

        async def call() -> float:
            async with http.post(
                url,
                json=text,
                headers={"idempotency-key": rid},
                timeout=aiohttp.ClientTimeout(total=TURN_SECONDS),
            ) as resp:
                answer: Any = await resp.json()
                if resp.status != 200 or answer != "ok":
                    raise RuntimeError(f"turn {rid} answered {resp.status}: {answer!r}")
            return time.perf_counter()

        return asyncio.ensure_future(call())

    async def query(self, sql: str) -> list[dict[str, Any]]:
        """A SQL query on the server's introspection tables (the admin API's ``/query``)."""
        assert self.http is not None
        async with self.http.post(
            f"{self.admin_url}/query", json={"query": sql}, headers={"accept": "application/json"}
        ) as resp:
            data: dict[str, Any] = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"query failed ({resp.status}): {data}")
            rows: list[dict[str, Any]] = data.get("rows", [])
            return rows

    async def journal_per_turn(self) -> dict[str, float]:
        """Journal entries per completed turn, by type (``Command: Run`` is one per step)."""
        turns = await self.query(
            "SELECT count(*) AS n FROM sys_invocation WHERE target_service_name = 'turn'"
            " AND status = 'completed'"
        )
        n = int(turns[0]["n"]) if turns else 0
        rows = await self.query(
            "SELECT entry_type, count(*) AS n FROM sys_journal GROUP BY entry_type"
        )
        return {str(r["entry_type"]): int(r["n"]) / n for r in rows} if n else {}

    async def stop(self) -> None:
        """Close the client, then end the service and the server (SIGTERM, then SIGKILL)."""
        if self.http is not None:
            await self.http.close()
            self.http = None
        for proc in (self.service, self.server):
            if proc is None or proc.poll() is not None:
                continue
            # The whole group: hypercorn serves from a worker process of its own.
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
        self.service = self.server = None
        for f in self._logs:
            f.close()
        self._logs.clear()
