"""The Node.js tool worker (workers/node) serves the tools of a pool of their own: a Python
front worker runs the `sider` agent's turns, model steps and its Python read; the Node worker
(workers/node/example/tools.js) makes `node_lookup`, `node_keyed` and `node_append` in pool
`node`, with real writes to files. Real nats-server, real processes, real kills.

Skipped, saying why, when ``node`` or ``npm`` is missing; the worker is built once per
session (``npm ci`` and ``npm run build`` in workers/node)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from nats.js.errors import KeyNotFoundError

from jetloop.schemas import CallState
from jetloop.schemas.ids import approval_id_for, idempotency_key
from jetloop.services.client import Client, TurnFailed
from jetloop.streams.topology import WORKERS_BUCKET
from jetloop.tooling.trials.harness import CommandWorker, WorkerProcess
from tests.conftest import (
    LEASE,
    SEAL_KEY,
    TEST_ENV,
    WorkerFactory,
    body,
    call,
    held_for_approval,
    script,
    until,
)
from tests.test_matrix import rig as matrix_columns  # noqa: F401 (the matrix's columns)

HERE = Path(__file__).resolve().parent.parent / "workers" / "node"
NODE = shutil.which("node")
NPM = shutil.which("npm")
FRONT = "tests.apps:node_front_app"


def _skip_reason() -> str | None:
    if NODE is None:
        return "node is not installed: the Node.js worker cannot run"
    if NPM is None:
        return "npm is not installed: the Node.js worker cannot be built (npm ci, npm run build)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@pytest.fixture(scope="session")
def node_built() -> Path:
    """workers/node installed from its lock file and compiled (``.ci/run`` does both first);
    built here when its output is missing or older than its sources, under a lock, so the
    suite's parallel processes build it once."""
    assert NPM is not None
    cli = HERE / "dist" / "src" / "cli.js"
    with open(HERE / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sources = [*HERE.glob("src/*.ts"), *HERE.glob("examples/*.ts"), HERE / "package-lock.json"]
        stale = not cli.exists() or any(p.stat().st_mtime > cli.stat().st_mtime for p in sources)
        if stale or not (HERE / "node_modules" / "@nats-io" / "jetstream").is_dir():
            for cmd in ([NPM, "ci", "--no-audit", "--no-fund"], [NPM, "run", "build"]):
                done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=300)
                assert done.returncode == 0, (
                    f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
                )
    return cli


def node_worker(
    name: str, logs: Path, url: str, env: dict[str, str], app: Path = HERE / "example" / "tools.js"
) -> WorkerProcess:
    """A Node worker process serving the tools of ``app`` (the tests' own by default) on the
    servers ``url``, logging JSON lines as the Python workers do (``event``, ``worker``): the
    harness's waits and finds read it the same way."""
    assert NODE is not None
    cli = HERE / "dist" / "src" / "cli.js"
    return CommandWorker(
        [NODE, str(cli), "--app", str(app)],
        logs / f"{name}.log",
        worker_id=name,
        env={**TEST_ENV, "JETLOOP_NATS_URL": url, "JETLOOP_SEAL_KEY": SEAL_KEY, **env},
    ).start()


@pytest.fixture
def node_workers(node_built: Path, workers: WorkerFactory, tmp_path: Path) -> Iterator[Any]:
    procs: list[WorkerProcess] = []
    vendor = tmp_path / "node-vendor"

    def start(name: str, env: dict[str, str] | None = None) -> WorkerProcess:
        w = node_worker(name, tmp_path, workers.url, {"NODE_TOOLS_DIR": str(vendor), **(env or {})})
        procs.append(w)
        return w

    start.vendor = vendor  # type: ignore[attr-defined]
    yield start
    for w in procs:
        w.kill()


def _lines(vendor: Path, name: str) -> list[list[str]]:
    path = vendor / name
    if not path.exists():
        return []
    return [ln.split() for ln in path.read_text().splitlines() if ln.strip()]


