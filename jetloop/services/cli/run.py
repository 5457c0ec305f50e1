"""Commands that run things: ``up``, ``worker``, ``topology``, and the tooling's ``trials`` and
``bench``; ``gateway`` and ``projector`` come from their own packages."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from jetloop.services.logs import configure
from jetloop.tooling.trials import MODES as TRIAL_MODES

if TYPE_CHECKING:
    from jetloop.agents import App
    from jetloop.services.client import Client
    from jetloop.services.settings import Settings

from jetloop.services.cli.main import (
    _client_cmd,
    _run,
    _settings,
    invoked_as,
    main,
    namespace_option,
)


@main.command()
@click.option("--nats", "nats_url", help="use these NATS server(s) instead of starting one")
@click.option("--app", help="agents to serve, module:attr (default: the demo agent)")
@click.option("--store-dir", type=click.Path(), help="store directory (default .jetloop)")
@click.option(
    "--nats-port", "--port", "embedded_port", type=int, help="port of the embedded server"
)
@click.option("--gateway-port", type=int, help="port of the gateway (HTTP API)")
@click.option(
    "--nats-sync",
    help="when the embedded server puts an acknowledged write on disk: always (default) or "
    "an interval such as 2m (faster; a power cut loses what was acknowledged since)",
)
@click.option(
    "--allow-anonymous-remote",
    is_flag=True,
    default=None,
    help="without tokens, serve every scope to anyone who reaches JETLOOP_GATEWAY_HOST "
    "even when it is not loopback",
)
@click.option(
    "--workers",
    "worker_processes",
    type=click.IntRange(1, 256),
    help="worker processes: this one and N-1 children (default JETLOOP_WORKER_PROCESSES, 1)",
)
@click.option(
    "--namespace-app",
    "namespace_apps",
    multiple=True,
    metavar="NS=MODULE:ATTR",
    help="serve namespace NS with this app instead of --app (repeatable; default "
    "JETLOOP_NAMESPACE_APPS)",
)
def up(
    nats_url: str | None,
    app: str | None,
    store_dir: str | None,
    embedded_port: int | None,
    gateway_port: int | None,
    nats_sync: str | None,
    allow_anonymous_remote: bool | None,
    worker_processes: int | None,
    namespace_apps: tuple[str, ...],
) -> None:
    """Start nats-server (embedded), the topology, a worker with the demo agent (or --workers
    N), the gateway and the projector; restart any of them that fails."""
    from jetloop.services.up import UpError, run_up

    s = _settings(
        nats_url=nats_url,
        app=app,
        namespace_apps=",".join(namespace_apps) if namespace_apps else None,
        store_dir=store_dir,
        embedded_port=embedded_port,
        gateway_port=gateway_port,
        nats_sync=nats_sync,
        gateway_allow_anonymous_remote=allow_anonymous_remote,
        worker_processes=worker_processes,
    )
    configure("console", s.log_level)
    try:
        _run(run_up(s, external=nats_url is not None, command=invoked_as()), s)
    except UpError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--app", help="agents to serve, module:attr")
@click.option("--nats", "nats_url", help="NATS server URL(s), comma-separated")
@click.option(
    "--pools",
    default=None,
    help="which step pools this worker serves, comma-separated: session, model, tool, and "
    "the pools of their own that the app's tools name (default: all of those the app makes)",
)
@click.option("--id", "worker_id", help="worker name in claims and logs")
@click.option(
    "--namespace",
    "served",
    multiple=True,
    metavar="NAME",
    help="a namespace to serve (repeat for more; `all`: every namespace of the store, also "
    "those made later); default JETLOOP_NAMESPACE, else default",
)
@click.option(
    "--processes",
    type=click.IntRange(1, 256),
    help="run this many worker processes, ids <id>-1 … <id>-N (default "
    "JETLOOP_WORKER_PROCESSES, 1: this process is the worker)",
)
def worker(
    app: str | None,
    nats_url: str | None,
    pools: str | None,
    worker_id: str | None,
    served: tuple[str, ...],
    processes: int | None,
) -> None:
    """Run a worker (or --processes N of them) against existing NATS servers."""
    from jetloop.services.runner import settle_when_started
    from jetloop.services.worker import Worker, default_worker_id, served_pools

    several = len(served) > 1 or "all" in served
    s = _settings(
        app=app,
        nats_url=nats_url,
        worker_id=worker_id,
        worker_processes=processes,
        namespace=None if several or not served else served[0],
    )
    wid = s.worker_id or default_worker_id()
    configure(s.log_format, s.log_level, worker=wid)
    # A namespace named in JETLOOP_NAMESPACE_APPS is served by its own app.
    apps = _apps(s, [s.namespace] if not several else [None, *s.namespace_apps])
    loaded = apps[s.app_of(s.namespace)]
    pool_names = None if pools is None else [p.strip() for p in pools.split(",") if p.strip()]
    try:
        for ns_app in {id(a): a for a in apps.values()}.values():
            served_pools(ns_app, pool_names)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if several:
        if s.worker_processes > 1:
            raise click.ClickException("--processes takes one --namespace")
        _run(_namespaces(s, served, lambda ns: apps[s.app_of(ns)], pool_names, wid), s)
        return
    s = s.model_copy(update={"app": s.app_of(s.namespace)})  # what its processes load
    if s.worker_processes > 1:
        from jetloop.services.processes import run_worker_processes
        from jetloop.services.supervisor import GaveUp

        try:
            _run(run_worker_processes(s, wid, pool_names))
        except GaveUp as exc:
            raise click.ClickException(str(exc)) from None
        return

    async def go() -> None:
        import signal

        w = Worker(s, loaded, pools=pool_names, worker_id=wid)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, w.stop_soon)
        settle = asyncio.create_task(settle_when_started(w.wait_started(), s.gc_threshold))
        try:
            await w.run()
        finally:
            settle.cancel()

    _run(go(), s)


def _apps(s: Settings, served: list[str | None]) -> dict[str, App]:
    """The apps of the namespaces ``served`` (JETLOOP_NAMESPACE_APPS, else JETLOOP_APP; None:
    JETLOOP_APP), by spec, each loaded once; one that does not load is an error naming its
    setting."""
    from jetloop.agents import load_app

    apps: dict[str, App] = {}
    for ns in served:
        spec = s.app if ns is None else s.app_of(ns)
        if spec in apps:
            continue
        try:
            apps[spec] = load_app(spec)
        except (ValueError, ImportError) as exc:
            if ns in s.namespace_apps:
                raise click.ClickException(
                    f"setting JETLOOP_NAMESPACE_APPS ({ns}={spec}): {exc}"
                ) from None
            raise click.ClickException(f"setting JETLOOP_APP / --app: {exc}") from None
    return apps


async def _namespaces(
    s: Settings,
    served: tuple[str, ...],
    app_of: Callable[[str], App],
    pools: list[str] | None,
    wid: str,
) -> None:
    """One worker per namespace served, from the store directory's credentials of each, with
    the namespace's app (JETLOOP_NAMESPACE_APPS, else JETLOOP_APP)."""
    import signal

    from jetloop.services import namespaces
    from jetloop.services.namespaced import Namespaced
    from jetloop.services.supervisor import Component
    from jetloop.services.worker import Worker

    for ns in served:
        if ns != "all" and not namespaces.exists(s.store_dir, ns):
            raise click.ClickException(f"--namespace {ns}: no such namespace in {s.store_dir}")

    def parts(ns: str) -> list[list[Component]]:
        ns_settings, app = s.for_namespace(ns), app_of(ns)
        worker = Component(f"worker[{ns}]", lambda: Worker(ns_settings, app, pools, worker_id=wid))
        return [[worker]]

    host = Namespaced(s.store_dir, parts, serve=lambda ns: "all" in served or ns in served)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, host.stop_soon)
    await host.run()


