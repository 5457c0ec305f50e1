"""The floor of lever 1's write pattern (``jetloop.tooling.bench.floor_lever1``) makes the
writes its numbers stand for: on a real nats-server, a 7-step turn (five calls) completes,
its state bucket takes 7 writes (the five calls' outcomes in two: the first alone, the four
that finished during its commit in the join), its log takes 2 usage messages and, sourced by
the server, a copy of every state write, and its consumers deliver 5 work items."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats

from jetloop.tooling.bench import floor_lever1 as floor1
from tests.conftest import until
from tests.floors import floor_on_a_server

TURNS = 3


async def test_a_turn_stores_what_the_pattern_says(tmp_path: Path) -> None:
    async with floor_on_a_server(
        tmp_path, floor1.apply_topology, floor1.__name__, "worker_main"
    ) as nc:
        js = nc.jetstream()
        ended: asyncio.Queue[str] = asyncio.Queue()

        async def heard(msg: nats.aio.msg.Msg) -> None:
            await ended.put((msg.headers or {}).get("Jl-Turn", ""))

        await nc.subscribe(floor1.COMPLETED, cb=heard)
        for i in range(TURNS):
            tid = f"t{i}"
            await js.publish(floor1.turn_subject("s", tid, 5), b"r", headers={"Nats-Msg-Id": tid})
            assert await asyncio.wait_for(ended.get(), 10) == tid

        async def settled() -> bool:
            info = await js.consumer_info(floor1.STATE_STREAM, floor1.WORK_CONSUMER)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await until(settled, timeout=10)
        state = await js.stream_info(floor1.STATE_STREAM)
        assert state.state.last_seq == 7 * TURNS
        work = await js.consumer_info(floor1.STATE_STREAM, floor1.WORK_CONSUMER)
        requests = await js.consumer_info(floor1.TURNS, floor1.TURNS_CONSUMER)
        # model 0, the calls, model 1, the completed record; and the request.
        assert work.delivered.consumer_seq == 4 * TURNS
        assert requests.delivered.consumer_seq == TURNS

        async def logged() -> bool:
            return (await js.stream_info(floor1.LOG)).state.messages == (2 + 7) * TURNS

        await until(logged, timeout=10)
