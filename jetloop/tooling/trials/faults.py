"""The three-node cluster under network faults, for ``jetloop trials --mode cluster_faults``
(issue 55): the nodes of ``jetloop.tooling.trials.netns``, a fault between them for
``HOLD_SECONDS``, then healed, the turns in flight judged as every trial's are.

The faults (``NETWORK_FAULTS``), each struck at a random moment of a round:

- ``partition_leader``: the node leading ``JL_STEPS`` cut off from its peers, its clients
  still connected to it (a minority that keeps accepting connections);
- ``partition_follower``: the same for a node that leads nothing of ``JL_STEPS``;
- ``one_way``: what the leader sends one follower is dropped, the other way flows;
- ``netem``: 40 ms ± 20 ms of delay and 3 % loss on every packet the leader sends (where the
  kernel has the netem qdisc: left out, and said so, where it has not);
- ``flap``: the leader partitioned and healed, three times a second apart;
- ``pause_leader``: the leader stopped (SIGSTOP), then resumed.

Workers connected to a node a fault cuts off (partitioned, or paused) can reach no quorum:
their steps are taken over at their lease, as a worker's that lost its link, and such a
takeover is not counted false (``Kill.cut_off``, read from the node's connections). Nothing a
worker on the minority wrote may survive the heal: its writes are CAS on R3 buckets, which
the minority cannot commit.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from jetloop.services import durability
from jetloop.streams import topology
from jetloop.tooling.trials.harness import WorkerProcess
from jetloop.tooling.trials.netns import NetnsCluster, netem_unavailable
from jetloop.tooling.trials.netns import unavailable as netns_unavailable
from jetloop.tooling.trials.servers import (
    JETLOOP_STREAMS,
    Cluster,
    Elections,
    Kill,
    worker_ids,
)

NETWORK_FAULTS = (
    "partition_leader",
    "partition_follower",
    "one_way",
    "netem",
    "flap",
    "pause_leader",
)
# The faults that cut one node off from its peers (and the workers connected to it).
CUTS_A_NODE = ("partition_leader", "partition_follower", "flap", "pause_leader")
# How long a fault lasts: past a lease (2 s in the trials) and an election (seconds).
HOLD_SECONDS = 6.0
# How long the fault is held at most for the majority to elect new leaders of what it led.
ELECTION_WAIT_SECONDS = 20.0
FLAPS = 3


class FaultCluster(Cluster):
    """Three nodes in network namespaces: the faults of ``NETWORK_FAULTS``."""

    def __init__(
        self, base: Path, sync: str = durability.ALWAYS, system_account: bool = True
    ) -> None:
        why = netns_unavailable()
        if why is not None:
            raise RuntimeError(f"cluster_faults needs network namespaces: {why}")
        super().__init__(
            base,
            sync,
            monitor=True,  # which workers a fault cuts off (``fail``)
            system_account=system_account,
            cluster_type=NetnsCluster,
        )
        assert isinstance(self.cluster, NetnsCluster)
        self.net = self.cluster.network
        self._paused: int | None = None
        # The faults this machine can make, and a sentence for each it cannot.
        shaping = netem_unavailable()
        self.faults = tuple(f for f in NETWORK_FAULTS if f != "netem" or shaping is None)
        self.left_out = [] if shaping is None else [f"netem left out: {shaping}"]

    async def fail(self, failure: str, victim: WorkerProcess, rng: random.Random) -> Kill:
        if failure not in NETWORK_FAULTS:
            return await super().fail(failure, victim, rng)
        leader = await self._leader(topology.STEPS_STREAM)
        nodes = list(range(len(self.cluster.nodes)))
        if failure == "partition_follower":
            node = rng.choice([i for i in nodes if i != leader])
        else:
            node = leader
        cut = failure in CUTS_A_NODE
        # The nodes whose workers the fault cuts off.
        ends: tuple[int, ...] = (node,) if cut else ()
        if failure == "one_way":
            # One direction of the link dropped stalls its TCP connection both ways (the
            # acknowledgements are lost): the two ends cannot reach each other, each still
            # reaches the third node. A worker on either end cannot reach the groups the other
            # end leads, so it is cut off from them as a partitioned node's workers are.
            other = rng.choice([i for i in nodes if i != node])
            ends = (node, other)
        names = [
            name
            for end in ends
            for name in await asyncio.to_thread(self.cluster.connection_names, end)
        ]
        # What the node leads: the majority elects anew for each once the node is cut off.
        led = await self.cluster.groups_led_by(node, JETLOOP_STREAMS) if cut else []
        kill = Kill.now(cut_off=worker_ids(names))
        if failure in ("partition_leader", "partition_follower", "flap"):
            self.net.partition(node)
        elif failure == "one_way":
            self.net.one_way(node, other)
        elif failure == "netem":
            self.net.netem(node, delay_ms=40, jitter_ms=20, loss_pct=3)
        else:
            self.cluster.pause(node)
            self._paused = node
        self._healing = asyncio.create_task(self._heal_later(failure, node, kill.at, led))
        return kill

    async def _heal_later(
        self, failure: str, node: int, struck: float, led: list[tuple[str, str | None]]
    ) -> Elections | None:
        """Hold the fault (flapping it), heal it, and wait for the node to serve again; after
        a fault that cut the node off, the time until the majority had new leaders for
        ``JL_STEPS`` (if the node led it) and for every group the node led (those it still
        leads once the flapping heals it are not waited for)."""
        elected: Elections | None = None
        try:
            if failure in CUTS_A_NODE:
                steps = None
                if failure != "partition_follower":
                    await self.cluster.wait_leader(topology.STEPS_STREAM, not_node=node, timeout=60)
                    steps = time.monotonic() - struck
                # Bounded: waiting is holding the fault, and a group that cannot elect is
                # named in the report rather than stalling the round.
                leaderless = await self.cluster.wait_groups(
                    led, not_node=node, timeout=ELECTION_WAIT_SECONDS
                )
                elected = Elections(steps, time.monotonic() - struck, tuple(leaderless))
            if failure == "flap":
                for _ in range(FLAPS - 1):
                    self.net.heal()
                    await asyncio.sleep(1.0)  # the flapping is the fault, not a wait
                    self.net.partition(node)
                    await asyncio.sleep(1.0)
            await asyncio.sleep(max(0.0, struck + HOLD_SECONDS - time.monotonic()))
        finally:
            self.net.heal()
            if self._paused is not None:
                self.cluster.resume(self._paused)
                self._paused = None
        await self.cluster.wait_node(node, timeout=60)
        return elected

    def close(self) -> None:
        if self._paused is not None:
            self.cluster.resume(self._paused)
        super().close()