@pytest.mark.parametrize("event_log", ["folded", "separate"])
async def test_a_turn_completes_with_the_node_workers_results(
    client: Client, workers: WorkerFactory, node_workers: Any, event_log: str
) -> None:
    """A read and a keyed write made by the Node worker, a single-attempt write after them,
    and a Python read beside them: the turn completes with every result, in either layout of
    the session log; the join is done by the session pool from the Node worker's ``join``
    steps."""
    front = workers.start("front", app=FRONT, env={"JETLOOP_EVENT_LOG": event_log})
    await front.wait_for("worker.started", timeout=30)
    node = node_workers("node-1")
    started = await node.wait_for("worker.started", timeout=30)
    assert started["layout"] == event_log
    h = await client.send(
        "sider",
        "nw1",
        script(
            [call("node_lookup", name="abc"), call("node_keyed", name="k"), call("read", name="p")],
            [call("node_append", name="once")],
        ),
    )
    res = await client.wait(h, timeout=30)
    seen = body(res.text)["seen"]
    assert [s["status"] for s in seen] == ["ok", "ok", "ok", "ok"], seen
    vendor = node_workers.vendor
    keyed = _lines(vendor, "keyed.log")
    appended = _lines(vendor, "append.log")
    assert len(keyed) == 1 and keyed[0][1] == "k"
    assert len(appended) == 1 and appended[0][1] == "once"
    turn = await client.turn("nw1", h.turn_id)
    assert turn is not None and turn.status == "completed" and turn.tool_calls_made == 4
    # The tools were given the plan's idempotency keys.
    assert keyed[0][0] == idempotency_key("nw1", h.turn_id, 0, 1)
    assert appended[0][0] == idempotency_key("nw1", h.turn_id, 1, 0)
    for i, op in ((0, "node_lookup"), (1, "node_keyed")):
        rec = await client.call("nw1", h.turn_id, 0, i)
        assert rec is not None and rec.state == CallState.SUCCEEDED, rec
        assert rec.attempt is None and rec.attempts >= 1
        assert node.find("tool.call", tool=op)
    assert node.find("step.acked", kind="call_single_attempt_tool")
    assert len(node.find("step.acked", kind="call_tool")) == 2
    assert len(front.find("step.acked", kind="join")) >= 3  # one per Node call
    kv = await client.js.key_value(WORKERS_BUCKET)
    presence = json.loads((await kv.get("worker.node-1")).value or b"{}")
    assert presence["pools"] == ["node"] and presence["agents"] == ["sider"]
    assert presence["kinds"] == ["call_tool", "call_single_attempt_tool", "await_tool_approval"]


async def test_a_node_worker_killed_inside_a_single_attempt_write_leaves_it_in_doubt(
    client: Client, workers: WorkerFactory, node_workers: Any, tmp_path: Path
) -> None:
    """Kill -9 of the Node worker while the single-attempt write is at the vendor: the next
    Node worker takes the call over and settles it ``outcome_unknown``; never made again."""
    latch = tmp_path / "latch"
    front = workers.start("front", app=FRONT)
    victim = node_workers("node-1", env={"TEST_LATCH": str(latch)})
    await front.wait_for("worker.started", timeout=30)
    h = await client.send("sider", "nw2", script([call("node_append", name="x")]))
    vendor = node_workers.vendor
    await until(lambda: _async(len(_lines(vendor, "opened.log")) == 1), timeout=20)
    victim.signal(signal.SIGKILL)
    latch.touch()
    second = node_workers("node-2")
    res = await client.wait(h, timeout=30)
    assert [s["status"] for s in body(res.text)["seen"]] == ["outcome_unknown"]
    rec = await client.call("nw2", h.turn_id, 0, 0)
    assert rec is not None and rec.state == CallState.OUTCOME_UNKNOWN
    assert rec.settlement == "outcome_unknown" and rec.marked == 1
    assert _lines(vendor, "append.log") == []  # never made
    assert not second.find("tool.call")
    turn = await client.turn("nw2", h.turn_id)
    assert turn is not None and len(turn.lost) == 1 and turn.lost[0].startswith("node-1/")


