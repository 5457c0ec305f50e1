"""The held list (``jetloop.streams.holds``): what a worker says it holds, spaced under load.

A fetch after a quiet spell is listed at once; fetches soon after a list share the next one,
which goes out when the spacing has passed and names what is held then — a step settled
meanwhile is not named at all. Read here as a rescuer's subject would see them, on a real
nats-server (a core subscription to the list's subject).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, cast

from nats.aio.msg import Msg

from jetloop.services.embedded import EmbeddedServer
from jetloop.streams.connection import connect
from jetloop.streams.holds import LIST_SPACING, Holds
from jetloop.streams.topology import WORKERS_BUCKET, held_key


def fetched(seq: int) -> Msg:
    """What ``Holds`` reads of a fetched message: its stream and stream sequence."""
    meta = SimpleNamespace(stream="JL_STEPS", sequence=SimpleNamespace(stream=seq))
    return cast(Msg, SimpleNamespace(metadata=meta))


async def test_lists_are_spaced_and_name_what_is_held_when_they_go(
    nats_ready: EmbeddedServer,
) -> None:
    nc = await connect([nats_ready.url], "test-holds")
    lists: list[dict[str, Any]] = []
    got = asyncio.Event()

    async def heard(msg: Msg) -> None:
        lists.append(json.loads(msg.data))
        got.set()

    await nc.subscribe(f"$KV.{WORKERS_BUCKET}.{held_key('inc1')}", cb=heard)
    await nc.flush()
    holds = Holds(nc, "inc1", "w1")
    try:
        # After a quiet spell: listed at once, and ``sent`` waits for it.
        holds.add(fetched(1))
        await holds.sent()
        await nc.flush()
        await asyncio.wait_for(got.wait(), 2)
        got.clear()
        assert [e["held"] for e in lists] == [[["JL_STEPS", 1]]]

        # Soon after: ``sent`` returns at once, the list waits out the spacing.
        loop = asyncio.get_running_loop()
        began = loop.time()
        holds.add(fetched(2))
        await holds.sent()
        holds.add(fetched(3))
        await holds.sent()  # shares the list due
        assert loop.time() - began < LIST_SPACING / 2
        holds.drop(fetched(2))  # settled before the list went: not named
        await asyncio.wait_for(got.wait(), 2)
        assert loop.time() - began >= LIST_SPACING * 0.8
        assert [e["held"] for e in lists] == [
            [["JL_STEPS", 1]],
            [["JL_STEPS", 1], ["JL_STEPS", 3]],
        ]
        await asyncio.sleep(LIST_SPACING * 3)
        assert len(lists) == 2, "one list for the changes made within the spacing"
    finally:
        await nc.close()
