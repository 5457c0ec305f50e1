"""The gateway's smaller holes (issue 29, finding 6), from outside where it can be: token
guessing limited and short tokens refused, no request bytes in the log, a private store,
names checked whole, an aiohttp without the known request-parser flaws."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import tomllib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from jetloop.schemas import validate_name
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer, free_port
from jetloop.services.gateway.config import fingerprint
from jetloop.services.gateway.http import AuthFailures
from jetloop.services.readmodel.model import ReadModel
from jetloop.services.up import lock_store
from jetloop.streams.connection import connect
from tests.conftest import SEAL_KEY, until
from tests.test_gateway_exposure import clean_env, cli, healthy, run, start, stop

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "good-token-0123456789abcdef"
SECRET = "secretTOKEN-never-logged-42"
FAILURES = 5


@dataclass
class RunningGateway:
    port: int
    log: Path

    async def ask(self, request: bytes) -> tuple[bytes, bool]:
        """Send raw bytes on a new connection: the answer, and whether the server then closed
        the connection (the request asks to keep it open)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            body = await asyncio.wait_for(reader.readexactly(length), 5)
            try:
                rest = await asyncio.wait_for(reader.read(1), 2)
            except TimeoutError:
                rest = None  # still open
            return head + body, rest == b""
        finally:
            writer.close()

    def get(self, path: str, token: str | None) -> bytes:
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        return (
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n{auth}"
            "Connection: keep-alive\r\n\r\n"
        ).encode()


@pytest.fixture
async def gateway(nats_ready: EmbeddedServer, tmp_path: Path) -> AsyncIterator[RunningGateway]:
    """A `jetloop gateway` process with one token and room for FAILURES unknown tokens per
    address per minute."""
    port = free_port()
    env = clean_env(
        tmp_path,
        JETLOOP_GATEWAY_TOKENS=json.dumps({TOKEN: {"name": "good", "scopes": ["read"]}}),
        JETLOOP_GATEWAY_MAX_AUTH_FAILURES=str(FAILURES),
        JETLOOP_GATEWAY_AUTH_FAILURE_WINDOW_SECONDS="60",
        JETLOOP_SEAL_KEY=SEAL_KEY,
    )
    log = tmp_path / "gateway.log"
    proc = start(cli("gateway", "--nats", nats_ready.url, "--port", str(port)), env, log)
    try:
        assert await until(lambda: healthy(port, proc, log), 30)
        yield RunningGateway(port, log)
    finally:
        stop(proc)


# --- token guessing and token length -------------------------------------------------------


async def test_token_guesses_are_limited(gateway: RunningGateway) -> None:
    """Unknown tokens get 401 and a closed connection; after FAILURES of them the address
    gets 429 with Retry-After, problem+json and a closed connection, the right token too (it
    is not looked at); open routes still answer (before: unlimited guesses, 6,900/s)."""
    for i in range(FAILURES):
        got, closed = await gateway.ask(gateway.get("/v1/whoami", f"wrong-guess-{i:010d}"))
        assert got.startswith(b"HTTP/1.1 401") and b"invalid token" in got, got
        assert closed, "a guess costs a connection"
    got, closed = await gateway.ask(gateway.get("/v1/whoami", TOKEN))
    assert got.startswith(b"HTTP/1.1 429"), got
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"Content-Type: application/problem+json" in head
    retry = next(h for h in head.split(b"\r\n") if h.startswith(b"Retry-After:"))
    assert 0 < int(retry.split(b":")[1]) <= 60
    assert json.loads(body)["status"] == 429 and closed
    got, _ = await gateway.ask(gateway.get("/healthz", None))
    assert got.startswith(b"HTTP/1.1 200"), got
    log = gateway.log.read_text()
    assert "gateway.auth_limited" in log and TOKEN not in log


def test_failure_counts_are_bounded_and_expire() -> None:
    """The limiter forgets a window once it ends, counts IPv6 clients by /64, and remembers
    at most `capacity` addresses (the least recent goes first)."""
    now = [0.0]
    f = AuthFailures(limit=3, window=10, capacity=100, clock=lambda: now[0])
    assert [f.failed("10.0.0.1") for _ in range(3)] == [False, False, True]
    assert f.blocked("10.0.0.1") == 10
    now[0] = 9.5
    assert f.blocked("10.0.0.1") == 0.5
    now[0] = 10.0
    assert f.blocked("10.0.0.1") is None and not f.failed("10.0.0.1")
    assert f.key("2001:db8::1") == f.key("2001:db8::ffff:2") == "2001:db8::/64"
    assert f.key("::ffff:10.0.0.1") == "10.0.0.1"
    for i in range(1000):
        f.failed(f"10.1.{i // 256}.{i % 256}")
    assert len(f.seen) == 100 and "10.0.0.1" not in f.seen


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_short_token_is_a_config_error(
    command: str, nats_ready: EmbeddedServer, tmp_path: Path
) -> None:
    """`jetloop gateway` and `jetloop up` with a token shorter than 16 characters exit at once
    with one line naming JETLOOP_GATEWAY_TOKENS and the token's fingerprint, never the token
    (before: any token, one character too, was served)."""
    short = "s3cret-tok"
    env = clean_env(tmp_path, JETLOOP_GATEWAY_TOKENS=json.dumps({short: ["read"]}))
    args = ["--port", str(free_port())] if command == "gateway" else ["--gateway-port", "0"]
    out = run(cli(command, "--nats", nats_ready.url, *args), env)
    assert out.returncode != 0, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "JETLOOP_GATEWAY_TOKENS" in lines[0] and "at least 16" in lines[0]
    assert fingerprint(short) in lines[0] and short not in out.stdout + out.stderr


