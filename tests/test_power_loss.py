"""A power cut under a held single-attempt write: it is not made twice after the restart.

A single-attempt write (``Effect.NON_IDEMPOTENT_WRITE``) is made at most once because the
worker stores an in-doubt mark (the call's record, ``in_doubt``) before it runs the tool: a
step resumed after a crash finds the mark and settles the call ``outcome_unknown`` instead
of making it again. The mark is only as durable as nats-server's acknowledgement, so every
server jetloop configures syncs before it acknowledges (``sync_interval: always``,
``jetloop.services.durability``).

Here the machine loses power while the write is made. nats-server runs on a LazyFS mount
(``jetloop.tooling.powercut.lazyfs``) with the config ``jetloop up`` writes (its accounts,
the sync policy under test). The machine has run a while first: a worker made the streams
and completed one turn, and a clean stop put all of it on disk. Then a worker runs
``once_held`` (tests/apps.py), which makes its write at the vendor and is held there; with
the write in the vendor's ledger and the mark acknowledged, the worker and nats-server get
SIGKILL at once and the power is cut (every write not fsynced is gone); the server starts
again on what the disk kept and a fresh worker takes over. The vendor's ledger (SQLite)
lives on the real disk: the vendor is another machine, and it keeps the request it received.

- ``sync_interval: always`` (jetloop's default): the turn completes with the call recorded
  ``outcome_unknown``; the vendor received exactly one request; a client that got no answer
  and sends the same request again is told it is a duplicate, and nothing is made again.
- The control, ``sync_interval: 2m`` (nats-server's own default): the cut takes the mark
  back, and the turn with it; the same request sent again (harmless by the docs) runs the
  turn anew and makes the write a second time with the same idempotency key. What was on
  disk before (the earlier turn) survives in both: the cut takes what was not synced.

Skipped where FUSE cannot be mounted (no /dev/fuse, no fusermount3, no mfusepy, not
permitted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jetloop.demo.vendor import Vendor
from jetloop.schemas.ids import idempotency_key
from jetloop.services.client import Client, TurnHandle
from jetloop.services.embedded import EmbeddedServer, free_port
from jetloop.tooling.powercut.lazyfs import Cut, LazyFS, unavailable
from jetloop.tooling.trials.servers import write_namespaced_config
from tests.conftest import WorkerFactory, body, call, script, until

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

AGENT, SESSION, REQUEST = "tester", "power", "power-cut-1"
TEXT = script([call("once_held", name="x")])


class Machine:
    """One machine: nats-server on a LazyFS mount (``jetloop up``'s config, with the sync
    policy ``sync``) and its workers; the vendor's ledger on the real disk."""

    def __init__(self, tmp_path: Path, sync: str) -> None:
        self.lazy = LazyFS(tmp_path / "lazy")
        config, watch, _ = write_namespaced_config(
            tmp_path / "config", names=("default",), sync=sync
        )
        self.log_file = tmp_path / "nats.log"
        self.server = EmbeddedServer(
            self.lazy.mountpoint, port=free_port(), log_file=self.log_file, config_file=config
        )
        self.vendor = Vendor(tmp_path / "vendor.sqlite")
        self.workers = WorkerFactory(
            tmp_path, self.server.url, self.vendor.path, env={"JETLOOP_NATS_WATCH_PASSWORD": watch}
        )
        self.held = tmp_path / "held"  # the latch once_held waits on (never created)

    def note(self, text: str) -> None:
        """A line in the server's log that says what comes next."""
        with open(self.log_file, "ab") as f:
            f.write(f"--- {text} ---\n".encode())

    async def boot(self, note: str) -> Client:
        """The server up on the mount (``note`` marks its log), and a client of it."""
        self.note(note)
        self.server.start()
        await self.server.wait_jetstream()
        return await Client.connect(self.server.url)

    async def worker(self, name: str, held: bool = False) -> None:
        """A worker started (``held``: its once_held calls never return) and serving."""
        env = {"TEST_HELD_LATCH": str(self.held)} if held else {}
        await self.workers.start(name, env=env).wait_for("worker.started", timeout=30)

    async def settled(self) -> TurnHandle:
        """The machine as it stands after running a while: the streams, buckets and
        consumers made, the agents registered, one turn completed (returned); everything
        stopped cleanly, so all of it is on disk, as on a server that ran longer than its
        sync interval."""
        client = await self.boot("first start")
        try:
            await self.worker("first")
            earlier = await client.send(AGENT, "earlier", script([call("write", name="w")]))
            assert (await client.wait(earlier, timeout=30)).status == "completed"
        finally:
            await client.close()
        for w in self.workers.procs:
            assert await asyncio.to_thread(w.terminate) == 0
        await asyncio.to_thread(self.server.stop)
        self.lazy.unmount()  # a clean stop: the disk takes everything
        self.lazy.mount()
        return earlier

    def power_cut(self) -> Cut:
        """SIGKILL the workers and nats-server at once, cut the power, mount the disk again."""
        for w in self.workers.procs:
            w.kill()
        self.server.kill()
        cut = self.lazy.cut()
        self.lazy.mount()
        return cut

    async def once_held_requests(self) -> dict[str, int]:
        """The vendor's requests of once_held, by idempotency key."""
        return await self.vendor.request_counts("once_held")

    def close(self) -> None:
        self.workers.close()
        self.server.kill()
        self.lazy.unmount()


