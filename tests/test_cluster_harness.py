"""Smoke test of the three-node cluster harness: R3 topology, leader SIGKILL, failover."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from jetloop.streams import topology
from jetloop.streams.connection import connect
from jetloop.tooling.trials.cluster import LocalCluster
from tests.conftest import until


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    c = LocalCluster(tmp_path / "cluster", "jl-test")
    c.start()
    try:
        await c.wait_ready()
        yield c
    finally:
        c.stop()


async def test_publish_and_kv_survive_stream_leader_kill(cluster: LocalCluster) -> None:
    """Kill the node leading JL_STEPS; once a new leader is elected, a deduped step publish
    and a jl_state put/get work again on the same client connection."""
    assert len(set(cluster.urls)) == 3
    nc = await connect(cluster.urls, "test-cluster-harness")
    try:
        js = nc.jetstream()
        await topology.apply(js, topology.TopologyConfig(replicas=3, lease_seconds=2.0))
        # Every stream of the topology is there, each with a leader: none is named leaderless
        # (a worker names those it waits for: docs/design.md, "What is not promised").
        made = {info.config.name for info in await js.streams_info()}
        assert set(topology.stream_names()) <= made, set(topology.stream_names()) - made
        assert await topology.leaderless(js) == []

        victim = await cluster.stream_leader(topology.STEPS_STREAM)
        kv_before = await cluster.kv_leader(topology.STATE_BUCKET)
        cluster.kill(victim)

        new_leader = await cluster.wait_leader(topology.STEPS_STREAM, not_node=victim)

        # The servers' own view (not the harness's leader query): the leader is the node the
        # harness named, and the node killed, the one that led, is the replica no longer current.
        async def servers_agree() -> bool:
            try:
                info = await js.stream_info(topology.STEPS_STREAM)
            except TimeoutError:
                return False  # mid-election
            assert info.cluster is not None
            behind = {p.name for p in info.cluster.replicas or [] if not p.current}
            return info.cluster.leader == cluster.names[new_leader] and behind == {
                cluster.names[victim]
            }

        await until(servers_agree, timeout=20)
        kv_after = await cluster.wait_leader(
            f"KV_{topology.STATE_BUCKET}",
            not_node=victim if kv_before == victim else None,
        )
        assert kv_after != victim

        subject = topology.step_subject(topology.TOOL_POOL, "demo", "call_tool", "s1")
        assert subject == "jl.step.tool.demo.call_tool.s1"
        ack = await js.publish(subject, b"step", headers={"Nats-Msg-Id": "s1-step-1"})
        assert ack.stream == topology.STEPS_STREAM
        assert not ack.duplicate
        # The dedupe map moved with the leadership: the same id is still recognised.
        again = await js.publish(subject, b"step", headers={"Nats-Msg-Id": "s1-step-1"})
        assert again.duplicate
        assert again.seq == ack.seq

        kv = await js.key_value(topology.STATE_BUCKET)
        rev = await kv.put("session.s1", b"alive")
        entry = await kv.get("session.s1")
        assert entry.value == b"alive"
        assert entry.revision == rev
    finally:
        await nc.close()


async def test_a_watch_connection_keeps_hearing_after_its_node_dies(tmp_path: Path) -> None:
    """The system account's watch user, given in the URL of one node only, connects again to
    a node the cluster announced when its own dies — and is still the watch user there,
    hearing connection-closed advisories (before the fix it came back as nobody, in the
    global account, and heard nothing for the rest of its life: dead workers then waited
    for their leases)."""
    import json

    import nats

    from jetloop.tooling.trials.servers import write_server_config

    config = write_server_config(tmp_path / "nats-server.conf", "pw")
    c = LocalCluster(tmp_path / "cluster", "jl-watch", config_file=config)
    c.start()
    try:
        await c.wait_ready()
        first = c.urls[0].replace("nats://", "nats://watch:pw@")
        watch = await connect([first], "test-watch")
        heard: list[str] = []

        async def on_advisory(msg: object) -> None:
            heard.append(json.loads(msg.data)["client"].get("name", ""))  # type: ignore[attr-defined]

        await watch.subscribe("$SYS.ACCOUNT.*.DISCONNECT", cb=on_advisory)

        async def closes_heard(tag: str) -> bool:
            for i in (1, 2):
                probe = await nats.connect(servers=[c.urls[i]], name=f"{tag}-{i}")
                await probe.close()
            await asyncio.sleep(0.3)
            return {f"{tag}-1", f"{tag}-2"} <= set(heard)

        assert await closes_heard("before")
        c.kill(0)
        rounds = iter(range(1000))
        assert await until(lambda: closes_heard(f"after-{next(rounds)}"), timeout=20), (
            "the watch connection hears nothing after its node died"
        )
        await watch.close()
    finally:
        c.stop()