async def test_a_node_worker_killed_inside_an_idempotent_write_makes_it_again_with_its_key(
    client: Client, workers: WorkerFactory, node_workers: Any, tmp_path: Path
) -> None:
    """Kill -9 of the Node worker after the keyed write applied, before its outcome was
    committed: the next Node worker makes it again with the same idempotency key; the
    vendor (which dedupes on the key) shows one applied effect for it."""
    latch = tmp_path / "latch"
    front = workers.start("front", app=FRONT)
    victim = node_workers("node-1", env={"TEST_LATCH": str(latch)})
    await front.wait_for("worker.started", timeout=30)
    h = await client.send("sider", "nw3", script([call("node_keyed", name="y")]))
    vendor = node_workers.vendor
    await until(lambda: _async(len(_lines(vendor, "opened.log")) == 1), timeout=20)
    victim.signal(signal.SIGKILL)
    latch.touch()
    node_workers("node-2")
    res = await client.wait(h, timeout=30)
    assert [s["status"] for s in body(res.text)["seen"]] == ["ok"]
    requests = [r for r in _lines(vendor, "requests.log") if r[0] == "node_keyed"]
    assert len(requests) == 2, requests
    assert requests[0][1] == requests[1][1]  # the same idempotency key
    assert [r[2] for r in requests] == ["1", "2"]  # attempts 1 and 2
    keyed = _lines(vendor, "keyed.log")
    assert len(keyed) == 1 and keyed[0][0] == requests[0][1]
    rec = await client.call("nw3", h.turn_id, 0, 0)
    assert rec is not None and rec.state == CallState.SUCCEEDED and rec.attempts == 2


# The crash matrix's cells of a single-attempt write, on the Node worker: killed at each
# named point of its call (JETLOOP_FAULT_HOLD, as a Python worker is), the next Node worker
# settles what the kill left. (point, status the model sees, writes made, losses counted)
CELLS = [
    ("call_tool.before_mark", "ok", 1, 0),  # nothing written yet: made by the next worker
    ("call_tool.in_tool", "outcome_unknown", 0, 1),  # marked, not made: in doubt all the same
    ("call_tool.before_commit", "outcome_unknown", 1, 1),  # made, not recorded: never again
    ("call_tool.after_commit", "ok", 1, 0),  # recorded: told and joined by the next worker
]


@pytest.mark.parametrize(("point", "status", "made", "losses"), CELLS)
async def test_a_node_worker_killed_at_each_point_of_a_single_attempt_write(
    client: Client,
    workers: WorkerFactory,
    node_workers: Any,
    point: str,
    status: str,
    made: int,
    losses: int,
) -> None:
    front = workers.start("front", app=FRONT)
    victim = node_workers("node-1", env={"JETLOOP_FAULT_HOLD": point})
    await front.wait_for("worker.started", timeout=30)
    h = await client.send("sider", "nw6", script([call("node_append", name="x")]))
    held = await victim.wait_for("fault.hold", timeout=20)
    assert held["point"] == point and held["session"] == "nw6"
    victim.signal(signal.SIGKILL)
    second = node_workers("node-2")
    res = await client.wait(h, timeout=30)
    assert [s["status"] for s in body(res.text)["seen"]] == [status]
    vendor = node_workers.vendor
    assert len(_lines(vendor, "append.log")) == made
    rec = await client.call("nw6", h.turn_id, 0, 0)
    assert rec is not None and rec.marked == 1  # one in-doubt mark, whoever made it
    assert len(second.find("tool.call")) == (1 if point == "call_tool.before_mark" else 0)
    turn = await client.turn("nw6", h.turn_id)
    assert turn is not None and len(turn.lost) == losses


# A single-attempt write with a read-back, killed with its mark made: before its effect, the
# reader finds nothing and it is made again; after it, the reader finds it and its result is
# recorded. (point, settlement of the call, what the model sees, lines of the read-back.)
READ_BACK = [
    ("call_tool.in_tool", None, {"name": "r", "made": True}),
    ("call_tool.before_commit", "read_back", {"name": "r", "made": True, "read_back": True}),
]


