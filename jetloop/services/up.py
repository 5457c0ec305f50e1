"""``jetloop up``: the embedded default in one process tree.

Starts nats-server from the wheel on the store directory (unless ``--nats`` names servers),
applies the topology, and runs a worker for every pool with the given app (in a namespace
that ``JETLOOP_NAMESPACE_APPS`` names: its own), the gateway and the projector (``--workers
N``: N worker processes, this one and N-1 children, see ``jetloop.services.processes``).
Ctrl-C stops the gateway, the workers (drain) and the projector, and then the server. Running
it again resumes what was in flight: the state and the queues are in the store directory.

The parts run under a supervisor (``jetloop.services.supervisor``): one that fails is logged
(``component.failed``) and restarted, the others keep serving; the server, our child, is
restarted on the same store if it dies, and dies with us (even by ``kill -9``). ``up``
exits, with one line naming the setting or the component (:class:`UpError`), only for what
a restart cannot mend: another ``up`` on the store (``<store>/up.lock``), a port in use, an
app that does not load, a component failing over and over right at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import shlex
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import nats
import structlog
from pydantic import SecretStr

from jetloop.agents import App, load_app

# Defined with the rest of the public tree; importable from here too.
from jetloop.schemas.errors import UpError as UpError
from jetloop.services import durability, listening, namespaces
from jetloop.services.embedded import (
    EmbeddedServer,
    PortInUse,
    SupervisedServer,
    port_in_use,
    private_dir,
)
from jetloop.services.gateway.app import Gateway
from jetloop.services.gateway.config import GatewayConfig, exposure_error
from jetloop.services.namespaced import Namespaced
from jetloop.services.natsauth import make_users, write_config
from jetloop.services.processes import child_components
from jetloop.services.readmodel.projector import Projector
from jetloop.services.runner import settle_heap
from jetloop.services.settings import LOCAL_USER, WATCH_USER, Settings, make_seal_key
from jetloop.services.supervisor import Component, GaveUp, Supervisor, describe
from jetloop.services.worker import Worker, default_worker_id

log = structlog.get_logger("jetloop.up")


def seal_key(store_dir: Path) -> str:
    """The embedded default's checkpoint key: made once, kept in the store directory, where
    every other process finds it (``jetloop.services.settings``)."""
    return make_seal_key(store_dir)


LOCK_FILE = "up.lock"
SERVER_NAME = "jetloop"
NATS_PORT_SETTING = "JETLOOP_EMBEDDED_PORT / --nats-port"
GATEWAY_PORT_SETTING = "JETLOOP_GATEWAY_PORT / --gateway-port"


def lock_store(store_dir: Path) -> IO[str]:
    """Hold ``<store>/up.lock`` for as long as the returned file is open (the process lives);
    :func:`release_store` removes it when ``up`` ends, so the file is there only while an
    ``up`` runs (or one was killed). The store is made (or tightened to) 0700 first: it holds
    every secret and conversation."""
    private_dir(store_dir)
    path = store_dir / LOCK_FILE
    while True:
        f = open(path, "a+")  # held open: the lock lives as long as the file
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "unknown"
            f.close()
            raise UpError(f"another `jetloop up` is using store {store_dir} (pid {pid})") from None
        if _still_there(f, path):
            break
        # An `up` that ended removed the file between our open and our lock: the lock we hold
        # is on a file no other `up` will find. Take the one at the path now.
        f.close()
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _still_there(f: IO[str], path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return False


def release_store(lock: IO[str]) -> None:
    """Remove ``up.lock`` and let go of it, whether ``up`` stopped or could not start. Removed
    while still held: an ``up`` starting meanwhile either fails on the held lock or finds the
    file gone (``lock_store`` checks) and makes a new one, never shares a lock."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock.name)
    lock.close()


async def _accepted(urls: list[str], timeout: float = 10.0) -> None:
    """Until the server takes these credentials (a reload is applied within milliseconds)."""
    deadline = time.monotonic() + timeout

    async def quiet(exc: Exception) -> None:
        pass  # refused until the reload is applied: asked again below

    while True:
        try:
            nc = await nats.connect(
                urls, max_reconnect_attempts=0, connect_timeout=2, error_cb=quiet
            )
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
            continue
        await nc.close()
        return


def in_store(store_dir: Path) -> str:
    """What a command pasted from a hint needs to find this ``up`` (its store directory,
    which says where it listens): nothing in the directory it runs in, with the default."""
    if store_dir == Path(".jetloop"):
        return ""
    return f"JETLOOP_STORE_DIR={shlex.quote(str(store_dir))} "


def nats_port_taken(port: int) -> str:
    return f"port {port} of the embedded nats-server is in use: set {NATS_PORT_SETTING}"


def gateway_port_taken(host: str, port: int) -> str:
    return f"gateway port {port} on {host} is in use: set {GATEWAY_PORT_SETTING}"


