"""The seal key `jetloop up` keeps in its store directory is found by every process that
writes state beside it: the CLI, the gateway, another worker. None of them gets the key
through the environment here; they read ``<store dir>/seal.key``."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import msgpack
import pytest

from jetloop.schemas.errors import SettingsError
from jetloop.services.client import Client
from jetloop.services.embedded import free_port
from jetloop.services.natsauth import url_as
from jetloop.services.settings import load_settings, make_seal_key
from jetloop.streams.seal import Sealer, key_bytes
from jetloop.tooling.releases import BuiltRelease
from tests.conftest import SEAL_KEY, WorkerFactory, call, script, until
from tests.test_up import wait_ready

# What would hand a process the key some other way than the store directory.
KEY_VARS = ("JETLOOP_SEAL_KEY", "JETLOOP_SEAL_OLD_KEYS", "JETLOOP_STORE_DIR")


def env_without_key(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in KEY_VARS}
    return {**env, **extra}


class Up:
    """`jetloop up` in a working directory, as a person runs it: the store is `.jetloop`."""

    def __init__(
        self,
        cwd: Path,
        gateway_port: int = 0,
        release: BuiltRelease | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``release``: another release's `up` (``jetloop.tooling.releases``); ``env``: more
        of its environment."""
        self.cwd = cwd
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.gateway_port = gateway_port
        self.release = release
        self.env = env or {}
        self.log = cwd / "up.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = env_without_key(
            JETLOOP_VENDOR_DB=str(self.cwd / "vendor.sqlite"),
            JETLOOP_GATEWAY_PORT=str(self.gateway_port),
            **self.env,
        )
        cli = [sys.executable, "-m", "jetloop.services.cli"]
        if self.release is not None:
            env, cli = self.release.env(env), self.release.cli()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*cli, "up", "--port", str(self.port)],
                cwd=self.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    async def client(self) -> Client:
        """A client that verifies every record it reads under the key up keeps."""
        assert self.proc is not None
        await asyncio.to_thread(wait_ready, self.proc, self.log)
        key = (self.cwd / ".jetloop" / "seal.key").read_text()
        url = url_as(self.url, self.cwd / ".jetloop")
        return await Client.connect(url, sealer=Sealer([key_bytes(key)]))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    u = Up(tmp_path, gateway_port=free_port())
    u.start()
    yield u
    u.stop()


@pytest.fixture
async def up_client(up: Up) -> AsyncIterator[Client]:
    c = await up.client()
    yield c
    await c.close()


async def waiting_turn(c: Client, session: str) -> str:
    """Send a turn that waits on a timer; return its id once it waits."""
    h = await c.send("demo", session, "wait 30 seconds")

    async def waits() -> bool:
        snap = await c.snapshot(session)
        return snap is not None and snap.status == "waiting" and bool(snap.timers)

    await until(waits)
    return h.turn_id


async def cancelled_then_next_completes(c: Client, session: str, turn_id: str) -> None:
    """The cancelled turn ends cancelled (its record verifies), and the session moves on."""
    t = await c.turn(session, turn_id)
    assert t is not None and t.status.value == "cancelled", t
    h = await c.send("demo", session, "create ticket after the cancel")
    res = await c.wait(h, timeout=30)
    assert res.text is not None and "T-1" in res.text, res