@pytest.mark.parametrize(("point", "settlement", "result"), READ_BACK)
async def test_a_lost_single_attempt_write_is_read_back_by_the_node_worker(
    client: Client,
    workers: WorkerFactory,
    node_workers: Any,
    point: str,
    settlement: str | None,
    result: dict[str, Any],
) -> None:
    front = workers.start("front", app=FRONT)
    victim = node_workers("node-1", env={"JETLOOP_FAULT_HOLD": point})
    await front.wait_for("worker.started", timeout=30)
    h = await client.send("sider", "nw11", script([call("node_checked", name="r")]))
    await victim.wait_for("fault.hold", timeout=20)
    victim.signal(signal.SIGKILL)
    node_workers("node-2")
    res = await client.wait(h, timeout=30)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "ok" and seen["result"] == result, seen
    vendor = node_workers.vendor
    assert len(_lines(vendor, "checked.log")) == 1  # applied once, whoever made it
    asked = [r for r in _lines(vendor, "requests.log") if r[0] == "node_checked.read_back"]
    assert len(asked) == 1 and asked[0][2] == "1"  # asked once, about the lost attempt 1
    rec = await client.call("nw11", h.turn_id, 0, 0)
    assert rec is not None and rec.state == CallState.SUCCEEDED and rec.marked >= 1
    assert rec.settlement == settlement
    turn = await client.turn("nw11", h.turn_id)
    assert turn is not None and len(turn.lost) == 1


@pytest.mark.parametrize("approve", [True, False])
async def test_a_call_the_node_worker_holds_for_approval_waits_for_the_decision(
    client: Client, workers: WorkerFactory, node_workers: Any, approve: bool
) -> None:
    """The Node worker's policy holds the call (the front worker declared none): one approval
    asked, the decision wakes the call in pool `node`; approved, it is made once; rejected,
    never, and the model sees who denied it."""
    front = workers.start("front", app=FRONT)
    node = node_workers("node-1")
    await front.wait_for("worker.started", timeout=30)
    h = await client.send("sider", "nw7", script([call("node_guarded", name="g")]))

    async def asked() -> Any:
        snap = await client.snapshot("nw7")
        return snap if snap is not None and snap.approvals else None

    snap = await until(asked, timeout=30)
    [approval] = snap.approvals
    rec = await held_for_approval(client, "nw7", h.turn_id, 0, 0)
    assert rec.approval_id == approval.approval_id
    # The id every worker derives from the call (ids.py), so a call routed again coalesces.
    assert approval.approval_id == approval_id_for(f"nw7.{h.turn_id}.0.0")
    assert _lines(node_workers.vendor, "guarded.log") == []
    if approve:
        await client.approve("nw7", approval.approval_id, by="alice")
    else:
        await client.reject("nw7", approval.approval_id, by="bob", reason="not today")
    res = await client.wait(h, timeout=30)
    [seen] = body(res.text)["seen"]
    made = _lines(node_workers.vendor, "guarded.log")
    if approve:
        assert seen["status"] == "ok" and len(made) == 1
    else:
        assert seen["status"] == "denied" and made == []
        rec = await client.call("nw7", h.turn_id, 0, 0)
        assert rec is not None and rec.outcome is not None
        assert rec.outcome.error == "denied by bob: not today"
    assert len(node.find("call.awaiting_approval")) == 1
    assert node.find("step.acked", kind="await_tool_approval")


async def test_a_node_tool_sees_its_turn_cancelled_and_stops_early(
    client: Client, workers: WorkerFactory, node_workers: Any
) -> None:
    """The Node worker's beats read the turn (every lease/3): cancelled, the running tool
    finds ``ctx.cancelled`` true and ``ctx.signal`` aborted, stops without its effect, and
    the next message of the session runs."""
    front = workers.start("front", app=FRONT)
    node = node_workers("node-1")
    await front.wait_for("worker.started", timeout=30)
    await node.wait_for("worker.started", timeout=30)
    h = await client.send("sider", "nw12", script([call("node_patient", name="p", seconds=60)]))
    h2 = await client.send("sider", "nw12", script([call("node_lookup", name="after")]))
    vendor = node_workers.vendor

    async def running() -> bool:
        return any(ln[0] == "node_patient" for ln in _lines(vendor, "requests.log"))

    await until(running, timeout=30)
    turn = await client.cancel("nw12", by="grace")
    assert turn.status == "cancelled"
    with pytest.raises(TurnFailed, match="cancelled"):
        await client.wait(h, timeout=30)
    res = await client.wait(h2, timeout=30)
    assert [s["status"] for s in body(res.text)["seen"]] == ["ok"]

    async def stopped() -> list[list[str]]:
        return _lines(vendor, "stopped.log")

    [line] = await until(stopped, timeout=LEASE * 3)
    assert line[1:3] == ["p", "true"]  # its name, and the signal was aborted too
    assert _lines(vendor, "patient.log") == []


