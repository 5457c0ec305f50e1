"""Power cuts for the trials: servers whose stores lose what was not on disk.

Every store lives on a power-cut filesystem (``jetloop.tooling.powercut.lazyfs``): what a
server wrote but did not fsync is discarded by a cut, as a power failure or an OS crash
discards the page cache. The failures:

- ``power_cut`` (``PowerServer``, one nats-server): the machine loses power. nats-server and
  every worker are SIGKILLed at once (the trial kills the workers, ``kills_workers``), the
  store loses what was not synced, the server restarts on what is left, new workers start.
- ``cluster_power_cut`` (``PowerCluster``, three nodes, R3): the three machines lose power
  together (a rack, a zone): every node and every worker, every store cut, all restarted.
- ``node_crash+pause`` (``PowerCluster``): one node's OS crashes (killed, its store cut,
  restarted) while another node is paused (SIGSTOP) for ``PAUSE_SECONDS``: for a while the
  cluster has only the crashed node's remains and one healthy node to agree with. The
  workers run on; the paused node is resumed after the crashed one is back.
- ``node_crash+partition`` (``PowerCluster`` where the machine can make network namespaces,
  ``jetloop.tooling.trials.netns``): the same with the other node cut off from its peers
  instead of paused — it runs on, its clients still reach it, it may still think it leads —
  and healed after the crashed one is back.

The clients (the trial's harness) run elsewhere and keep running: they ride out the outage
and send again what they heard no answer for, as the docs allow.

Both take the sync policy the servers run with (``jetloop.services.durability``): the
trials run the default (``always``) and, as a control that shows the harness bites, the
lazy interval nats-server has by default.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from jetloop.tooling.powercut.lazyfs import LazyFS, unavailable
from jetloop.tooling.trials.cluster import LocalCluster
from jetloop.tooling.trials.harness import WorkerProcess
from jetloop.tooling.trials.netns import NetnsCluster
from jetloop.tooling.trials.netns import unavailable as netns_unavailable
from jetloop.tooling.trials.servers import (
    Cluster,
    Elections,
    Kill,
    SingleServer,
    worker_ids,
)

# The failures that take every worker with the servers: the trial kills them at the cut and
# starts new ones once the servers are back.
KILLS_WORKERS = ("power_cut", "cluster_power_cut")
CLUSTER_POWER_FAILURES = ("cluster_power_cut", "node_crash+partition", "node_crash+pause")
PAUSE_SECONDS = 3.0


async def cut_and_mount(disk: LazyFS, rng: random.Random) -> None:
    """The power goes (half the time tearing an unsynced write) and comes back: the disk
    holds what was synced, mounted again for the server's restart."""
    await asyncio.to_thread(disk.cut, rng.random() < 0.5, rng)
    await asyncio.to_thread(disk.mount)


class PowerCutUnavailable(RuntimeError):
    """The power-cut filesystem cannot be mounted here (the reason says why)."""


def _require_fuse() -> None:
    reason = unavailable()
    if reason is not None:
        raise PowerCutUnavailable(f"power-cut trials need FUSE: {reason}")


class PowerServer(SingleServer):
    """One nats-server on a power-cut filesystem: ``power_cut``."""

    def __init__(self, base: Path, sync: str, system_account: bool = True) -> None:
        _require_fuse()
        self.disk = LazyFS(base / "disk")
        super().__init__(base, sync, store=self.disk.mountpoint, system_account=system_account)

    async def start(self) -> None:
        await asyncio.to_thread(self.disk.mount)
        await super().start()

    async def fail(self, failure: str, victim: WorkerProcess, rng: random.Random) -> Kill:
        if failure != "power_cut":
            raise ValueError(f"a power-cut server cannot take the failure {failure!r}")
        kill = Kill.now()
        self.server.kill()  # the workers went with it (the trial killed them)
        await cut_and_mount(self.disk, rng)
        await asyncio.to_thread(self.server.start, 30.0)
        return Kill(kill.at, kill.wall, restart=time.monotonic() - kill.at)

    def close(self) -> None:
        super().close()
        self.disk.unmount()


class PowerCluster(Cluster):
    """Three nodes, each on a power-cut filesystem: ``cluster_power_cut``,
    ``node_crash+pause`` and, where the nodes can run in network namespaces,
    ``node_crash+partition``."""

    def __init__(self, base: Path, sync: str, system_account: bool = True) -> None:
        _require_fuse()
        self.disks = [LazyFS(base / f"disk{i + 1}") for i in range(3)]
        no_netns = netns_unavailable()
        super().__init__(
            base,
            sync,
            store_dirs=[d.mountpoint for d in self.disks],
            monitor=True,  # which workers a paused node cuts off (``fail``)
            system_account=system_account,
            cluster_type=LocalCluster if no_netns else NetnsCluster,
        )
        self._paused: int | None = None
        self._parted: int | None = None
        # The failures this machine can make, and a sentence for each it cannot.
        self.failures = tuple(
            f for f in CLUSTER_POWER_FAILURES if f != "node_crash+partition" or not no_netns
        )
        self.left_out = [f"node_crash+partition left out: {no_netns}"] if no_netns else []

    async def start(self) -> None:
        for d in self.disks:
            await asyncio.to_thread(d.mount)
        await super().start()

    async def fail(self, failure: str, victim: WorkerProcess, rng: random.Random) -> Kill:
        nodes = range(len(self.cluster.nodes))
        if failure == "cluster_power_cut":
            kill = Kill.now()
            for i in nodes:
                self.cluster.kill(i)
            for d in self.disks:
                await cut_and_mount(d, rng)
            self.cluster.start()
            await self.cluster.wait_ready(timeout=90)
            return Kill(kill.at, kill.wall, restart=time.monotonic() - kill.at)
        if failure in ("node_crash+pause", "node_crash+partition"):
            crashed, other = rng.sample(list(nodes), 2)
            names = await asyncio.to_thread(self.cluster.connection_names, other)
            if failure == "node_crash+pause":
                self.cluster.pause(other)
                self._paused = other
            else:
                assert isinstance(self.cluster, NetnsCluster)
                self.cluster.network.partition(other)
                self._parted = other
            kill = Kill.now(cut_off=worker_ids(names))
            self.cluster.kill(crashed)
            await cut_and_mount(self.disks[crashed], rng)
            self.cluster.start_node(crashed)
            self._healing = asyncio.create_task(self._resume_later(crashed, other))
            return kill
        raise ValueError(f"a power-cut cluster cannot take the failure {failure!r}")

    async def _resume_later(self, crashed: int, other: int) -> Elections | None:
        """Resume (or heal) the other node ``PAUSE_SECONDS`` after the crashed one is back."""
        try:
            await self.cluster.wait_node(crashed, timeout=60)
            await asyncio.sleep(PAUSE_SECONDS)  # the stall is the fault, not a wait
        finally:
            self._unfault()
        await self.cluster.wait_node(other, timeout=60)
        return None

    def _unfault(self) -> None:
        if self._paused is not None:
            self.cluster.resume(self._paused)
            self._paused = None
        if self._parted is not None:
            assert isinstance(self.cluster, NetnsCluster)
            self.cluster.network.heal()
            self._parted = None

    def close(self) -> None:
        self._unfault()
        super().close()
        for d in self.disks:
            d.unmount()