async def test_cli_cancel_beside_up_is_sealed(up: Up, up_client: Client) -> None:
    """`jetloop cancel` in up's working directory, with no key in its environment, seals
    the cancelled turn with up's key: the turn ends cancelled, the next one runs."""
    turn_id = await waiting_turn(up_client, "cli")
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "jetloop.services.cli", "cancel", "cli", "--nats", up.url],
        cwd=up.cwd,
        env=env_without_key(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"turn {turn_id}: cancelled" in out.stdout
    await cancelled_then_next_completes(up_client, "cli", turn_id)


async def test_gateway_cancel_in_up_is_sealed(up: Up, up_client: Client) -> None:
    """The gateway's REST cancel seals the turn record with the store's key."""
    turn_id = await waiting_turn(up_client, "rest")
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://127.0.0.1:{up.gateway_port}/v1/sessions/rest/cancel", json={}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        got = await resp.json()
    assert got["turn_id"] == turn_id and got["status"] == "cancelled", got
    await cancelled_then_next_completes(up_client, "rest", turn_id)


def test_settings_find_the_store_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No JETLOOP_SEAL_KEY: the key in the store directory (.jetloop, or JETLOOP_STORE_DIR)
    seals; JETLOOP_SEAL_KEY, when set, wins; a key file that cannot be read fails at start
    with the setting's name."""
    for var in KEY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    assert load_settings().sealer() is None
    key = make_seal_key(Path(".jetloop"))
    assert (tmp_path / ".jetloop" / "seal.key").stat().st_mode & 0o777 == 0o600
    assert make_seal_key(Path(".jetloop")) == key  # made once
    sealer = load_settings().sealer()
    assert sealer is not None and sealer.keys == [key_bytes(key)]
    monkeypatch.setenv("JETLOOP_SEAL_KEY", "")  # empty is unset, not an empty key
    sealer = load_settings().sealer()
    assert sealer is not None and sealer.keys == [key_bytes(key)]
    monkeypatch.setenv("JETLOOP_STORE_DIR", str(tmp_path / "other"))
    assert load_settings().sealer() is None
    other = make_seal_key(tmp_path / "other")
    sealer = load_settings().sealer()
    assert sealer is not None and sealer.keys == [key_bytes(other)]
    monkeypatch.setenv("JETLOOP_SEAL_KEY", "ab" * 32)
    sealer = load_settings().sealer()
    assert sealer is not None and sealer.keys == [bytes.fromhex("ab" * 32)]
    monkeypatch.delenv("JETLOOP_SEAL_KEY")
    (tmp_path / "other" / "seal.key").write_text("")
    with pytest.raises(SettingsError, match=r"JETLOOP_SEAL_KEY: .*other/seal.key is empty"):
        load_settings()


async def test_worker_without_a_key_warns_once(tmp_path: Path, workers: WorkerFactory) -> None:
    """A worker that finds no key says so once (`worker.unsealed`); one that finds the
    store's key does not."""
    # The workers' environment has the tests' key: an empty one is unset.
    bare = workers.start(env={"JETLOOP_SEAL_KEY": "", "JETLOOP_STORE_DIR": str(tmp_path / "no")})
    make_seal_key(tmp_path / "keyed")
    keyed = workers.start(
        env={"JETLOOP_SEAL_KEY": "", "JETLOOP_STORE_DIR": str(tmp_path / "keyed")}
    )
    await bare.wait_for("worker.started")
    await keyed.wait_for("worker.started")
    assert len(bare.find("worker.unsealed")) == 1
    assert keyed.find("worker.unsealed") == []


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


def _sealed_bytes(stored: bytes) -> tuple[bytes, str]:
    """The recipe of docs/security.md, on raw bytes only: no re-encoding."""
    first = stored[0]
    if first & 0xF0 == 0x80:
        n, at = first & 0x0F, 1
    elif first == 0xDE:
        n, at = int.from_bytes(stored[1:3], "big"), 3
    else:
        assert first == 0xDF
        n, at = int.from_bytes(stored[1:5], "big"), 5
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(stored[at:])
    for _ in range(n - 1):
        unpacker.skip()  # key
        unpacker.skip()  # value
    end = at + unpacker.tell()
    assert unpacker.unpack() == "seal"
    seal = unpacker.unpack()
    return _map_header(n - 1) + stored[at:end], seal


async def test_seal_bytes_are_the_stored_map_without_its_last_entry(
    client: Client, workers: WorkerFactory
) -> None:
    """Every record the engine writes (session, turn, call) verifies by the byte recipe a
    reader in another language would use (docs/security.md), under the tests' key: the HMAC
    covers the record's key, its seal time and the revision it was written over, the seal
    time is the stored time, and that revision is the one the server kept with the write."""
    workers.start()
    h = await client.send("tester", "sealbytes", script([call("write", name="a")]))
    await client.wait(h, timeout=30)
    kv = await client.js.key_value("jl_state")
    keys = [k for k in await kv.keys() if ".sealbytes" in f".{k}"]
    assert sorted(k.split(".")[0] for k in keys) == ["call", "session", "turn"]
    for key in keys:
        msg = await client.js.get_msg("KV_jl_state", subject=f"$KV.jl_state.{key}")
        assert msg.data is not None and msg.time is not None
        body, seal = _sealed_bytes(msg.data)
        version, at_ms, replaces, mac = seal.split(".")
        assert version == "v3"
        # The revision the seal names is the one the server kept with the write.
        assert msg.headers is not None
        assert replaces == msg.headers["Nats-Expected-Last-Subject-Sequence"], key
        signed = b"jetloop-seal-v3\n" + key.encode() + b"\n" + at_ms.encode() + b"\n"
        signed += replaces.encode() + b"\n" + body
        want = hmac.new(bytes.fromhex(SEAL_KEY), signed, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(want, mac), key
        assert abs(msg.time.timestamp() - int(at_ms) / 1000) < 5, (key, msg.time, at_ms)


def test_a_record_packed_by_another_msgpack_writer_verifies_by_its_stored_bytes() -> None:
    """A writer in another language seals the bytes it stores (the recipe above), which its
    msgpack library may pack otherwise than msgpack-python would pack the decoded values
    again (here an int as uint32, a float as float32): such a record verifies, an edit of
    it does not, and a seal that is not the map's last entry falls back to packing again."""
    sealer = Sealer([bytes.fromhex(SEAL_KEY)])
    key = "call.s.t.0.0"
    # {"attempts": 5 (uint32), "score": 0.5 (float32)}: msgpack-python packs 5 as a fixint and
    # 0.5 as a float64.
    record = b"\x82" + msgpack.packb("attempts") + b"\xce\x00\x00\x00\x05"
    record += msgpack.packb("score") + b"\xca\x3f\x00\x00\x00"
    at_ms = int(time.time() * 1000)
    signed = b"jetloop-seal-v3\n" + key.encode() + b"\n%d\n0\n" % at_ms + record
    seal = f"v3.{at_ms}.0.{hmac.new(bytes.fromhex(SEAL_KEY), signed, hashlib.sha256).hexdigest()}"
    stored = b"\x83" + record[1:] + msgpack.packb("seal") + msgpack.packb(seal)
    data = msgpack.unpackb(stored)
    assert msgpack.packb({k: v for k, v in data.items() if k != "seal"}) != record
    assert sealer.verify(key, data, at_ms / 1000, 0, stored) is None
    assert sealer.verify(key, data, at_ms / 1000, 0) is not None  # packed again: not its bytes
    edited = stored.replace(b"\xce\x00\x00\x00\x05", b"\xce\x00\x00\x00\x06")
    assert "does not verify" in str(
        sealer.verify(key, msgpack.unpackb(edited), at_ms / 1000, 0, edited)
    )
    # Sixteen keys and more: the record's header is a map16 when the stored map's is.
    big = {f"k{i:02}": i for i in range(16)}
    body = msgpack.packb(big)
    sealed = Sealer([bytes.fromhex(SEAL_KEY)]).seal_packed(key, body)
    stored16 = b"\xde\x00\x11" + body[3:] + msgpack.packb("seal") + msgpack.packb(sealed)
    assert sealer.verify(key, msgpack.unpackb(stored16), time.time(), 0, stored16) is None
