"""A three-node JetStream cluster on loopback, for tests that need replication and failover.

``EmbeddedServer`` covers one server; this starts several nats-server processes that route to each
other, so a test can create R3 streams, SIGKILL the node that leads one, watch the raft election and
restart the node on its old store. Each node gets its own client port, route port, ``server_name``
and store directory (docs/design.md, JetStream facts: a cluster on one host needs all four
distinct), and logs to ``<base_dir>/<name>.log``. A ``config_file`` (nats-server's ``-c``, say one
naming a system account) is given to every node; the command-line flags override it.

    cluster = LocalCluster(tmp_path, "jl-test")
    cluster.start()
    try:
        await cluster.wait_ready()
        i = await cluster.stream_leader("JL_STEPS")
        cluster.kill(i)
        await cluster.wait_leader("JL_STEPS", not_node=i)
    finally:
        cluster.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamManager

from jetloop.services.embedded import connect_or_close, free_port, server_binary

# How often the wait loops look again: well under an election (seconds), so a waiter
# notices a new leader promptly without hammering the JetStream API.
POLL_SECONDS = 0.1
QUERY_SECONDS = 0.5


async def _consumer_names(jsm: JetStreamManager, stream: str, timeout: float) -> list[str]:
    """The names of ``stream``'s consumers (the meta leader answers, no consumer leader)."""
    reply = await jsm._nc.request(f"{jsm._prefix}.CONSUMER.NAMES.{stream}", b"{}", timeout=timeout)
    return list(json.loads(reply.data).get("consumers") or [])


class NoLeaderError(LookupError):
    """The asset exists (or is being created) but has no leader right now."""


@dataclass
class ClusterNode:
    """One member of a ``LocalCluster``: its ports and directories stay fixed across restarts."""

    index: int
    name: str
    port: int
    route_port: int
    store_dir: Path
    log_file: Path
    proc: subprocess.Popen[bytes] | None = None
    # The address it listens on: loopback, or its own network namespace's
    # (``jetloop.tooling.trials.netns``).
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def route_url(self) -> str:
        return f"nats://{self.host}:{self.route_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _distinct_free_ports(count: int) -> list[int]:
    # free_port() releases the port before returning, so the kernel may hand the same number
    # out twice; two nodes on one port would fail in a way that looks like a flaky election.
    ports: list[int] = []
    while len(ports) < count:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


async def _quiet_error_cb(exc: Exception) -> None:
    # Refused connections to a killed node are expected here; nats-py's default callback
    # would log each one as an error.
    return None


