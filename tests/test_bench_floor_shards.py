"""The floor spread over shards (``jetloop bench peer --floor-shards``): on a real nats-server,
7-step turns of sessions that hash to different shards complete, and each session's state
writes and log entries are in its own shard's bucket and stream, the same counts a turn as
the unsharded floor's (9 state writes, 10 log messages in the folded layout)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import structlog
from click.testing import CliRunner
from nats.js import JetStreamContext

from jetloop.services.cli import main
from jetloop.tooling.bench import floor
from tests.conftest import until
from tests.floors import floor_on_a_server

SHARDS = 3


def _sessions() -> list[str]:
    """One session id per shard."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < SHARDS:
        found.setdefault(floor.shard_of(f"s{i}", SHARDS), f"s{i}")
        i += 1
    return [found[k] for k in range(SHARDS)]


async def test_each_session_writes_in_its_own_shard(tmp_path: Path) -> None:
    async def apply(js: JetStreamContext) -> None:
        await floor.apply_topology(js, SHARDS)

    async with floor_on_a_server(
        tmp_path, apply, floor.__name__, "floor_worker_main", {floor.SHARDS_ENV: str(SHARDS)}
    ) as nc:
        js = nc.jetstream()
        ended: asyncio.Queue[str] = asyncio.Queue()

        async def heard(msg: nats.aio.msg.Msg) -> None:
            await ended.put((msg.headers or {}).get("Jl-Turn", ""))

        await nc.subscribe(floor.COMPLETED, cb=heard)
        for sid in _sessions():
            tid = f"t{sid}"
            await js.publish(floor.turn_subject(sid, tid, 5), b"r", headers={"Nats-Msg-Id": tid})
            assert await asyncio.wait_for(ended.get(), 10) == tid

        async def settled() -> bool:
            info = await js.consumer_info(floor.STEPS, floor.STEPS_CONSUMER)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await until(settled, timeout=10)
        for k in range(SHARDS):
            state = await js.stream_info(f"KV_{floor.state_bucket(k)}")
            log = await js.stream_info(floor.events_stream(k))
            # (a 7-step turn: 9 CAS writes and 6 log messages, its 5 results in one)
            assert (state.state.last_seq, log.state.messages) == (9, 6), k


def test_floor_shards_is_an_option_of_the_peer_benchmark_only() -> None:
    # In this process: the command group configures logging (warnings only), which is put
    # back after, or later tests that capture info events would hear none.
    saved = structlog.get_config()
    try:
        out = CliRunner().invoke(main, ["bench", "overhead", "--floor-shards", "4"])
        assert out.exit_code == 2
        assert "--floor-shards shapes the peer benchmark's floor" in out.output
        out = CliRunner().invoke(main, ["bench", "peer", "--floor-shards", "0"])
        assert out.exit_code == 2 and "--floor-shards" in out.output
    finally:
        structlog.configure(**saved)
