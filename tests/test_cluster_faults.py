"""The cluster fault harness (``jetloop.tooling.trials.netns``, issue 55): three nats-server
nodes, each in a network namespace of its own, and faults made by the kernel between them.

What is checked here is that the harness bites at the NATS level — that a partition it makes
is one the cluster sees — before jetloop's trials are judged on it: the leader of an R3 stream,
cut off from its peers while its clients still reach it, loses the stream to the majority; a
write through it is not acknowledged; a write through the majority is; and once healed, the
node holds what the majority wrote and nothing of what it was sent while cut off.
Skipped, saying why, where the machine cannot make network namespaces (not root, no iproute2).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest
from nats.errors import Error as NatsError
from nats.js import api

from jetloop.tooling.trials.netns import NetnsCluster, unavailable
from tests.conftest import until

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no cluster fault harness: {WHY}")


async def _connect(urls: list[str]) -> nats.NATS:
    async def quiet(exc: Exception) -> None:
        return None

    return await nats.connect(
        urls, connect_timeout=2, max_reconnect_attempts=-1, error_cb=quiet, dont_randomize=True
    )


async def test_a_partitioned_leader_loses_its_stream_to_the_majority(tmp_path: Path) -> None:
    cluster = NetnsCluster(tmp_path, "jl-faults")
    cluster.start()
    try:
        await cluster.wait_ready(timeout=60)
        nc = await _connect(cluster.urls)
        js = nc.jetstream()
        await js.add_stream(
            api.StreamConfig(
                name="F", subjects=["f.>"], num_replicas=3, storage=api.StorageType.FILE
            )
        )
        await js.publish("f.x", b"before")
        leader = await cluster.wait_leader("F", timeout=30)
        others = [n.url for n in cluster.nodes if n.index != leader]

        cluster.network.partition(leader)
        cut_at = time.monotonic()
        elected = await cluster.wait_leader("F", not_node=leader, timeout=60)
        election = time.monotonic() - cut_at
        assert elected != leader and election < 30, election

        # The cut-off node still takes its clients' connections, and acknowledges nothing.
        minority = await _connect([cluster.nodes[leader].url])
        with pytest.raises((NatsError, TimeoutError)):
            await minority.jetstream(timeout=3).publish("f.x", b"cut off")
        majority = await _connect(others)
        ack = await majority.jetstream(timeout=10).publish("f.x", b"majority")
        assert ack.seq == 2

        cluster.network.heal()

        async def caught_up() -> bool:
            try:
                info = await minority.jetstream(timeout=2).stream_info("F")
            except (NatsError, TimeoutError):
                return False
            return info.state.messages == 2 and info.state.last_seq == 2

        await until(caught_up, timeout=60, every=0.5)
        # What the majority wrote, read through the node that was cut off; nothing else.
        got = await minority.jetstream(timeout=5).get_msg("F", 2)
        assert got.data == b"majority"
        for c in (minority, majority, nc):
            await c.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    assert not cluster.network.made
