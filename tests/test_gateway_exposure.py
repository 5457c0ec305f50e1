"""Who can reach the gateway and how long they can hold it (issue 13, findings 5 and 6),
against real `jetloop up` / `jetloop gateway` processes and raw sockets."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from jetloop.services.embedded import EmbeddedServer, free_port
from tests.conftest import SEAL_KEY, until

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
MAX_CONNECTIONS = 4


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment without any JETLOOP_ setting of the caller's, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETLOOP_")}
    env["JETLOOP_STORE_DIR"] = str(tmp_path / "store")
    env["JETLOOP_VENDOR_DB"] = str(tmp_path / "vendor.sqlite")
    env["JETLOOP_LOG_FORMAT"] = "console"
    return {**env, **extra}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "jetloop.services.cli", *args]


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a command that must end by itself (a refusal): its output."""
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=30)


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT)


def read(log: Path) -> str:
    return log.read_text()


def alive(proc: subprocess.Popen[bytes], log: Path) -> None:
    assert proc.poll() is None, log.read_text()


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(10)


# --- finding 5: anonymous scopes off loopback ---------------------------------------------


def test_up_without_tokens_refuses_a_public_address(
    nats_ready: EmbeddedServer, tmp_path: Path
) -> None:
    """`jetloop up` with no tokens on 0.0.0.0 would give every scope to anyone who reaches
    the port: it exits at once with one line naming the settings (before the fix it served)."""
    out = run(
        cli("up", "--nats", nats_ready.url, "--gateway-port", str(free_port())),
        clean_env(tmp_path, JETLOOP_GATEWAY_HOST="0.0.0.0"),
    )
    assert out.returncode != 0, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for name in ("JETLOOP_GATEWAY_TOKENS", "JETLOOP_GATEWAY_HOST", "--allow-anonymous-remote"):
        assert name in lines[0]
    assert "Traceback" not in out.stderr


async def test_gateway_anonymous_remote_only_when_allowed(
    nats_ready: EmbeddedServer, tmp_path: Path
) -> None:
    """`jetloop gateway` with anonymous scopes on 0.0.0.0 refuses in one line; with
    --allow-anonymous-remote it serves them and logs a warning saying so."""
    port = free_port()
    # The seal key too: a gateway without it refuses to read state (503), by design.
    env = clean_env(
        tmp_path, JETLOOP_GATEWAY_ANONYMOUS_SCOPES='["read"]', JETLOOP_SEAL_KEY=SEAL_KEY
    )
    args = cli("gateway", "--nats", nats_ready.url, "--host", "0.0.0.0", "--port", str(port))
    out = run(args, env)
    assert out.returncode != 0 and "--allow-anonymous-remote" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr

    log = tmp_path / "gateway.log"
    proc = start([*args, "--allow-anonymous-remote"], env, log)
    try:
        async with aiohttp.ClientSession() as http:

            async def snapshot() -> int | None:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/v1/sessions/nobody") as r:
                        return r.status
                except aiohttp.ClientConnectionError:
                    alive(proc, log)
                    return None

            # Anonymous, read scope: the session is looked up (404), not refused (401).
            assert await until(snapshot, 30) == 404
        assert "gateway.anonymous_remote" in read(log)
    finally:
        stop(proc)


# --- finding 6: slow and many clients -----------------------------------------------------


@pytest.fixture
async def slow_gateway(nats_ready: EmbeddedServer, tmp_path: Path) -> AsyncIterator[int]:
    """A `jetloop gateway` process with one-second header and body deadlines and room for
    four connections; yields its port."""
    port = free_port()
    env = clean_env(
        tmp_path,
        JETLOOP_GATEWAY_TOKENS='{"tok-0123456789abcdef": ["read", "write"]}',
        JETLOOP_GATEWAY_HEADER_TIMEOUT_SECONDS=str(HEADER_TIMEOUT),
        JETLOOP_GATEWAY_BODY_TIMEOUT_SECONDS=str(BODY_TIMEOUT),
        JETLOOP_GATEWAY_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
    )
    log = tmp_path / "gateway.log"
    proc = start(cli("gateway", "--nats", nats_ready.url, "--port", str(port)), env, log)
    try:
        assert await until(lambda: healthy(port, proc, log), 30)
        yield port
    finally:
        stop(proc)


async def healthy(port: int, proc: subprocess.Popen[bytes], log: Path) -> bool:
    alive(proc, log)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    got = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return got.startswith(b"HTTP/1.1 200")


async def dribble(writer: asyncio.StreamWriter, every: float = 0.25) -> None:
    """One byte every ``every`` seconds, until the server closes the connection."""
    try:
        while True:
            await asyncio.sleep(every)
            writer.write(b"a")
            await writer.drain()
    except (ConnectionError, OSError):
        return


async def held_for(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> tuple[float, bytes]:
    """Dribble until the server closes: how long that took, and what it answered. A close
    that finds a dribbled byte not yet read reaches us as a reset (the kernel's answer to
    unread data), which is as closed as an end of stream: what came before it is the answer."""
    t0 = time.monotonic()
    task = asyncio.create_task(dribble(writer))
    got = b""
    try:
        async with asyncio.timeout(20):
            while chunk := await reader.read(65536):
                got += chunk
    except ConnectionResetError:
        pass
    finally:
        task.cancel()
        writer.close()
    return time.monotonic() - t0, got


async def test_dribbled_headers_are_cut_off(slow_gateway: int) -> None:
    """Headers sent a byte at a time: the connection is closed after the header timeout
    (before: held for aiohttp's 75 s keep-alive)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", slow_gateway)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    took, got = await held_for(reader, writer)
    assert took < HEADER_TIMEOUT + 1.5, took
    assert got == b""  # no request was made: nothing to answer


async def test_dribbled_body_gets_408(slow_gateway: int) -> None:
    """A body sent a byte at a time: 408 after the body timeout, then the connection closes
    (an unread rest is drained at most that long again)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", slow_gateway)
    writer.write(
        b"POST /v1/agents/tester/sessions/s/messages HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer tok-0123456789abcdef\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    took, got = await held_for(reader, writer)
    assert got.startswith(b"HTTP/1.1 408"), got
    assert b"request body too slow" in got
    assert took < 2 * BODY_TIMEOUT + 1.5, took


async def test_connections_are_capped(slow_gateway: int) -> None:
    """Many half-open requests: only MAX_CONNECTIONS are held (and only until the header
    timeout); the rest are answered 503 at once; afterwards the gateway serves again."""
    conns = []
    for _ in range(MAX_CONNECTIONS):
        reader, writer = await asyncio.open_connection("127.0.0.1", slow_gateway)
        writer.write(b"GET /healthz HTTP/1.1\r\n")  # half a request
        conns.append((reader, writer))
    await asyncio.sleep(0.1)  # let the server accept them before the next ones
    t0 = time.monotonic()
    refused = []
    for _ in range(50):
        reader, writer = await asyncio.open_connection("127.0.0.1", slow_gateway)
        refused.append(await asyncio.wait_for(reader.read(), 5))
        writer.close()
    assert time.monotonic() - t0 < HEADER_TIMEOUT  # answered at once, not timed out
    assert all(r.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in r for r in refused)
    for reader, writer in conns:  # the held ones end at the header timeout
        assert await asyncio.wait_for(reader.read(), HEADER_TIMEOUT + 2) == b""
        writer.close()

    async def serves() -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", slow_gateway)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return got.startswith(b"HTTP/1.1 200")

    assert await until(serves, 5)
