"""The repository's example MCP server (examples/mcp_ledger/server.py) as the tests run it: its
invocation log and state files, and its process when it is served over streamable HTTP (over
stdio the worker runs it: tests/apps_mcp.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.apps_mcp import SERVER


def invocations(log: Path) -> list[dict[str, Any]]:
    """The ledger server's log: one line per invocation, in order."""
    if not log.exists():
        return []
    return [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()]


def keys_of(log: Path, tool: str) -> list[str]:
    return [i["key"] for i in invocations(log) if i["tool"] == tool]


@dataclass
class Ledger:
    """The files of one ledger server, and its process when the test runs it over HTTP."""

    log: Path
    state: Path
    proc: subprocess.Popen[bytes] | None = None
    url: str | None = None

    def env(self, **extra: str) -> dict[str, str]:
        out = {"MCP_LEDGER_LOG": str(self.log), "MCP_LEDGER_STATE": str(self.state), **extra}
        if self.url:
            out["TEST_MCP_URL"] = self.url
        return out

    def start_http(self, **extra: str) -> None:
        """(Re)start the server over streamable HTTP on its port (a new one the first time)."""
        if self.url is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.url = f"http://127.0.0.1:{port}/mcp"
        port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        env = {**os.environ, **self.env(**extra)}
        env.pop("TEST_MCP_URL", None)
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), "--http", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("the MCP ledger server did not open its port")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
