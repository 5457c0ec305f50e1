"""A three-node cluster whose nodes talk over a network that can fail (issue 55).

``LocalCluster`` puts every node on loopback, where nothing can come between them. Here each
node runs in a network namespace of its own (``ip netns``), with one interface (a veth pair)
on a bridge in the machine's own namespace; workers and clients stay in the machine's
namespace and reach every node through the bridge. Faults are made with the kernel's own tools:

- ``partition(i)``: node ``i`` and the others drop what they send each other (a blackhole route
  each way), while clients still reach every node — a minority that keeps accepting
  connections, as a node cut off from its peers but not from its clients is;
- ``one_way(src, dst)``: only what ``src`` sends ``dst`` is dropped;
- ``netem(i, delay_ms, jitter_ms, loss_pct)``: delay, jitter and loss on node ``i``'s link (all
  its traffic, peers' and clients'), with ``tc netem``;
- ``isolate(i)``: node ``i``'s link down: no peer and no client reaches it;
- ``heal()``: every fault undone; the paused node (``pause``/``resume`` of ``LocalCluster``)
  is not a network fault and stays as it is.

A node's clock cannot be stepped here: nats-server is a Go program, which reads the time from
the kernel without the C library that libfaketime replaces.

It needs root (or CAP_NET_ADMIN) and iproute2; :func:`unavailable` says why it cannot run
where it cannot. Every name it makes carries a random token, so two harnesses on one machine
(two test processes) do not meet; ``close`` removes them all.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from jetloop.tooling.trials.cluster import ClusterNode, LocalCluster

# The subnets the harness picks from: 10.200.0.0/24 to 10.249.255.0/24, away from what a
# machine's own networks usually use.
_SECOND_OCTETS = range(200, 250)


class NetworkError(RuntimeError):
    """A command of iproute2 failed: what it was and what it said."""


def _ip(*args: str) -> None:
    run("ip", *args)


def run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def unavailable() -> str | None:
    """Why a namespaced cluster cannot run on this machine, or None if it can."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"jlprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except NetworkError as exc:
        return f"cannot make a network namespace here: {exc}"
    try:
        _ip("netns", "del", probe)
    except NetworkError:
        pass
    return None


def netem_unavailable() -> str | None:
    """Why ``tc netem`` cannot shape a link here (its qdisc is not in every kernel), or None."""
    why = unavailable()
    if why is not None:
        return why
    probe = f"jlprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "set", "lo", "up")
        run("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    except NetworkError as exc:
        return f"tc netem: {exc.args[0].rpartition(': ')[2]}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


class Network:
    """A bridge, and one namespace per node with its address on the bridge's subnet."""

    def __init__(self, size: int) -> None:
        token = f"{random.randrange(16**4):04x}"
        self.prefix = f"jl{token}"
        net = f"10.{random.choice(_SECOND_OCTETS)}.{random.randrange(256)}"
        self.bridge = f"{self.prefix}br"
        self.gateway = f"{net}.254"
        self.namespaces = [f"{self.prefix}n{i + 1}" for i in range(size)]
        self.hosts = [f"{net}.{i + 1}" for i in range(size)]
        self._blackholes: set[tuple[int, int]] = set()  # (in node, toward node)
        self._shaped: set[int] = set()
        self._down: set[int] = set()
        self._partitioned: set[int] = set()
        self.made = False

    def make(self) -> None:
        """The bridge and the namespaces, each node's interface up with its address."""
        self.made = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.namespaces):
                veth = f"{self.prefix}v{i + 1}"
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", ns, "addr", "add", f"{self.hosts[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def in_namespace(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run in node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    # faults

    def _blackhole(self, node: int, toward: int) -> None:
        if (node, toward) not in self._blackholes:
            _ip(
                "-n", self.namespaces[node], "route", "add", "blackhole", f"{self.hosts[toward]}/32"
            )
            self._blackholes.add((node, toward))

    def partition(self, i: int) -> None:
        """Node ``i`` and every other node stop hearing each other; clients reach all."""
        for j in range(len(self.namespaces)):
            if j != i:
                self._blackhole(i, j)
                self._blackhole(j, i)
        self._partitioned.add(i)

    def one_way(self, src: int, dst: int) -> None:
        """What node ``src`` sends node ``dst`` is dropped; the other way still flows."""
        self._blackhole(src, dst)

    def netem(self, i: int, delay_ms: float = 0, jitter_ms: float = 0, loss_pct: float = 0) -> None:
        """Delay (with jitter) and loss on every packet node ``i`` sends."""
        spec = ["delay", f"{delay_ms}ms", f"{jitter_ms}ms"] if delay_ms else []
        spec += ["loss", f"{loss_pct}%"] if loss_pct else []
        run(
            "tc",
            "-n",
            self.namespaces[i],
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "netem",
            *spec,
        )
        self._shaped.add(i)

    def isolate(self, i: int) -> None:
        """Node ``i``'s link down: neither its peers nor any client reach it."""
        _ip("-n", self.namespaces[i], "link", "set", "eth0", "down")
        self._down.add(i)

    def heal(self) -> None:
        """Every fault made undone."""
        for node, toward in sorted(self._blackholes):
            _ip(
                "-n", self.namespaces[node], "route", "del", "blackhole", f"{self.hosts[toward]}/32"
            )
        self._blackholes.clear()
        self._partitioned.clear()
        for i in sorted(self._shaped):
            run("tc", "-n", self.namespaces[i], "qdisc", "del", "dev", "eth0", "root")
        self._shaped.clear()
        for i in sorted(self._down):
            _ip("-n", self.namespaces[i], "link", "set", "eth0", "up")
        self._down.clear()

    def cut_off(self) -> set[int]:
        """The nodes a fault now keeps from the others (partitioned or isolated)."""
        return self._partitioned | self._down

    def close(self) -> None:
        """Remove the namespaces (their interfaces go with them) and the bridge."""
        if not self.made:
            return
        self.made = False
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)


class NetnsCluster(LocalCluster):
    """``LocalCluster`` with each node in its own network namespace (``network``'s faults)."""

    def __init__(
        self,
        base_dir: Path,
        cluster_name: str = "jetloop",
        size: int = 3,
        config_file: Path | None = None,
        store_dirs: Sequence[Path] | None = None,
        monitor: bool = False,
    ) -> None:
        super().__init__(base_dir, cluster_name, size, config_file, store_dirs, monitor)
        self.network = Network(size)
        for node, host in zip(self.nodes, self.network.hosts, strict=True):
            node.host = host

    def start(self) -> None:
        if not self.network.made:
            self.network.make()
        super().start()

    def _command(self, node: ClusterNode) -> list[str]:
        return self.network.in_namespace(node.index, self._args(node))

    def answering(self) -> list[ClusterNode]:
        cut = self.network.cut_off()
        return [n for n in self.nodes if n.running and n.index not in cut]

    def stop(self, timeout: float = 10.0) -> None:
        try:
            super().stop(timeout)
        finally:
            self.network.close()