@main.command()
@click.option("--nats", "nats_url")
@namespace_option
@click.option("--replicas", type=int, help="set the replica count of every stream (R3: 3)")
@click.option(
    "--app",
    help="also declare this app's agents (module:attr), so messages to them are accepted "
    "and wait before its first worker runs",
)
def topology(nats_url: str | None, replicas: int | None, app: str | None) -> None:
    """Apply the topology (streams, consumers, buckets) to existing servers."""
    from jetloop.agents import load_app
    from jetloop.streams import topology as topo

    s = _settings(nats_url=nats_url, replicas=replicas)
    try:
        agents = sorted(load_app(app).agents) if app else []
    except (ValueError, ImportError) as exc:
        raise click.ClickException(f"--app: {exc}") from None

    async def body(jl: Client) -> None:
        await topo.apply(jl.js, s.topology(), set_replicas=replicas is not None)
        if agents:
            await (await jl.registry()).declare(agents, "jetloop topology")
        click.echo(
            "topology applied" + (f"; agents declared: {', '.join(agents)}" if agents else "")
        )

    _client_cmd(nats_url, body)


@main.command()
@click.option(
    "--store-dir",
    type=click.Path(file_okay=False),
    help="where to keep them (default JETLOOP_STORE_DIR, .jetloop)",
)
def credentials(store_dir: str | None) -> None:
    """Make the store's secrets once (the seal key, a NATS password per role) and write the
    nats-server config that gives each role its permissions: for servers started elsewhere
    (compose.yaml, a cluster). Prints where they are, never the secrets."""
    from jetloop.services.durability import survives
    from jetloop.services.natsauth import write_config
    from jetloop.services.settings import make_seal_key

    s = _settings(store_dir=store_dir)
    try:
        s.store_dir.mkdir(parents=True, exist_ok=True)
        make_seal_key(s.store_dir)
        conf = write_config(s.store_dir, sync=s.nats_sync)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"setting JETLOOP_STORE_DIR / --store-dir: {exc}") from None
    click.echo(f"seal key and NATS users in {s.store_dir} (0600, made once)")
    click.echo(f"start every nats-server with: --config {conf}")
    click.echo(
        f"sync_interval {s.nats_sync}: an acknowledged write survives {survives(s.nats_sync)}"
    )
    click.echo(
        f"processes with JETLOOP_STORE_DIR={s.store_dir} seal with the key and connect as "
        "worker; give programs elsewhere the client or operator password (docs/security.md)"
    )