async def test_an_outcome_too_large_for_a_message_is_dead_lettered_at_once(
    client: Client, workers: WorkerFactory, node_workers: Any
) -> None:
    """With results kept inline up to 2 MB (``JETLOOP_BLOB_THRESHOLD``), a 1.2 MB result
    makes a record past the server's ``max_payload``: nats.js refuses the write, and the
    step is dead-lettered on its first delivery with that reason (the tool made once, not
    five times), its turn failed."""
    front = workers.start("front", app=FRONT)
    node = node_workers("node-1", env={"JETLOOP_BLOB_THRESHOLD": str(2_000_000)})
    await front.wait_for("worker.started", timeout=30)
    await node.wait_for("worker.started", timeout=30)
    sub = await client.js.subscribe("jl.dead.jl.step.node.sider.>", ordered_consumer=True)
    h = await client.send("sider", "nw10", script([call("node_big", size=1_200_000)]))
    with pytest.raises(TurnFailed, match="max_payload"):
        await client.wait(h, timeout=30)
    dead = await sub.next_msg(timeout=10)
    assert dead.headers is not None and "max_payload" in dead.headers["Jl-Dead-Reason"]
    made = [ln for ln in _lines(node_workers.vendor, "requests.log") if ln[0] == "node_big"]
    assert len(made) == 1, made
    assert [f["delivery"] for f in node.find("step.failed")] == [1]


async def test_a_killed_node_workers_call_is_taken_over_well_inside_its_lease(
    client: Client, workers: WorkerFactory, node_workers: Any
) -> None:
    """With a 20 s lease: the Node worker lists what it holds; killed after the in-doubt mark,
    a Python worker hears its connection close and copies the listed message, and the next
    Node worker takes the call over at once (settled ``outcome_unknown``), not after 20 s."""
    lease = {"JETLOOP_LEASE_SECONDS": "20"}
    front = workers.start("front", app=FRONT)
    victim = node_workers("node-1", env={**lease, "JETLOOP_FAULT_HOLD": "call_tool.in_tool"})
    await front.wait_for("worker.started", timeout=30)
    await victim.wait_for("worker.started", timeout=30)
    h = await client.send("sider", "nw8", script([call("node_append", name="x")]))
    await victim.wait_for("fault.hold", timeout=20)
    # Started once the victim holds the call (running before, it could take the call itself).
    second = node_workers("node-2", env=lease)
    await second.wait_for("worker.started", timeout=30)
    await asyncio.sleep(0.2)  # the list that names the held message has gone out
    victim.signal(signal.SIGKILL)
    killed = time.monotonic()
    res = await client.wait(h, timeout=30)
    took = time.monotonic() - killed
    assert [s["status"] for s in body(res.text)["seen"]] == ["outcome_unknown"]
    assert took < 10, f"taken over {took:.1f} s after the kill: the lease, not the rescue"
    assert second.find("step.holder_gone")
    assert _lines(node_workers.vendor, "append.log") == []


async def test_an_own_claim_whose_tool_never_began_is_continued_not_left_in_doubt(
    client: Client, workers: WorkerFactory, node_workers: Any
) -> None:
    """The delivery of a single-attempt write ends after its in-doubt mark, before the tool
    (an outage there, ``JETLOOP_FAULT_FAIL``); the next delivery in the same process finds
    its own claim and continues that attempt: made once, ``ok``, no loss, no attempt spent
    (not a false ``outcome_unknown``)."""
    front = workers.start("front", app=FRONT)
    node = node_workers("node-1", env={"JETLOOP_FAULT_FAIL": "call_tool.in_tool"})
    await front.wait_for("worker.started", timeout=30)
    h = await client.send("sider", "nw9", script([call("node_append", name="x")]))
    res = await client.wait(h, timeout=30)
    assert [s["status"] for s in body(res.text)["seen"]] == ["ok"]
    assert node.find("fault.fail", point="call_tool.in_tool")
    assert node.find("call.attempt_continued")
    assert len(_lines(node_workers.vendor, "append.log")) == 1
    rec = await client.call("nw9", h.turn_id, 0, 0)
    assert rec is not None and rec.attempts == 1 and rec.marked == 1
    turn = await client.turn("nw9", h.turn_id)
    assert turn is not None and turn.lost == []


