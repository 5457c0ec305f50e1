"""Fixtures: a real nats-server per test (or per module) on a free port with its own store."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from jetloop.services.settings import Settings

# Checkpoints are sealed in every test, as `jetloop up` seals them; the test process
# (clients that cancel or reconcile) and the workers it starts share the key.
SEAL_KEY = "0f" * 32


def own_settings() -> Path:
    """Give the tests settings of their own, never the user's: drop every ``JETLOOP_<setting>``
    of the caller's environment and point the store directory at an empty one of this run's
    (returned). Run where ``jetloop up`` ran, the default store (``./.jetloop``) holds that
    server's NATS passwords and seal key, which every setting left unset would read
    (``jetloop.services.settings``). Done before the imports below (the demo agent reads its
    settings when imported); the processes the tests start inherit this environment, and tests
    that run ``up`` as a person does drop ``JETLOOP_STORE_DIR`` again themselves."""
    for name in Settings.model_fields:
        os.environ.pop(f"JETLOOP_{name.upper()}", None)
    store = Path(tempfile.mkdtemp(prefix="jetloop-tests-store-"))
    os.environ["JETLOOP_STORE_DIR"] = str(store)
    os.environ["JETLOOP_SEAL_KEY"] = SEAL_KEY
    return store


STORE = own_settings()

# After own_settings: these read settings when imported.
from jetloop.demo.agent import app as demo_app  # noqa: E402
from jetloop.demo.vendor import Vendor  # noqa: E402
from jetloop.services.client import Client  # noqa: E402
from jetloop.services.embedded import EmbeddedServer  # noqa: E402
from jetloop.services.natsauth import system_account  # noqa: E402
from jetloop.streams import topology  # noqa: E402
from jetloop.streams.connection import connect, retrying  # noqa: E402
from jetloop.streams.registry import Registry  # noqa: E402
from jetloop.tooling.trials.harness import WorkerProcess  # noqa: E402
from tests.apps import app as test_app  # noqa: E402

LEASE = 2.0
# Under `coverage run -m pytest` (docs/testing.md, "Coverage") every subprocess measures
# too; a worker writes its data only when it exits, so teardown stops workers with SIGTERM
# (and waits) instead of SIGKILL. Off by default: SIGKILL is instant.
COVERAGE = bool(
    os.environ.get("COVERAGE_PROCESS_CONFIG") or os.environ.get("COVERAGE_PROCESS_START")
)
TEST_ENV = {"JETLOOP_LEASE_SECONDS": str(LEASE), "JETLOOP_DRAIN_SECONDS": "5"}

_ids = itertools.count(1)


# The servers run with a system account whose `watch` user hears connections close, as
# `jetloop up`'s does: the workers hand a dead worker's steps on at once (jetloop.services.rescue).
WATCH_PASSWORD = "watch-" + "0f" * 8
TEST_ENV["JETLOOP_NATS_WATCH_PASSWORD"] = WATCH_PASSWORD


def server_config(directory: Path) -> Path:
    """A nats-server config file with the system account and its watch user."""
    path = directory / "nats-server.conf"
    path.write_text(json.dumps(system_account(WATCH_PASSWORD)))
    return path


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer(
        tmp_path / "store",
        port=0,
        log_file=tmp_path / "nats.log",
        config_file=server_config(tmp_path),
    )
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture
async def nats_ready(server: EmbeddedServer) -> EmbeddedServer:
    await server.wait_jetstream()
    nc = await connect([server.url], "test-topology")
    try:
        await prepare(nc, Settings(lease_seconds=LEASE).topology())
    finally:
        await nc.close()
    return server


async def prepare(nc: Any, cfg: topology.TopologyConfig) -> None:
    """The topology, and the test apps' agents declared as a deploy does before its workers
    run: a send to them is accepted (and waits for a worker) instead of refused as unknown.
    Both are idempotent, so they are tried again while a new cluster's servers settle on a
    meta leader (a create can meet "no responders" just after every node answered)."""

    async def once() -> None:
        await topology.apply(nc.jetstream(), cfg)
        registry = await Registry.open(nc.jetstream())
        # (`tester_http`: tests/apps_mcp.py's agent that reaches an MCP server over HTTP,
        # served only when a test runs that server.)
        await registry.declare([*test_app.agents, *demo_app.agents, "tester_http"], "tests")

    await retrying(once, 30.0, "test topology")


@pytest.fixture
async def client(nats_ready: EmbeddedServer) -> AsyncIterator[Client]:
    c = await Client.connect(nats_ready.url)
    yield c
    await c.close()


@pytest.fixture
def vendor_db(tmp_path: Path) -> Path:
    return tmp_path / "vendor.sqlite"


@pytest.fixture
def vendor(vendor_db: Path) -> Vendor:
    return Vendor(vendor_db)


@pytest.fixture
def workers(tmp_path: Path, nats_ready: EmbeddedServer, vendor_db: Path) -> Iterator[WorkerFactory]:
    factory = WorkerFactory(tmp_path, nats_ready.url, vendor_db)
    yield factory
    factory.close()


class WorkerFactory:
    def __init__(
        self, tmp: Path, url: str, vendor_db: Path, env: dict[str, str] | None = None
    ) -> None:
        self.tmp = tmp
        self.url = url
        self.vendor_db = vendor_db
        self.env = env or {}
        self.procs: list[WorkerProcess] = []

    def start(
        self, name: str | None = None, app: str = "tests.apps:app", **kw: Any
    ) -> WorkerProcess:
        wid = name or f"w{next(_ids)}"
        env = {
            **TEST_ENV,
            "JETLOOP_VENDOR_DB": str(self.vendor_db),
            **self.env,
            **kw.pop("env", {}),
        }
        w = WorkerProcess(self.url, app, self.tmp / f"{wid}.log", worker_id=wid, env=env, **kw)
        self.procs.append(w.start())
        return w

    def close(self) -> None:
        if COVERAGE:
            stop_for_coverage(self.procs)
        for w in self.procs:
            w.kill()


def stop_for_coverage(procs: list[WorkerProcess], timeout: float = 15.0) -> None:
    """SIGTERM every worker at once (SIGCONT first: one may be paused), then wait for them to
    drain and exit, so each writes its coverage data; what is left is killed by the caller."""
    import signal
    import time

    for w in procs:
        w.resume()
        w.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for w in procs:
        if w.proc is not None and w.alive():
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def script(*steps: list[dict[str, Any]], answer: str = "done") -> str:
    """The user text that makes the test model run these steps."""
    return json.dumps({"steps": list(steps), "answer": answer})


def call(tool: str, **args: Any) -> dict[str, Any]:
    return {"tool": tool, "args": args}


def body(text: str | None) -> dict[str, Any]:
    """The JSON the test model appends to its final answer."""
    assert text is not None
    parsed: dict[str, Any] = json.loads(text.split("\n", 1)[1])
    return parsed


async def until(check: Any, timeout: float = 30.0, every: float = 0.05) -> Any:
    """Wait for an async condition (returning a truthy value) with a timeout, not a sleep."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        await asyncio.sleep(every)


