"""Tools served by a pool of their own: an agent's front workers declare a tool
(``served_elsewhere``) and never make it; its calls go, one message each, to
``jl.step.<pool>.<agent>.…``, where the workers of that pool make them under the same rules
(the in-doubt mark before a single-attempt write, takeover after a kill, approvals decided
where the call is made). Real nats-server, real worker processes, real kills."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import pytest
from nats.aio.msg import Msg

from jetloop.agents import Effect, served_elsewhere, tool
from jetloop.agents.tools import ToolKind
from jetloop.demo.vendor import Vendor
from jetloop.schemas import CallState, StepKind, StepMessage
from jetloop.services.client import Client
from jetloop.services.worker import served_pools
from jetloop.streams.bus import subject_of
from jetloop.streams.topology import WORKERS_BUCKET
from tests.apps import Named, side_front_app, side_tools_app
from tests.conftest import WorkerFactory, body, call, script, until

FRONT = "tests.apps:side_front_app"
SIDE = "tests.apps:side_tools_app"


async def _subjects(client: Client) -> list[str]:
    """The subjects of the sider agent's step messages published from now on."""
    seen: list[str] = []

    async def on(msg: Msg) -> None:
        if not (msg.reply or "").startswith("$JS.ACK"):  # the publish, not a delivery
            seen.append(msg.subject)

    await client.nc.subscribe("jl.step.*.sider.>", cb=on)
    await client.nc.flush()
    return seen


async def _pids(vendor: Vendor, op: str) -> list[int]:
    counts = await vendor.payload_counts(op)
    return [json.loads(p)["pid"] for p, n in counts.items() for _ in range(n)]