@main.command()
@click.option(
    "--mode", "modes", multiple=True, default=("worker_kill",), type=click.Choice(TRIAL_MODES)
)
@click.option("--rounds", type=int, help="default JETLOOP_TRIALS (10)")
@click.option("--seed", type=int, help="default JETLOOP_KILL_SEED (random)")
@click.option(
    "--load",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="busy processes (one core each) beside the workers for the whole run",
)
@click.option(
    "--nats-sync",
    default="always",
    show_default=True,
    help="when the trial's servers sync what they acknowledged: always, or an interval such "
    "as 2m (nats-server's own default)",
)
@click.option(
    "--control-rounds",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="power_loss, cluster_power_loss: rounds of a control run with nats-server's lazy "
    "sync after the run, which must show harm (0: none)",
)
@click.option(
    "--no-system-account",
    is_flag=True,
    help="servers without the system account's watch user, workers without its password (as "
    "on your own or a managed NATS): dead workers are found without disconnect advisories",
)
@click.option("--json", "out_json", type=click.Path(dir_okay=False))
@click.option("--keep", type=click.Path(file_okay=False), help="keep logs and stores here")
@click.option(
    "--app",
    help="crash-test your own agent: module:attr (with --messages); modes worker_kill,"
    " server_restart; --rounds adds random kills (default 0)",
)
@click.option(
    "--messages",
    type=click.Path(exists=True, dir_okay=False),
    help="with --app: one user message per line, or a JSON list of {agent, text}",
)
@click.option(
    "--model-script",
    type=click.Path(exists=True, dir_okay=False),
    help="with --app: scripted model replies (JSON), so the test needs no network or key",
)
@click.option("--quick", is_flag=True, help="with --app: the first boundary of each kind only")
@click.option(
    "--vendor-dedupes",
    multiple=True,
    metavar="TOOL",
    help="with --app: an IDEMPOTENT_WRITE tool whose vendor dedupes on the key (its repeats pass)",
)
@click.option(
    "--pure",
    multiple=True,
    metavar="TOOL",
    help="with --app: a READ tool that changes nothing (its repeats are not warned of)",
)
@click.option(
    "--tool-worker",
    metavar="COMMAND",
    help="with --app: the command of a worker in another language that makes the app's tools "
    "of pools of their own (e.g. 'node workers/node/dist/src/cli.js --app tools.js'); killed with "
    "each worker",
)
def trials(
    modes: tuple[str, ...],
    rounds: int | None,
    seed: int | None,
    load: int,
    nats_sync: str,
    control_rounds: int,
    no_system_account: bool,
    out_json: str | None,
    keep: str | None,
    app: str | None,
    messages: str | None,
    model_script: str | None,
    quick: bool,
    vendor_dedupes: tuple[str, ...],
    pure: tuple[str, ...],
    tool_worker: str | None,
) -> None:
    """Kill trials: random SIGKILLs of workers, servers or leaders, and power cuts, judged
    from state: lost turns, duplicates, reverted decisions, detection and completion times,
    false takeovers. With --app, the same for your own agent: killed at every step boundary
    its conversation reaches."""
    from pathlib import Path

    from jetloop.services.durability import check

    try:
        nats_sync = check(nats_sync)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--nats-sync") from None

    if app is not None:
        from jetloop.tooling.crashtest.cli import main as crash

        if no_system_account:
            raise click.UsageError("--no-system-account is for the kill trials, not --app")

        if messages is None:
            raise click.UsageError("--app needs --messages FILE")
        sys.exit(
            crash(
                app,
                Path(messages),
                modes=modes,
                rounds=rounds or 0,
                seed=seed,
                model_script=Path(model_script) if model_script else None,
                quick=quick,
                vendor_dedupes=vendor_dedupes,
                pure=pure,
                out_json=Path(out_json) if out_json else None,
                keep=Path(keep) if keep else None,
                tool_worker=tool_worker,
            )
        )
    if messages or model_script or quick or vendor_dedupes or pure or tool_worker:
        raise click.UsageError(
            "--messages, --model-script, --quick, --vendor-dedupes, --pure need --app"
        )

    from jetloop.tooling.trials.run import main as run

    sys.exit(
        run(
            modes,
            rounds,
            seed,
            out_json,
            Path(keep) if keep else None,
            load=load,
            sync=nats_sync,
            control_rounds=control_rounds,
            system_account=not no_system_account,
        )
    )