def _machine(tmp_path: Path, sync: str) -> Iterator[Machine]:
    m = Machine(tmp_path, sync)
    m.lazy.mount()
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def machine_always(tmp_path: Path) -> Iterator[Machine]:
    yield from _machine(tmp_path, "always")


@pytest.fixture
def machine_lazy(tmp_path: Path) -> Iterator[Machine]:
    yield from _machine(tmp_path, "2m")


@dataclass
class AfterCut:
    earlier: TurnHandle  # a turn completed and on disk before the cut
    handle: TurnHandle  # the turn whose write the cut hit
    key: str  # that call's idempotency key
    cut: Cut
    client: Client  # of the restarted server; a fresh worker serves


async def cut_under_held_write(m: Machine) -> AfterCut:
    """After ``settled``: send the turn, wait until ``once_held`` made its write at the
    vendor (and is held there) with its in-doubt mark acknowledged, cut the power, bring the
    server and a fresh worker (not held) back."""
    earlier = await m.settled()
    client = await m.boot("before the cut")
    try:
        await m.worker("held", held=True)
        h = await client.send(AGENT, SESSION, TEXT, request_id=REQUEST)
        key = idempotency_key(SESSION, h.turn_id, 0, 0)

        async def made() -> bool:
            return (await m.once_held_requests()).get(key) == 1

        await until(made, timeout=30)
        rec = await client.call(SESSION, h.turn_id, 0, 0)
        assert rec is not None and rec.state == "in_doubt", rec
    finally:
        await client.close()
    cut = m.power_cut()
    client = await m.boot("after the cut")
    await m.worker("fresh")
    return AfterCut(earlier, h, key, cut, client)


async def earlier_turn_kept(after: AfterCut) -> None:
    turn = await after.client.turn(after.earlier.session_id, after.earlier.turn_id)
    assert turn is not None and turn.status == "completed", turn


async def test_a_power_cut_under_a_held_single_attempt_write_does_not_make_it_twice(
    machine_always: Machine,
) -> None:
    """``sync_interval: always``: the in-doubt mark, acknowledged before the write was made,
    survives the cut; the fresh worker finds it and settles the call ``outcome_unknown``
    without making it again; the turn completes and the vendor received one request. The
    same request sent again is a duplicate of the completed turn: still one request."""
    after = await cut_under_held_write(machine_always)
    client = after.client
    try:
        res = await client.wait(after.handle, timeout=30)
        assert res.status == "completed"
        assert body(res.text)["seen"][0]["status"] == "outcome_unknown"
        rec = await client.call(SESSION, after.handle.turn_id, 0, 0)
        assert rec is not None, "the in-doubt mark was lost"
        assert (rec.state, rec.settlement, rec.attempts) == (
            "outcome_unknown",
            "outcome_unknown",
            1,
        ), rec
        assert await machine_always.once_held_requests() == {after.key: 1}

        again = await client.send(AGENT, SESSION, TEXT, request_id=REQUEST)
        assert again.duplicate and again.turn_id == after.handle.turn_id
        assert again.status == "completed"
        assert (await client.wait(again, timeout=30)).status == "completed"
        assert await machine_always.once_held_requests() == {after.key: 1}, "made twice"
        await earlier_turn_kept(after)
    finally:
        await client.close()


async def test_the_control_a_lazy_sync_loses_the_mark_and_the_write_is_made_twice(
    machine_lazy: Machine,
) -> None:
    """The control, ``sync_interval: 2m``: the mark was acknowledged but was only in the
    page cache, and the cut takes it back with the turn (neither record is there after the
    restart; the streams whose definitions the held worker's start rewrote are skipped by
    the server and made again by the fresh worker over the blocks the disk kept). The same
    request sent again is taken as new, the turn runs from its start, and the write is made
    a second time with the same idempotency key: two requests at the vendor. The earlier
    turn, on disk before, is still there: the cut took what was not synced."""
    after = await cut_under_held_write(machine_lazy)
    client = after.client
    try:
        assert after.cut.unsynced_bytes > 0
        assert await client.call(SESSION, after.handle.turn_id, 0, 0) is None, "the mark survived"
        assert await client.turn(SESSION, after.handle.turn_id) is None
        await earlier_turn_kept(after)

        again = await client.send(AGENT, SESSION, TEXT, request_id=REQUEST)
        assert not again.duplicate and again.turn_id == after.handle.turn_id
        res = await client.wait(again, timeout=30)
        assert res.status == "completed"
        assert body(res.text)["seen"][0]["status"] == "ok"
        assert await machine_lazy.once_held_requests() == {after.key: 2}, "not made again"
    finally:
        await client.close()