async def test_a_tool_of_its_own_pool_waits_for_that_pool_and_is_made_there(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """The front worker runs the model steps and the read; the single-attempt write waits
    on ``jl.step.side.…`` until a worker of pool ``side`` runs, which makes it once."""
    front = workers.start("front", app=FRONT)
    await front.wait_for("worker.started", timeout=30)
    seen = await _subjects(client)
    h = await client.send(
        "sider", "tp1", script([call("side_once", name="a"), call("read", name="b")])
    )
    await until(lambda: _settled(client, h.turn_id, 1))
    await asyncio.sleep(1.0)  # the front worker has had time to make it, if it would
    assert await vendor.effect_count("side_once") == 0
    turn = await client.turn("tp1", h.turn_id)
    assert turn is not None and not turn.status.terminal
    side = workers.start("side", app=SIDE, pools="side")
    res = await client.wait(h, timeout=60)
    assert [s["status"] for s in body(res.text)["seen"]] == ["ok", "ok"]
    assert await _pids(vendor, "side_once") == [side.pid]
    # Every call of the step a message of its own, the write's on its pool's subject.
    calls = [s for s in seen if s.split(".")[4].startswith("call")]
    assert sorted(c.split(".")[2] + "." + c.split(".")[4] for c in calls) == [
        "side.call_single_attempt_tool",
        "tool.call_tool",
    ], seen
    assert not front.find("fault.hold")
    assert side.find("step.acked", kind=StepKind.CALL_SINGLE_ATTEMPT_TOOL.value)


async def _settled(client: Client, turn_id: str, index: int) -> bool:
    rec = await client.call("tp1", turn_id, 0, index)
    return rec is not None and rec.state == CallState.SUCCEEDED


async def test_a_side_worker_killed_inside_a_single_attempt_write_leaves_it_in_doubt(
    client: Client, workers: WorkerFactory, vendor: Vendor, tmp_path: Any
) -> None:
    """Kill -9 of the pool's worker while the write is at the vendor: the next worker of the
    pool takes the call over and settles it ``outcome_unknown``, never made again."""
    latch = tmp_path / "latch"
    front = workers.start("front", app=FRONT)
    await front.wait_for("worker.started", timeout=30)
    victim = workers.start("side-1", app=SIDE, pools="side", env={"TEST_LATCH": str(latch)})
    h = await client.send("sider", "tp2", script([call("side_once", name="x")]))

    async def opened() -> bool:
        return sum((await vendor.request_counts("side_once.open")).values()) == 1

    await until(opened, timeout=60)
    victim.signal(signal.SIGKILL)
    latch.touch()
    workers.start("side-2", app=SIDE, pools="side")
    res = await client.wait(h, timeout=90)
    assert [s["status"] for s in body(res.text)["seen"]] == ["outcome_unknown"]
    rec = await client.call("tp2", h.turn_id, 0, 0)
    assert rec is not None and rec.state == CallState.OUTCOME_UNKNOWN
    assert await vendor.effect_count("side_once") == 0


async def test_an_approval_of_a_call_of_its_own_pool_wakes_that_pool(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """The pool's worker holds the call for a person (its policy: the front worker declared
    no approval); the decision wakes the call on ``jl.step.side.…``, made there once."""
    front = workers.start("front", app=FRONT)
    side = workers.start("side", app=SIDE, pools="side")
    await front.wait_for("worker.started", timeout=30)
    seen = await _subjects(client)
    h = await client.send("sider", "tp3", script([call("side_guarded", name="g")]))

    async def asked() -> Any:
        snap = await client.snapshot("tp3")
        return snap if snap is not None and snap.approvals else None

    snap = await until(asked, timeout=60)
    await client.approve("tp3", snap.approvals[0].approval_id, by="test")
    res = await client.wait(h, timeout=60)
    assert [s["status"] for s in body(res.text)["seen"]] == ["ok"]
    assert await _pids(vendor, "side_guarded") == [side.pid]
    woken = [s for s in seen if s.split(".")[4] == StepKind.AWAIT_TOOL_APPROVAL.value]
    assert woken and all(s.split(".")[2] == "side" for s in woken), seen


def test_pools_a_worker_cannot_serve_are_refused_with_the_setting() -> None:
    assert served_pools(side_tools_app, None) == ("session", "model", "tool", "side")
    assert served_pools(side_front_app, None) == ("session", "model", "tool")
    with pytest.raises(ValueError, match=r"--pools.*served elsewhere"):
        served_pools(side_front_app, ["side"])
    with pytest.raises(ValueError, match=r"--pools.*unknown pools \['gpu'\].*side"):
        served_pools(side_tools_app, ["tool", "gpu"])


def test_a_tools_pool_is_checked_where_it_is_declared() -> None:
    async def fn(args: Named, ctx: Any) -> None: ...

    for bad, why in (("model", "engine's own"), ("Side", "not a pool name"), ("a.b", "not a")):
        with pytest.raises(ValueError, match=why):
            tool(effect=Effect.READ, pool=bad)(fn)
    with pytest.raises(ValueError, match="pool of its own"):
        served_elsewhere(name="x", pool="tool", effect=Effect.READ, args_model=Named)
    with pytest.raises(ValueError, match="args_model or a JSON schema"):
        served_elsewhere(name="x", pool="side", effect=Effect.READ)
    t = tool(effect=Effect.READ, pool="side")(fn)
    with pytest.raises(ValueError, match="only a plain call"):
        t.__class__(**{**t.__dict__, "kind": ToolKind.TASK})


def test_only_a_calls_step_takes_its_tools_pool() -> None:
    def step(kind: StepKind) -> StepMessage:
        return StepMessage(
            kind=kind, agent="a", session_id="s", turn_id="t", call_index=0, pool="side"
        )

    assert subject_of(step(StepKind.CALL_TOOL)) == "jl.step.side.a.call_tool.s"
    assert subject_of(step(StepKind.AWAIT_TOOL_APPROVAL)).startswith("jl.step.side.")
    assert subject_of(step(StepKind.RUN_MODEL)) == "jl.step.model.a.run_model.s"
    assert subject_of(step(StepKind.JOIN)) == "jl.step.session.a.join.s"


async def test_a_worker_of_a_pool_of_its_own_does_not_split_other_steps(
    client: Client, workers: WorkerFactory
) -> None:
    """A presence that serves only a pool of its own and names no step kinds (a worker in
    another language that runs per-call kinds only) leaves the engine's pools their
    ``call_tools`` messages: it never meets one."""
    kv = await client.js.key_value(WORKERS_BUCKET)
    elsewhere = {"agents": ["sider"], "pools": ["side"], "since": time.time()}
    await kv.put("worker.node-side", json.dumps(elsewhere).encode())
    w = workers.start()
    await w.wait_for("worker.started", timeout=30)
    kinds: list[str] = []

    async def on(msg: Msg) -> None:
        if not (msg.reply or "").startswith("$JS.ACK"):
            kinds.append(msg.subject.split(".")[4])

    await client.nc.subscribe("jl.step.tool.tester.>", cb=on)
    await client.nc.flush()
    h = await client.send(
        "tester", "tp4", script([call("write", name="a"), call("read", name="b")])
    )
    await client.wait(h, timeout=30)
    assert kinds == ["call_tools"]


async def test_an_agent_served_only_by_workers_of_a_pool_of_its_own_is_offline(
    client: Client,
) -> None:
    """Its turns cannot run (no worker of the session and model pools lists it), so its
    status is ``offline`` and a snapshot of its sessions says ``waiting_for_worker``; with a
    front worker beside it, ``live``. A presence that lists no pools (a release before they
    were listed) served every engine pool."""
    kv = await client.js.key_value(WORKERS_BUCKET)
    reg = await client.registry()
    await reg.declare(["pooled"], "test")
    side = {"agents": ["pooled"], "pools": ["side"], "since": time.time()}
    await kv.put("worker.pooled-side", json.dumps(side).encode())
    assert await client.agent_status("pooled") == "offline"
    front = {"agents": ["pooled"], "pools": ["session", "model", "tool"], "since": time.time()}
    await kv.put("worker.pooled-front", json.dumps(front).encode())
    assert await client.agent_status("pooled") == "live"
    await kv.delete("worker.pooled-front")
    await kv.put("worker.pooled-old", json.dumps({"agents": ["pooled"]}).encode())
    assert await client.agent_status("pooled") == "live"
    await kv.delete("worker.pooled-old")
    await kv.delete("worker.pooled-side")


def test_a_worker_lists_only_the_agents_it_pulls_a_pool_of() -> None:
    """A worker of pool ``side`` alone serves the agents with tools there, not every agent
    of its app."""
    from jetloop.agents import Agent, App, ScriptedModel
    from jetloop.services.settings import load_settings
    from jetloop.services.worker import Worker

    other = Agent(name="plain", instructions="-", model=ScriptedModel(lambda r: None))
    app = App([*side_tools_app.agents.values(), other])
    settings = load_settings()
    assert Worker(settings, app, pools=["side"]).agents() == ["sider"]
    assert Worker(settings, app).agents() == ["plain", "sider"]