class LocalCluster:
    """Several nats-server processes with JetStream, routed into one cluster on 127.0.0.1."""

    def __init__(
        self,
        base_dir: Path,
        cluster_name: str = "jetloop",
        size: int = 3,
        config_file: Path | None = None,
        store_dirs: Sequence[Path] | None = None,
        monitor: bool = False,
    ) -> None:
        """``store_dirs``: each node's store directory (default ``<base_dir>/n<i>``), e.g. one
        power-cut filesystem per node (``jetloop.tooling.powercut``); ``monitor``: each node
        serves its monitoring endpoint (``connection_names``)."""
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        if store_dirs is not None and len(store_dirs) != size:
            raise ValueError(f"{len(store_dirs)} store directories for {size} nodes")
        self.base_dir = Path(base_dir)
        self.cluster_name = cluster_name
        self.config_file = config_file
        ports = _distinct_free_ports(3 * size if monitor else 2 * size)
        self.monitor_ports = ports[2 * size :]
        self.nodes = [
            ClusterNode(
                index=i,
                name=f"n{i + 1}",
                port=ports[2 * i],
                route_port=ports[2 * i + 1],
                store_dir=(
                    Path(store_dirs[i]) if store_dirs is not None else self.base_dir / f"n{i + 1}"
                ),
                log_file=self.base_dir / f"n{i + 1}.log",
            )
            for i in range(size)
        ]

    # -- addresses ---------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """Client URLs of every node, in node order (give all of them to a client)."""
        return [n.url for n in self.nodes]

    @property
    def url_string(self) -> str:
        """The client URLs comma-joined, as ``--nats`` and ``JETLOOP_NATS_URL`` take them."""
        return ",".join(self.urls)

    @property
    def names(self) -> list[str]:
        """Server names in node order: ``names[i]`` is what JetStream reports for node ``i``."""
        return [n.name for n in self.nodes]

    def index_of(self, server_name: str) -> int:
        """The node index of a server name as JetStream reports it (a leader, a peer)."""
        try:
            return self.names.index(server_name)
        except ValueError:
            raise LookupError(f"{server_name!r} is not a node of {self.cluster_name}") from None

    # -- processes ---------------------------------------------------------------------------

    def _args(self, node: ClusterNode) -> list[str]:
        routes = ",".join(n.route_url for n in self.nodes if n is not node)
        config = ["-c", str(self.config_file)] if self.config_file is not None else []
        args = [
            server_binary(),
            *config,
            "--jetstream",
            "--store_dir",
            str(node.store_dir),
            "--server_name",
            node.name,
            "--addr",
            node.host,
            "--port",
            str(node.port),
            "--cluster",
            node.route_url,
            "--cluster_name",
            self.cluster_name,
        ]
        if routes:
            args += ["--routes", routes]
        if self.monitor_ports:
            args += ["--http_port", str(self.monitor_ports[node.index])]
        return args

    def _command(self, node: ClusterNode) -> list[str]:
        """How node's process is started: its arguments (a subclass may run it elsewhere)."""
        return self._args(node)

    def answering(self) -> list[ClusterNode]:
        """The nodes a query asks: the running ones (a subclass leaves out those cut off)."""
        return [n for n in self.nodes if n.running]

    def connection_names(self, i: int) -> list[str]:
        """The names of the client connections node ``i`` holds now, every account's (its
        monitoring endpoint's ``/connz``; the cluster must be made with ``monitor``)."""
        url = f"http://{self.nodes[i].host}:{self.monitor_ports[i]}/connz?limit=4096"
        with urllib.request.urlopen(url, timeout=5) as reply:
            conns = json.load(reply).get("connections") or []
        return [str(c.get("name") or "") for c in conns]

    def start(self) -> None:
        """Launch every node that is not running; ``wait_ready`` tells when the cluster serves.

        Nodes are only spawned here, not waited on: clustered JetStream needs a quorum to elect
        a meta leader, so no single node is useful before the others are up anyway.
        """
        self.base_dir.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            self._spawn(node)

    def start_node(self, i: int) -> None:
        """(Re)start node ``i`` on its old store directory and ports, e.g. after ``kill(i)``."""
        self._spawn(self.nodes[i])

    def _spawn(self, node: ClusterNode) -> None:
        if node.running:
            return
        node.store_dir.mkdir(parents=True, exist_ok=True)
        with open(node.log_file, "ab") as out:  # the child keeps its own descriptor
            node.proc = subprocess.Popen(
                self._command(node),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (a crash: no flush, no leadership hand-off) and reap it."""
        if self._signal(i, signal.SIGKILL):
            proc = self.nodes[i].proc
            assert proc is not None
            proc.wait()

    def pause(self, i: int) -> None:
        """SIGSTOP node ``i``: alive to the kernel (its connections stay open) but silent, as a
        process stalled by its machine."""
        self._signal(i, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        """SIGCONT node ``i`` after ``pause``."""
        self._signal(i, signal.SIGCONT)

    def _signal(self, i: int, sig: signal.Signals) -> bool:
        """Send ``sig`` to node ``i`` if it runs (False: it does not)."""
        node = self.nodes[i]
        if node.proc is None or node.proc.poll() is not None:
            return False
        os.kill(node.proc.pid, sig)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every node, then SIGKILL whatever is still alive after ``timeout``."""
        live = [n for n in self.nodes if n.running]
        for node in live:
            assert node.proc is not None
            node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in live:
            assert node.proc is not None
            try:
                node.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(node.index)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        self.start()
        try:
            await self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _check_alive(self, indexes: list[int]) -> None:
        # A node that exits at once (a port taken since free_port looked) would otherwise
        # show up only as a wait_ready timeout.
        for i in indexes:
            node = self.nodes[i]
            if node.proc is not None and node.proc.poll() is not None:
                tail = self.log_tail(i)
                raise RuntimeError(
                    f"nats-server {node.name} exited with {node.proc.returncode}; log:\n{tail}"
                )

    def log_tail(self, i: int, lines: int = 20) -> str:
        """The last lines of node ``i``'s log, for failure messages."""
        try:
            text = self.nodes[i].log_file.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- JetStream queries -------------------------------------------------------------------

    @asynccontextmanager
    async def _admin(
        self, urls: list[str] | None = None, timeout: float = 2.0
    ) -> AsyncIterator[JetStreamManager]:
        # A fresh short-lived connection per query: the harness owns no connection that a
        # test would have to close, and a query never waits on a reconnect to a dead node.
        servers = urls if urls is not None else [n.url for n in self.answering()]
        if not servers:
            raise ConnectionError(f"no node of {self.cluster_name} is running")
        nc: Client = await connect_or_close(
            servers,
            name="jetloop-cluster-harness",
            connect_timeout=1,
            # Bounded: each server is tried at most twice, then NoServersError.
            max_reconnect_attempts=1,
            reconnect_time_wait=0.1,
            error_cb=_quiet_error_cb,
        )
        try:
            yield nc.jsm(timeout=timeout)
        finally:
            await nc.close()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every running node answers JetStream requests, so a meta leader exists.

        Each node is asked through its own URL (not "any node"): a node answers once it has
        routes to the cluster and there is a meta leader, which is what an R3 create right
        after needs. It proves the node reaches the meta leader, not that it is caught up.
        """
        await self._wait_nodes([n.index for n in self.nodes if n.proc is not None], timeout)

    async def wait_node(self, i: int, timeout: float = 30.0) -> None:
        """Wait until node ``i`` (say after ``start_node``) answers JetStream requests."""
        await self._wait_nodes([i], timeout)

    async def _wait_nodes(self, indexes: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        pending = list(indexes)
        while pending:
            self._check_alive(pending)
            i = pending[0]
            try:
                async with self._admin([self.nodes[i].url], timeout=1.0) as jsm:
                    await jsm.account_info()
                pending.pop(0)
                continue
            except Exception as exc:
                last = exc
            if time.monotonic() > deadline:
                names = ", ".join(self.nodes[j].name for j in pending)
                raise TimeoutError(
                    f"JetStream not ready on {names} within {timeout}s: {last!r}\n"
                    f"{self.log_tail(i)}"
                )
            await asyncio.sleep(POLL_SECONDS)

    async def stream_leader(self, stream: str, timeout: float = 2.0) -> int:
        """Index of the node leading ``stream``.

        During an election the request usually times out (the old leader is the one that
        would answer); ``NoLeaderError`` if an answer names no leader.
        """
        async with self._admin(timeout=timeout) as jsm:
            info = await jsm.stream_info(stream)
        leader = info.cluster.leader if info.cluster is not None else None
        if not leader:
            raise NoLeaderError(f"stream {stream} has no leader")
        return self.index_of(leader)

    async def consumer_leader(self, stream: str, consumer: str, timeout: float = 2.0) -> int:
        """Index of the node leading ``consumer`` on ``stream`` (may differ from the stream's)."""
        async with self._admin(timeout=timeout) as jsm:
            info = await jsm.consumer_info(stream, consumer)
        leader = info.cluster.leader if info.cluster is not None else None
        if not leader:
            raise NoLeaderError(f"consumer {stream}/{consumer} has no leader")
        return self.index_of(leader)

    async def groups_led_by(
        self, node: int, streams: list[str], timeout: float = 2.0
    ) -> list[tuple[str, str | None]]:
        """The raft groups ``node`` leads among ``streams`` and their consumers, as
        ``(stream, None)`` or ``(stream, consumer)``: each elects a new leader on its own when
        the node dies, and a step waits for every one it touches.

        Each consumer is asked on its own (its name from the meta leader's list): a listing
        of every consumer's info waits for all their leaders, and one group without a leader
        (nats-server leaves an idle consumer catching up for a while after a partition heals)
        would make it time out. A group that does not answer is led by nobody now.
        """
        led: list[tuple[str, str | None]] = []
        name = self.nodes[node].name
        async with self._admin(timeout=timeout) as jsm:
            for stream in streams:
                with contextlib.suppress(NatsError, TimeoutError):
                    info = await jsm.stream_info(stream)
                    if info.cluster is not None and info.cluster.leader == name:
                        led.append((stream, None))
                for consumer in await _consumer_names(jsm, stream, timeout):
                    try:
                        c = await jsm.consumer_info(stream, consumer, timeout=QUERY_SECONDS)
                    except (NatsError, TimeoutError):
                        continue
                    # An ephemeral consumer (a follower's) lives on one node and dies with it.
                    if not c.config.durable_name:
                        continue
                    if c.cluster is not None and c.cluster.leader == name:
                        led.append((stream, c.name))
        return led

    async def wait_groups(
        self, groups: list[tuple[str, str | None]], not_node: int, timeout: float = 60.0
    ) -> list[str]:
        """Wait until every one of ``groups`` has a leader other than ``not_node``; the names
        (``stream`` or ``stream/consumer``) of those that still had none after ``timeout``."""
        deadline = time.monotonic() + timeout
        leaderless: list[str] = []
        for stream, consumer in groups:
            left = max(QUERY_SECONDS, deadline - time.monotonic())
            try:
                if consumer is None:
                    await self.wait_leader(stream, not_node=not_node, timeout=left)
                else:
                    await self.wait_consumer_leader(
                        stream, consumer, not_node=not_node, timeout=left
                    )
            except TimeoutError:
                leaderless.append(stream if consumer is None else f"{stream}/{consumer}")
        return leaderless

    async def kv_leader(self, bucket: str, timeout: float = 2.0) -> int:
        """Index of the node leading the stream behind KV bucket ``bucket``."""
        return await self.stream_leader(f"KV_{bucket}", timeout)

    async def wait_leader(
        self, stream: str, not_node: int | None = None, timeout: float = 30.0
    ) -> int:
        """Wait until ``stream`` has a leader (other than ``not_node``) and return its index."""
        return await self._wait_for_leader(
            lambda t: self.stream_leader(stream, t), f"stream {stream}", not_node, timeout
        )

    async def wait_consumer_leader(
        self, stream: str, consumer: str, not_node: int | None = None, timeout: float = 30.0
    ) -> int:
        """Wait until ``consumer`` has a leader (other than ``not_node``) and return its index."""
        return await self._wait_for_leader(
            lambda t: self.consumer_leader(stream, consumer, t),
            f"consumer {stream}/{consumer}",
            not_node,
            timeout,
        )

    async def _wait_for_leader(
        self,
        query: Callable[[float], Awaitable[int]],
        what: str,
        not_node: int | None,
        timeout: float,
    ) -> int:
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            try:
                # Short requests: a timeout is the usual answer mid-election, and a long
                # one would delay noticing the new leader by up to its length.
                leader = await query(QUERY_SECONDS)
                # A dead node can still be reported for a moment: the answer may come from a
                # peer that has not yet noticed the leader is gone.
                if leader != not_node and self.nodes[leader].running:
                    return leader
                last = f"leader still {self.nodes[leader].name}"
            except Exception as exc:
                # Timeouts, "no responders" and 503s are all what an election looks like
                # from outside.
                last = exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} had no new leader within {timeout}s: {last!r}")
            await asyncio.sleep(POLL_SECONDS)