async def test_a_call_running_past_the_lease_is_not_taken_over(
    client: Client, workers: WorkerFactory, node_workers: Any, tmp_path: Path
) -> None:
    """The Node worker's heartbeats (a rewrite of its claim and an in-progress ack every
    third of the lease) keep a call that runs for 2.5 leases its own, with a second Node
    worker pulling beside it: made once, by the first."""
    latch = tmp_path / "latch"
    front = workers.start("front", app=FRONT)
    first = node_workers("node-1", env={"TEST_LATCH": str(latch)})
    await front.wait_for("worker.started", timeout=30)
    await first.wait_for("worker.started", timeout=30)
    second = node_workers("node-2", env={"TEST_LATCH": str(latch)})
    await second.wait_for("worker.started", timeout=30)
    h = await client.send("sider", "nw4", script([call("node_append", name="slow")]))
    vendor = node_workers.vendor
    await until(lambda: _async(len(_lines(vendor, "opened.log")) == 1), timeout=20)
    await asyncio.sleep(2.5 * LEASE)
    latch.touch()
    res = await client.wait(h, timeout=30)
    assert [s["status"] for s in body(res.text)["seen"]] == ["ok"]
    assert len(_lines(vendor, "append.log")) == 1
    assert len(_lines(vendor, "opened.log")) == 1
    rec = await client.call("nw4", h.turn_id, 0, 0)
    assert rec is not None and rec.attempts == 1
    turn = await client.turn("nw4", h.turn_id)
    assert turn is not None and turn.lost == []


async def test_malformed_steps_are_dead_lettered_and_a_stop_deletes_the_presence(
    client: Client, node_workers: Any
) -> None:
    """A body that is not msgpack and one whose subject does not match it go to JL_DEAD with
    their reason and original headers; SIGTERM stops the worker cleanly, its presence gone."""
    node = node_workers("node-1")
    await node.wait_for("worker.started", timeout=30)
    subject = "jl.step.node.sider.call_tool.nw5"
    await client.js.publish(subject, b"plain text", headers={"Nats-Msg-Id": "nw5.bad.1"})
    wrong = msgpack.packb(
        {
            "v": 1,
            "kind": "call_tool",
            "agent": "sider",
            "session_id": "other",
            "turn_id": "t",
            "model_step": 0,
            "call_index": 0,
            "pool": "node",
        }
    )
    await client.js.publish(subject, wrong, headers={"Nats-Msg-Id": "nw5.bad.2"})
    sub = await client.js.subscribe("jl.dead.jl.step.node.sider.>", ordered_consumer=True)
    dead = [await sub.next_msg(timeout=10), await sub.next_msg(timeout=10)]
    reasons = {m.headers["Jl-Dead-Msg-Id"]: m.headers["Jl-Dead-Reason"] for m in dead if m.headers}
    assert reasons["nw5.bad.1"].startswith("body is not msgpack"), reasons
    assert "does not match its body" in reasons["nw5.bad.2"], reasons
    assert all(m.headers and m.headers["Jl-Dead-Stream"] == "JL_STEPS" for m in dead)
    kv = await client.js.key_value(WORKERS_BUCKET)
    assert (await kv.get("worker.node-1")).value
    assert await asyncio.to_thread(node.terminate, 15) == 0
    assert node.find("worker.stopped")
    with pytest.raises(KeyNotFoundError):
        await kv.get("worker.node-1")


async def _async(value: bool) -> bool:
    return value


TRIAL = json.dumps(
    {
        "steps": [
            [call("node_lookup", name="a"), call("node_keyed", name="k")],
            [call("node_append", name="x")],
        ],
        "answer": "done",
    }
)