def server_fatal(exc: BaseException) -> str | None:
    if isinstance(exc, PortInUse):
        return nats_port_taken(exc.port)
    if isinstance(exc, FileNotFoundError):  # no nats-server binary: the message says what to do
        return str(exc)
    return None


def gateway_fatal(host: str, port: int) -> Callable[[BaseException], str | None]:
    def fatal(exc: BaseException) -> str | None:
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            return gateway_port_taken(host, port)
        if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EADDRNOTAVAIL):
            return (
                f"the gateway cannot listen on {host}:{port} ({exc.strerror}): "
                f"set JETLOOP_GATEWAY_HOST / {GATEWAY_PORT_SETTING}"
            )
        return None

    return fatal


def load_apps(settings: Settings) -> dict[str, App]:
    """Every app ``up`` may serve, by spec: JETLOOP_APP's and each of JETLOOP_NAMESPACE_APPS'
    (a namespace made while ``up`` runs is served at once, so none waits until then to
    load); :class:`UpError` naming the setting of one that does not load."""
    named: list[tuple[str | None, str]] = [(None, settings.app), *settings.namespace_apps.items()]
    apps: dict[str, App] = {}
    for ns, spec in named:
        if spec in apps:
            continue
        try:
            apps[spec] = load_app(spec)
        except Exception as exc:  # the user's module: anything may come out of its import
            setting = (
                "JETLOOP_APP / --app"
                if ns is None
                else f"JETLOOP_NAMESPACE_APPS / --namespace-app {ns}={spec}"
            )
            raise UpError(f"setting {setting} {spec!r}: {describe(exc)}") from None
    return apps


async def run_up(settings: Settings, external: bool, command: str = "jetloop") -> None:
    """Run until SIGINT/SIGTERM; :class:`UpError` when it cannot (nothing left running).
    ``command`` is how the user runs the CLI (``.venv/bin/jetloop``), for the hint."""
    lock = lock_store(settings.store_dir)
    try:
        await _run_up(settings, external, command)
    except GaveUp as exc:
        raise UpError(str(exc)) from None
    finally:
        listening.forget(settings.store_dir)
        release_store(lock)