@main.command()
@click.argument(
    "which",
    nargs=-1,
    type=click.Choice(
        ["overhead", "throughput", "history", "waiting", "profile", "peer", "limits", "tenants"]
    ),
)
@click.option(
    "--quick", is_flag=True, help="small samples: a smoke run (about 30 s on 2 idle cores)"
)
@click.option("--waiting-sessions", type=int)
@click.option(
    "--workers",
    type=click.IntRange(1, 16),
    help="peer: jetloop's worker processes beside the peers (default 1)",
)
@click.option(
    "--event-log",
    type=click.Choice(["separate", "folded"]),
    help="the layout of jetloop's session log in every benchmark (default folded, as a new "
    "deployment's; docs/protocol.md)",
)
@click.option(
    "--nats-sync",
    help="when the bench's nats-server syncs what it acknowledged: always (default, as "
    "`jetloop up`) or an interval such as 2m (nats-server's own default)",
)
@click.option(
    "--lazy-fsync",
    is_flag=True,
    help="the old comparison: jetloop's nats-server syncs every 2m (--nats-sync 2m) while "
    "Restate still syncs before it acknowledges",
)
@click.option(
    "--count-syncs",
    is_flag=True,
    help="peer: trace each server's syncs to disk with strace and print them per turn, by "
    "stream (the trace slows the servers: read the counts, not the timings)",
)
@click.option(
    "--lever1",
    is_flag=True,
    help="peer: also run the floor of lever 1's write pattern (a step's commit is its "
    "successor's work item; docs/performance.md) and print it against Restate",
)
@click.option(
    "--floor-shards",
    type=click.IntRange(1, 16),
    default=None,
    help="peer: the floor spreads its state and log over this many buckets and streams, by "
    "session (lever 2, docs/performance.md; default 1, as the engine's)",
)
@click.option(
    "--turn-rate",
    type=click.FloatRange(min=0),
    default=20.0,
    show_default=True,
    help="tenants: the turns a second b's workers take in (JETLOOP_TURN_RATE; 0: unlimited)",
)
@click.option("--json", "out_json", type=click.Path(dir_okay=False))
@click.option("--keep", type=click.Path(file_okay=False))
def bench(
    which: tuple[str, ...],
    quick: bool,
    waiting_sessions: int | None,
    workers: int | None,
    event_log: str | None,
    nats_sync: str | None,
    lazy_fsync: bool,
    count_syncs: bool,
    lever1: bool,
    floor_shards: int | None,
    turn_rate: float,
    out_json: str | None,
    keep: str | None,
) -> None:
    """Benchmarks, each as a ratio against a baseline measured in the same run: the raw
    JetStream floor, or (``peer``) Restate and DBOS Transact, each when installed:
    ``pip install -e '.[peer]'`` and ``npm ci --prefix jetloop/tooling/bench/restate``."""
    from pathlib import Path

    if "tenants" in which:
        # Its own `jetloop up` with two namespaces, not the other benchmarks' rig.
        if len(which) > 1:
            raise click.UsageError("tenants runs alone: `jetloop bench tenants`")
        from jetloop.tooling.bench.tenants import main as tenants

        sys.exit(tenants(turn_rate, keep=Path(keep) if keep else None))

    from jetloop.tooling.bench.run import main as run

    if lazy_fsync:
        if nats_sync is not None:
            raise click.UsageError("--lazy-fsync is --nats-sync 2m: give one of them")
        nats_sync = "2m"
    if count_syncs and "peer" not in which:
        raise click.UsageError("--count-syncs counts the peer benchmark's: `jetloop bench peer`")
    if lever1 and "peer" not in which:
        raise click.UsageError("--lever1 runs beside the peer benchmark: `jetloop bench peer`")
    if floor_shards is not None:
        if "peer" not in which:
            raise click.UsageError("--floor-shards shapes the peer benchmark's floor")
        from jetloop.tooling.bench.floor import SHARDS_ENV

        os.environ[SHARDS_ENV] = str(floor_shards)
    sys.exit(
        run(
            which or ("overhead", "throughput", "history"),
            quick,
            out_json,
            Path(keep) if keep else None,
            waiting_sessions,
            workers,
            event_log,
            nats_sync,
            count_syncs,
            lever1,
        )
    )


def _add_service_commands() -> None:
    from jetloop.services.gateway.app import gateway_command
    from jetloop.services.readmodel.projector import projector_command

    main.add_command(gateway_command)
    main.add_command(projector_command)


_add_service_commands()