@pytest.mark.parametrize(
    ("app", "verdict"),
    [("tests.apps:node_front_app", "pass"), ("tests.apps:node_mislabelled_app", "fail")],
)
async def test_the_crash_test_kills_the_node_worker_at_its_boundaries(
    node_built: Path,
    tmp_path: Path,
    vendor_db: Path,
    monkeypatch: pytest.MonkeyPatch,
    app: str,
    verdict: str,
) -> None:
    """``jetloop trials --app … --tool-worker 'node …'``: the Node worker is killed at every
    boundary of its calls (its fault points and the ledger's ``tool.running``) beside the
    Python worker; with the tools labelled as they behave the verdict is pass, and with the
    single-attempt write declared an idempotent write it fails (made twice, same key)."""
    from jetloop.tooling.crashtest.run import crash_test
    from jetloop.tooling.crashtest.script import Message

    assert NODE is not None
    monkeypatch.setenv("JETLOOP_VENDOR_DB", str(vendor_db))
    monkeypatch.setenv("NODE_TOOLS_DIR", str(tmp_path / "tools"))
    report = await crash_test(
        app,
        [Message(agent="sider", text=TRIAL)],
        quick=True,
        vendor_dedupes=["node_keyed"],
        pure=["node_lookup"],
        work_dir=tmp_path / "run",
        tool_worker=[NODE, str(node_built), "--app", str(HERE / "example" / "tools.js")],
    )
    assert report.verdict == verdict, report.failures
    caught = [r for r in report.rounds if r.boundary and "node_append" in r.boundary]
    assert caught, [r.boundary for r in report.rounds]  # the Node worker's calls were struck
    if verdict == "fail":
        assert any("node_append (idempotent_write)" in f for f in report.failures)


async def test_the_readmes_typescript_example_saves_a_note(
    client: Client, workers: WorkerFactory, node_built: Path, tmp_path: Path
) -> None:
    """README, "Tools in TypeScript": the `notes` agent (examples/ts_notes.py) with its tool
    made by the Node worker (workers/node/examples/notes.ts): a note is saved once, in a file
    named by the call's idempotency key."""
    notes = tmp_path / "notes"
    front = workers.start("front", app="examples.ts_notes:app")
    node = node_worker(
        "notes-1",
        tmp_path,
        workers.url,
        {"NOTES_DIR": str(notes)},
        app=HERE / "dist" / "examples" / "notes.js",
    )
    try:
        await front.wait_for("worker.started", timeout=30)
        await node.wait_for("worker.started", timeout=30)
        h = await client.send("notes", "n1", "note buy milk")
        res = await client.wait(h, timeout=30)
        key = idempotency_key("n1", h.turn_id, 0, 0)
        assert res.text == f"saved: {{'saved': '{notes / (key + '.json')}'}}"
        assert json.loads((notes / f"{key}.json").read_text())["text"] == "buy milk"
        assert [p.name for p in notes.iterdir()] == [f"{key}.json"]
    finally:
        node.kill()


async def test_a_node_workers_write_across_each_failure_of_the_matrix(
    matrix_columns: Any,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    node_built: Path,
) -> None:
    """The crash matrix's columns on a Node worker's single-attempt write, held after the
    tool ran and before its outcome is committed: its worker killed (the next Node worker
    settles it ``outcome_unknown``), the server killed and restarted, or the node leading the
    state and step streams killed (the cluster elects; the held worker goes on and commits
    ``ok``). Made once in every column."""
    assert NODE is not None
    rig = matrix_columns  # tests/test_matrix.py's rig: one column a parameter
    tools = tmp_path / "tools"
    rig.app = FRONT

    def node(name: str, **env: str) -> WorkerProcess:
        more = {**rig.workers.env, "NODE_TOOLS_DIR": str(tools), **env}
        w = node_worker(name, tmp_path, rig.workers.url, more)
        rig.workers.procs.append(w)
        return w

    front = rig.worker()
    victim = node(
        "node-1",
        JETLOOP_FAULT_HOLD="call_tool.before_commit",
        JETLOOP_FAULT_RELEASE=str(rig.release),
    )
    await front.wait_for("worker.started", timeout=60)
    await victim.wait_for("worker.started", timeout=60)
    h = await rig.client.send("sider", "m", script([call("node_append", name="x")]))
    await victim.wait_for("fault.hold", timeout=30)
    if rig.worker_killed:
        victim.kill()
        node("node-2")
        want = "outcome_unknown"
    else:
        await rig.fail(victim)  # servers down and up, then the held worker is released
        want = "ok"
    res = await rig.client.wait(h, timeout=90)
    assert [s["status"] for s in body(res.text)["seen"]] == [want]
    assert len(_lines(tools, "append.log")) == 1  # made once, never again