async def _run_up(settings: Settings, external: bool, command: str) -> None:
    # What a restart cannot mend is told now, before anything starts.
    apps = load_apps(settings)
    app = apps[settings.app_of(settings.namespace)]
    host, port = settings.gateway_host, settings.gateway_port
    # Both ports told at once: a person mends both before the next try.
    taken = []
    if not external and port_in_use(settings.embedded_port):
        taken.append(nats_port_taken(settings.embedded_port))
    if port_in_use(port, host):
        taken.append(gateway_port_taken(host, port))
    if taken:
        raise UpError("; ".join(taken))

    stages: list[list[Component]] = []
    server: EmbeddedServer | None = None
    # What the running server's config was made of (None with servers started elsewhere):
    # the namespaces' parts reload it only once the store's credentials change.
    known: list[list[str] | None] = [None]
    if external:
        log.info(
            "nats.durability",
            sync="set by your servers",
            hint="sync_interval: always in their jetstream block, or an OS crash or a power "
            "cut can take back what they acknowledged (docs/design.md, What an "
            "acknowledgement survives)",
        )
    else:
        # The default namespace's data moves out of the server's global account once, with
        # the server stopped (jetloop.services.namespaces).
        try:
            if namespaces.migrate_default(settings.store_dir):
                log.info("namespace.migrated", namespace=namespaces.DEFAULT)
        except namespaces.NamespaceError as exc:
            raise UpError(str(exc)) from None
        # Said first: what an acknowledgement survives here (jetloop.services.durability).
        log.info(
            "nats.durability",
            sync=settings.nats_sync,
            survives=durability.survives(settings.nats_sync),
        )
        # NATS authorization: users with the permissions of their roles (jetloop.services.natsauth);
        # every part of `up` connects as the worker.
        users = make_users(settings.store_dir)
        password = users[LOCAL_USER]
        # The namespaces the config written just below holds: the server knows these.
        known[0] = namespaces.listing(settings.store_dir)
        server = EmbeddedServer(
            settings.store_dir,
            name=SERVER_NAME,
            port=settings.embedded_port,  # 0: a free port, kept across restarts
            log_file=settings.store_dir / "nats-server.log",
            config_file=write_config(settings.store_dir, SERVER_NAME, settings.nats_sync),
            auth=(LOCAL_USER, password),
        )
        settings = settings.model_copy(
            update={
                "nats_url": server.url,
                "nats_user": LOCAL_USER,
                "nats_password": SecretStr(password),
                "nats_watch_password": SecretStr(users[WATCH_USER]),
            }
        )
        stages.append([Component("nats-server", lambda: SupervisedServer(server), server_fatal)])
    os.environ.setdefault("JETLOOP_VENDOR_DB", str(settings.store_dir / "vendor.sqlite"))
    if settings.seal_key is None:
        # Kept in the store directory, where the worker processes, the CLI and the gateway
        # read it; never put in this process's environment, which every child inherits
        # (nats-server, a tool's subprocess).
        settings = settings.model_copy(update={"seal_key": SecretStr(seal_key(settings.store_dir))})
    gw_config = GatewayConfig.from_settings(settings)
    # The namespaces a request without a token may act in (None: the default one alone).
    anonymous_namespaces: Callable[[], frozenset[str]] | None = None
    if settings.gateway_anonymous_scopes is None and not gw_config.tokens:
        # Without tokens a person at this machine may do all (the default host is loopback),
        # in every namespace of the store (the console opens each); on any other address
        # that is refused below, unless the user allowed it in words.
        gw_config = gw_config.model_copy(
            update={"anonymous_scopes": frozenset({"read", "write", "approve"})}
        )

        def anonymous_namespaces() -> frozenset[str]:
            return frozenset(namespaces.names(settings.store_dir))

    refused = exposure_error(gw_config, host)
    if refused is not None:
        raise UpError(refused)
    readmodel_db = gw_config.readmodel_db
    assert readmodel_db is not None
    urls = settings.nats_urls

    def intake(ns: str) -> dict[str, object]:
        """What ``ns``'s workers keep of its limits (``jetloop namespace limits``): the turn
        requests a second a worker process takes in, else as JETLOOP_TURN_RATE says."""
        try:
            limits = namespaces.read_limits(settings.store_dir, ns)
        except namespaces.NamespaceError as exc:
            log.warning("namespace.limits_unreadable", namespace=ns, error=str(exc))
            limits = namespaces.NO_LIMITS
        rate = settings.turn_rate if limits.turn_rate is None else limits.turn_rate
        return {"turn_rate": rate}

    # The app a namespace's processes load (JETLOOP_NAMESPACE_APPS, else JETLOOP_APP).
    worker_settings = settings.model_copy(
        update={
            "app": settings.app_of(settings.namespace),
            **intake(settings.namespace),
        }
    )
    # One worker in this process; with --workers N, N-1 more in child processes
    # (jetloop.services.processes) named after it: <id>-2 … <id>-N.
    worker_id = settings.worker_id or default_worker_id()
    children = child_components(
        worker_settings, worker_id, range(2, settings.worker_processes + 1), log_format="console"
    )
    # The workers first: they apply the topology the projector reads. Stopped in reverse:
    # the gateway (no new turns) and the projector, then the workers (drain), then the server.
    stages.append(
        [Component("worker", lambda: Worker(worker_settings, app, worker_id=worker_id)), *children]
    )

    def namespace_parts(ns: str) -> list[list[Component]]:
        """What serves one more namespace: a worker (and its children) with the namespace's
        app, then a projector (it reads the streams the worker makes)."""
        spec = settings.app_of(ns)
        ns_settings = settings.for_namespace(ns).model_copy(
            update={"metrics_port": None, "app": spec, **intake(ns)}
        )
        ns_app = apps[spec]
        db = namespaces.readmodel_path(readmodel_db, ns)
        return [
            [
                Component(
                    f"worker[{ns}]", lambda: Worker(ns_settings, ns_app, worker_id=worker_id)
                ),
                *child_components(
                    ns_settings,
                    worker_id,
                    range(2, settings.worker_processes + 1),
                    log_format="console",
                    name=f"worker[{ns}]",
                ),
            ],
            [Component(f"projector[{ns}]", lambda: Projector(ns_settings.nats_urls, db))],
        ]

    async def accept(new: list[str]) -> None:
        """Make the server know every namespace and credential before anything connects to a
        new one."""
        if server is None:
            return  # servers started elsewhere: their config is their operator's
        write_config(settings.store_dir, SERVER_NAME, settings.nats_sync)
        server.reload()
        for ns in new:
            await _accepted(settings.for_namespace(ns).nats_urls)

    stages.append(
        [
            Component(
                "gateway",
                lambda: Gateway(
                    gw_config,
                    urls,
                    host,
                    port,
                    urls_for=lambda ns: settings.for_namespace(ns).nats_urls,
                    anonymous_namespaces=anonymous_namespaces,
                ),
                gateway_fatal(host, port),
            ),
            Component("projector", lambda: Projector(urls, readmodel_db)),
            Component(
                "namespaces",
                lambda: Namespaced(
                    settings.store_dir,
                    namespace_parts,
                    accept=accept,
                    known=known[0],
                    # A namespace's workers are made again when its intake limits change.
                    settings=intake,
                ),
            ),
        ]
    )

    def announce() -> None:
        settle_heap(settings.gc_threshold)
        gateway = sup.instance("gateway")
        # Where every other command run on this store finds the server (a custom port too).
        listening.record(
            settings.store_dir,
            settings.nats_url,
            getattr(gateway, "url", None),
            embedded=server is not None,
        )
        log.info(
            "jetloop.up",
            nats=settings.nats_url,
            gateway=getattr(gateway, "url", None),
            hint=f"try: {in_store(settings.store_dir)}{command} chat --agent demo",
        )

    sup = Supervisor(stages, on_started=announce)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.stop_soon)
    try:
        await sup.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