# --- request bytes in the log ---------------------------------------------------------------


async def test_malformed_requests_leave_no_bytes_in_the_log(gateway: RunningGateway) -> None:
    """Requests aiohttp cannot parse, with a bearer token on the bad line or before it, are
    answered 400 and logged as one `http.bad_request` line each: no traceback, no request
    byte, no token (before: aiohttp's traceback quoted the offending line, token and all)."""
    host = f"Host: 127.0.0.1:{gateway.port}\r\n".encode()
    bad = [
        b"GET /v1/whoami HTTP/1.1\r\n"
        + host
        + f"Authorization: Bearer {SECRET}\x01\r\n\r\n".encode(),
        b"GET /v1/whoami HTTP/1.1\r\n"
        + host
        + f"Authorization: Bearer {SECRET}\r\nBad Header Line\r\n\r\n".encode(),
    ]
    for request in bad:
        got, _ = await gateway.ask(request)
        assert got.startswith(b"HTTP/1.1 400") or got.startswith(b"HTTP/1.0 400"), got

    async def logged() -> bool:
        return gateway.log.read_text().count("http.bad_request") >= len(bad)

    assert await until(logged, 10)
    log = gateway.log.read_text()
    assert SECRET not in log and "Bearer" not in log and "Traceback" not in log, log


# --- names checked whole --------------------------------------------------------------------


async def test_trailing_newline_in_a_name_is_refused(
    gateway: RunningGateway, nats_ready: EmbeddedServer
) -> None:
    """A session id with a trailing newline (`abc%0A` in a path) is refused with 422
    problem+json naming the field, by the gateway and by the Python client (before: it passed
    the check and reached NATS, which refused the subject: a send was answered 503 "NATS
    unavailable")."""
    got, _ = await gateway.ask(gateway.get("/v1/sessions/abc%0A", TOKEN))
    assert got.startswith(b"HTTP/1.1 422"), got
    body = json.loads(got.partition(b"\r\n\r\n")[2])
    assert body["title"] == "invalid session" and "abc\\n" in body["detail"]
    with pytest.raises(ValueError, match="session id 'abc\\\\n' is not valid"):
        validate_name("session id", "abc\n")
    nc = await connect([nats_ready.url], "test-names")
    try:
        with pytest.raises(ValueError, match="session id"):
            await Client(nc).send("tester", "abc\n", "hi")
        with pytest.raises(ValueError, match="agent"):
            await Client(nc).send("tester\n", "abc", "hi")
    finally:
        await nc.close()


def test_cli_refuses_a_trailing_newline(nats_ready: EmbeddedServer, tmp_path: Path) -> None:
    """`jetloop send --session 'abc\\n'` ends with one line saying the session id is not
    valid."""
    env = clean_env(tmp_path, JETLOOP_SEAL_KEY=SEAL_KEY)
    args = ["send", "--nats", nats_ready.url, "--agent", "tester", "--session", "abc\n", "hi"]
    out = run(cli(*args), env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "session id 'abc\\n' is not valid" in out.stderr, out.stderr


# --- the store's file modes -----------------------------------------------------------------


async def test_store_and_read_model_are_private(tmp_path: Path) -> None:
    """The store directory `up` makes is 0700, and one found 0755 is tightened; the read
    model's database and its -wal and -shm files are 0600, and 0644 ones from before are
    tightened (before: 0755 and 0644, every conversation readable by every local user)."""
    before = os.umask(0o022)  # the usual one, which gave 0755 and 0644
    try:
        await private_store_and_read_model(tmp_path)
    finally:
        os.umask(before)


async def private_store_and_read_model(tmp_path: Path) -> None:
    store = tmp_path / "new-store"
    lock_store(store).close()
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    old = tmp_path / "old-store"
    old.mkdir(mode=0o755)
    lock_store(old).close()
    assert stat.S_IMODE(old.stat().st_mode) == 0o700

    db = store / "readmodel.sqlite"
    async with await ReadModel.open(db) as model:
        await model.prepare()
        async with await ReadModel.open(db, readonly=True) as reader:
            await reader.db.execute("SELECT 1")
            files = [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
            assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    for f in store.glob("readmodel.sqlite*"):
        f.chmod(0o644)
    async with await ReadModel.open(db) as model:
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in store.glob("readmodel*"))


# --- the aiohttp we accept ------------------------------------------------------------------


def test_aiohttp_minimum_has_the_parser_fixes() -> None:
    """pyproject admits no aiohttp before 3.14.3 (the request-smuggling and parser fixes of
    2024-2026, CVE-2025-53643 among them), and the installed one satisfies it (before:
    `aiohttp>=3.9`)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    req = next(Requirement(d) for d in deps if Requirement(d).name == "aiohttp")
    floor = min(Version(s.version) for s in req.specifier if s.operator == ">=")
    assert floor >= Version("3.14.3"), req
    assert version("aiohttp") in req.specifier
    assert not req.specifier.contains("3.12.13") and not req.specifier.contains("3.13.3")
