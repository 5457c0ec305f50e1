"""The NATS side of a kill trial: one server or a 3-node cluster, and the failures it takes.

``SingleServer`` (``EmbeddedServer`` on a store directory) takes a worker kill, a
server restart, or both at once; ``Cluster`` (``LocalCluster``, R3) takes a worker kill, a
node restart, a takeover (SIGKILL of the node leading ``JL_STEPS``) or a worker kill and a
takeover at once, and heals after each round: the killed node restarted on its store, every
replica caught up.

Every server starts with the config ``jetloop up`` writes, for three namespaces
(``NAMESPACES``, each a NATS account; the credentials in ``auth_store``) and the system
account (``SYS``) with its ``watch`` user: workers serve every namespace and may hear other
workers' connections close (``JETLOOP_NATS_WATCH_PASSWORD``, from ``watch_password``). A
connection without a user acts as the default namespace's workers, so the harness's own
looks at the servers connect as before. Used by ``jetloop.tooling.trials.run``.

With ``system_account=False`` (``jetloop trials --no-system-account``) the servers are those
of a user's own or a managed NATS: no system account user at all, and no watch password in
the store directory either, so workers hear no connection close and find a dead worker's
steps by the slower paths (leases, a new worker's sweep).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from nats.errors import Error as NatsError

from jetloop.services import durability, namespaces
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.natsauth import SYSTEM_ACCOUNT, make_users, server_config, system_account
from jetloop.services.rescue import CONNECTION_PREFIX
from jetloop.services.settings import NATS_USERS_FILE, WATCH_USER
from jetloop.services.storefiles import replace
from jetloop.streams import topology
from jetloop.streams.connection import connect
from jetloop.tooling.trials.cluster import LocalCluster
from jetloop.tooling.trials.harness import WorkerProcess


@dataclass(frozen=True)
class Kill:
    """When a failure struck, on both clocks, and how long a restarted server took."""

    at: float  # time.monotonic() of the kill
    wall: float  # time.time() of the same moment: workers stamp events with this clock
    restart: float | None = None  # seconds until a killed server accepted connections again
    # Workers whose link went silent with the failure (their node paused): cut off from the
    # servers past their lease, they are taken for dead by design (docs/design.md, "What is
    # not promised"), so a takeover of their steps is no false one.
    cut_off: frozenset[str] = frozenset()

    @classmethod
    def now(cls, cut_off: frozenset[str] = frozenset()) -> Kill:
        return cls(at=time.monotonic(), wall=time.time(), cut_off=cut_off)


def worker_ids(connection_names: list[str]) -> frozenset[str]:
    """The workers among connection names (``jetloop-worker-<id>#<incarnation>``)."""
    return frozenset(
        n.removeprefix(CONNECTION_PREFIX).partition("#")[0]
        for n in connection_names
        if n.startswith(CONNECTION_PREFIX)
    )


def write_server_config(path: Path, watch_password: str) -> Path:
    """nats-server's config (JSON is valid config syntax): the system account, the ``watch``
    user; readable by this user only, as ``jetloop up`` writes its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(system_account(watch_password), indent=2) + "\n")
    return path


# Every trial's turns are spread over three namespaces, each a NATS account of its own
# (docs/design.md, "Namespaces"): the workers serve all of them, a kill hits all of them.
NAMESPACES = ("default", "t1", "t2")


def write_namespaced_config(
    base: Path,
    names: Sequence[str] = NAMESPACES,
    sync: str = durability.ALWAYS,
    system_account: bool = True,
) -> tuple[Path, str | None, Path]:
    """The config of ``jetloop up``'s server, with the namespaces ``names`` and the sync policy
    ``sync`` (``jetloop.services.durability``; always, as ``up``'s default): (its path, the
    watch user's password, the store directory that holds every namespace's credentials).

    ``system_account=False``: no system account user in the config and no watch password in
    the store (``without_watch``); the password returned is then None."""
    store = base / "auth"
    store.mkdir(parents=True, exist_ok=True)
    users = make_users(store)
    for ns in names:
        if not namespaces.exists(store, ns):
            namespaces.create(store, ns)
    # A connection without a user acts as the default namespace's workers: the harness's
    # own looks at the servers (readiness, leaders) connect so.
    config = {**json.loads(server_config(users, store, sync)), "no_auth_user": namespaces.WORKER}
    watch: str | None = users[WATCH_USER]
    if not system_account:
        config = without_watch(config, store)
        watch = None
    path = base / "nats-server.conf"
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
    return path, watch, store


def without_watch(config: dict[str, Any], store: Path) -> dict[str, Any]:
    """``config`` without the system account and its ``watch`` user, and the store's users
    file without the watch password: a worker given the store directory reads that password
    from it when ``JETLOOP_NATS_WATCH_PASSWORD`` is unset (``jetloop.services.settings``),
    and would otherwise keep trying a user the server does not know."""
    config = {k: v for k, v in config.items() if k != "system_account"}
    config["accounts"] = {k: v for k, v in config["accounts"].items() if k != SYSTEM_ACCOUNT}
    path = store / NATS_USERS_FILE
    users = json.loads(path.read_text())
    users.pop(WATCH_USER, None)
    replace(path, json.dumps(users, indent=2))
    return config


def worker_env(servers: Servers) -> dict[str, str]:
    """What a worker needs to reach ``servers`` beyond their URL: the credentials of every
    namespace (the store directory) and, when the servers have it, the system account's
    watch user (the user name is the default, ``watch``)."""
    env = {"JETLOOP_STORE_DIR": str(servers.auth_store)}
    if servers.watch_password is not None:
        env["JETLOOP_NATS_WATCH_PASSWORD"] = servers.watch_password
    return env


def urls_as(urls: str, store: Path, namespace: str) -> list[str]:
    """``urls`` with the credential of ``namespace``'s workers in each."""
    cred = namespaces.read_credential(store, namespace, namespaces.WORKER)
    assert cred is not None
    user, password = (urllib.parse.quote(x, safe="") for x in (cred.user, cred.password))
    out = []
    for u in urls.split(","):
        scheme, _, rest = u.strip().partition("://")
        out.append(f"{scheme}://{user}:{password}@{rest}")
    return out


# The streams a turn's steps touch: their leaders (and their consumers') must be elected
# again after a takeover before every step can move.
JETLOOP_STREAMS = [
    topology.TURNS_STREAM,
    topology.STEPS_STREAM,
    topology.EVENTS_STREAM,
    f"KV_{topology.STATE_BUCKET}",
]


class Elections(NamedTuple):
    """Seconds from a takeover's kill to a new ``JL_STEPS`` leader, and to new leaders of
    every group the killed node led (the streams a step touches and their consumers): each
    elects on its own, and a step waits for every one it needs."""

    steps: float | None  # None: the node did not lead JL_STEPS
    every_group: float
    # Groups that had no new leader when the harness stopped waiting (named, not timed).
    leaderless: tuple[str, ...] = ()


class Servers(Protocol):
    """The NATS side of a trial run: one server or a cluster, and the failures it can take."""

    replicas: int
    # The system account's ``watch`` password on every server of the run; None when the
    # servers run without the system account's user (``--no-system-account``).
    watch_password: str | None
    # The store directory with every namespace's credentials.
    auth_store: Path

    def urls_as(self, namespace: str) -> list[str]: ...

    @property
    def url(self) -> str: ...

    async def start(self) -> None: ...

    async def fail(self, failure: str, victim: WorkerProcess, rng: random.Random) -> Kill:
        """Apply ``failure``; return when it struck (and a restart's duration)."""
        ...

    async def heal(self) -> Elections | None:
        """After a round: everything restarted and caught up for the next one. Returns the
        seconds from the kill to new leaders, after a takeover."""
        ...

    def close(self) -> None: ...


class SingleServer:
    """One nats-server on a store directory: a worker kill, a server restart, or both."""

    replicas = 1

    def __init__(
        self,
        base: Path,
        sync: str = durability.ALWAYS,
        store: Path | None = None,
        system_account: bool = True,
    ) -> None:
        """``store``: the server's store directory (default ``<base>/store``);
        ``system_account``: as ``write_namespaced_config`` takes it."""
        config, self.watch_password, self.auth_store = write_namespaced_config(
            base, sync=sync, system_account=system_account
        )
        self.server = EmbeddedServer(
            store or base / "store", port=0, log_file=base / "nats.log", config_file=config
        )

    def urls_as(self, namespace: str) -> list[str]:
        return urls_as(self.url, self.auth_store, namespace)

    @property
    def url(self) -> str:
        return self.server.url

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start)
        await self.server.wait_jetstream()

    async def fail(self, failure: str, victim: WorkerProcess, rng: random.Random) -> Kill:
        if failure == "control":
            return Kill.now()  # nothing fails: the moment the others would strike
        if failure == "worker_kill":
            kill = Kill.now()
            victim.kill()
            return kill
        if failure in ("server_restart", "worker_kill+server_restart"):
            kill = Kill.now()
            if failure == "worker_kill+server_restart":
                victim.kill()
            self.server.kill()
            # start() waits for the port with blocking sleeps: keep the event loop free.
            # nats-server opens its client port after it has recovered JetStream's store.
            await asyncio.to_thread(self.server.start)
            return Kill(kill.at, kill.wall, restart=time.monotonic() - kill.at)
        raise ValueError(f"a single server cannot take the failure {failure!r}")

    async def heal(self) -> Elections | None:
        await self.server.wait_jetstream(timeout=30)
        return None

    def close(self) -> None:
        self.server.kill()