async def held_for_approval(
    client: Any, session_id: str, turn_id: str, model_step: int, index: int
) -> Any:
    """The call's record once it says ``awaiting_approval``: a worker writes the approval
    record first and the call's state after it, so a reader that saw the approval may read
    the call a moment before it says so."""

    async def held() -> Any:
        rec = await client.call(session_id, turn_id, model_step, index)
        return rec if rec is not None and rec.state == "awaiting_approval" else None

    return await until(held, timeout=10)


# The end-to-end suites that take most of a run's time (the crash matrix and its soak, the
# mutations, the kill and power-cut trials, crash tests of whole agents, upgrades and deploys,
# the framework adapters' takeovers, the attacks and noisy neighbours, the soak of `up`): marked
# `long`, so `pytest -m "not long"` is a quick run (the README and docs/testing.md say how
# long each takes).
LONG = {
    "test_matrix",
    "test_node_worker",
    "test_matrix_soak",
    "test_mutations",
    "test_trials",
    "test_crashtest",
    "test_upgrade",
    "test_deploy",
    "test_framework_claude",
    "test_framework_openai_agents",
    "test_framework_pydantic_ai",
    "test_bus_attack",
    "test_tenant_neighbours",
    "test_power_loss",
    "test_cluster_harness",
    "test_up_soak",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of ``LONG``'s modules ``long`` (before ``-m`` deselects)."""
    for item in items:
        if item.path.stem in LONG:
            item.add_marker(pytest.mark.long)


def pytest_configure(config: pytest.Config) -> None:
    """Where this run's soak of ``up`` would run, named once by the process that runs the
    tests (or, with pytest-xdist, hands them out) for every process of the run; made only if
    the soak starts."""
    if not hasattr(config, "workerinput"):  # not a process pytest-xdist started
        from tests import test_up_soak

        test_up_soak.name_the_soak_dir()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The soak of ``up`` (tests/test_up_soak.py) starts now, when it is to run, and runs
    beside the other tests until its own test asks it to end. Under pytest-xdist every test
    process collects every test, and not one of them knows which runs the soak's: the
    process that hands out the tests starts it instead (below)."""
    from tests import test_up_soak

    if hasattr(session.config, "workerinput"):
        return
    if any(item.nodeid == test_up_soak.NODE_ID for item in session.items):
        test_up_soak.running.append(test_up_soak.Soak(test_up_soak.soak_dir()))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """pytest-xdist: a test process has collected; the soak starts if it is among the tests,
    once for the run (every process collects the same tests)."""
    from tests import test_up_soak

    if test_up_soak.NODE_ID in ids and not test_up_soak.running:
        test_up_soak.running.append(test_up_soak.Soak(test_up_soak.soak_dir()))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A soak its test never asked to end (the run stopped early) is stopped; the run's store
    directory is removed."""
    from tests import test_up_soak

    while test_up_soak.running:
        test_up_soak.running.pop().close()
    shutil.rmtree(STORE, ignore_errors=True)