class Cluster:
    """Three nodes, R3 streams: leader kills (takeovers), node restarts, worker kills."""

    replicas = 3

    def __init__(
        self,
        base: Path,
        sync: str = durability.ALWAYS,
        store_dirs: Sequence[Path] | None = None,
        monitor: bool = False,
        system_account: bool = True,
        cluster_type: type[LocalCluster] = LocalCluster,
    ) -> None:
        """``store_dirs`` and ``monitor``: as ``LocalCluster`` takes them;
        ``system_account``: as ``write_namespaced_config`` takes it; ``cluster_type``: the
        nodes on loopback, or each in a network namespace (``jetloop.tooling.trials.netns``)."""
        config, self.watch_password, self.auth_store = write_namespaced_config(
            base, sync=sync, system_account=system_account
        )
        self.cluster = cluster_type(
            base / "cluster",
            "jl-trials",
            config_file=config,
            store_dirs=store_dirs,
            monitor=monitor,
        )
        self._healing: asyncio.Task[Elections | None] | None = None

    def urls_as(self, namespace: str) -> list[str]:
        return urls_as(self.url, self.auth_store, namespace)

    @property
    def url(self) -> str:
        return self.cluster.url_string

    async def start(self) -> None:
        self.cluster.start()
        await self.cluster.wait_ready(timeout=60)

    async def fail(self, failure: str, victim: WorkerProcess, rng: random.Random) -> Kill:
        if failure == "worker_kill":
            kill = Kill.now()
            victim.kill()
            return kill
        if failure == "node_restart":
            i = rng.randrange(len(self.cluster.nodes))
            kill = Kill.now()
            self.cluster.kill(i)
            self.cluster.start_node(i)
            self._healing = asyncio.create_task(self._restarted(i))
            return kill
        if failure in ("takeover", "worker_kill+takeover"):
            leader = await self._leader(topology.STEPS_STREAM)
            led = await self.cluster.groups_led_by(leader, JETLOOP_STREAMS)
            kill = Kill.now()
            if failure == "worker_kill+takeover":
                victim.kill()
            self.cluster.kill(leader)
            self._healing = asyncio.create_task(self._restart_after_election(leader, kill.at, led))
            return kill
        raise ValueError(f"a cluster does not take the failure {failure!r}")

    async def _leader(self, stream: str) -> int:
        return await self.cluster.wait_leader(stream, timeout=60)

    async def _restarted(self, node: int) -> Elections | None:
        await self.cluster.wait_node(node, timeout=60)
        return None

    async def _restart_after_election(
        self, node: int, killed_at: float, led: list[tuple[str, str | None]]
    ) -> Elections:
        """Restart ``node`` once every group it led (``JL_STEPS`` among them: the streams
        and consumers it was leader of) has a new leader; the election time is the last."""
        await self.cluster.wait_leader(topology.STEPS_STREAM, not_node=node, timeout=60)
        steps = time.monotonic() - killed_at
        leaderless = await self.cluster.wait_groups(led, not_node=node, timeout=60)
        elected = Elections(steps, time.monotonic() - killed_at, tuple(leaderless))
        self.cluster.start_node(node)
        await self.cluster.wait_node(node, timeout=60)
        return elected

    async def heal(self) -> Elections | None:
        elected = None
        if self._healing is not None:
            task, self._healing = self._healing, None
            elected = await task
        await self._caught_up()
        return elected

    async def _caught_up(self, timeout: float = 60.0) -> None:
        """Every replica of every jetloop stream current, so the next kill meets a whole
        cluster (a lagging replica would make the next election slower, not the engine)."""
        streams = JETLOOP_STREAMS
        deadline = time.monotonic() + timeout
        nc = await connect(self.cluster.urls, "jetloop-trials-health")
        try:
            js = nc.jetstream()
            for stream in streams:
                while True:
                    try:
                        info = await js.stream_info(stream)
                        c = info.cluster
                        if (
                            c is not None
                            and c.leader
                            and c.replicas is not None
                            and len(c.replicas) == self.replicas - 1
                            and all(r.current for r in c.replicas)
                        ):
                            break
                    except (NatsError, TimeoutError):
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"stream {stream} did not catch up in {timeout}s")
                    await asyncio.sleep(0.2)
        finally:
            await nc.close()

    def close(self) -> None:
        if self._healing is not None:
            self._healing.cancel()
        self.cluster.stop()
