"""The crash matrix: every row × worker kill, server restart, takeover, on real processes.

Each row is a scenario that stops a worker on purpose at a named point of a step (or while
a turn waits), then applies the failure of the column:

- worker_kill: SIGKILL the worker; a new worker starts.
- server_restart: SIGKILL nats-server and restart it on its store directory; the worker
  keeps running (it is released from its hold once the server is back, or, in the write
  rows, right as it dies: a write is in flight, see ``in_flight``).
- takeover: a 3-node cluster (R3 streams and KV); SIGKILL the node leading ``KV_jl_state``
  (where the fences live), which ``JL_STEPS``'s leadership is moved to first; the worker
  keeps running.

Every test is judged from state and from the vendor's log. ``docs/crash-matrix.md`` names
these tests cell by cell; ``tests/test_matrix_doc.py`` keeps the two in step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jetloop.demo.vendor import Vendor
from jetloop.schemas.ids import idempotency_key
from jetloop.schemas.log import LogLayout
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.settings import Settings
from jetloop.streams import topology
from jetloop.streams.connection import connect
from jetloop.tooling.trials.harness import WorkerProcess
from tests.conftest import LEASE, WorkerFactory, body, call, prepare, script, until
from tests.mcp_ledger import Ledger, invocations

MODES = ("worker_kill", "server_restart", "takeover")


STATE_STREAM = f"KV_{topology.STATE_BUCKET}"


@dataclass
class Rig:
    mode: str
    client: Client
    vendor: Vendor
    workers: WorkerFactory
    release: Path
    latch: Path
    server: EmbeddedServer | None = None
    cluster: Any = None  # jetloop.tooling.trials.cluster.LocalCluster
    killed: int = -1  # the node the takeover column killed
    app: str = "tests.apps:app"  # what every worker of the cell serves

    def worker(self, hold: str | None = None, **env: str) -> WorkerProcess:
        return self.workers.start(
            hold=hold, release_file=self.release if hold else None, app=self.app, env=env
        )

    async def fail(self, victim: WorkerProcess | None, in_flight: bool = False) -> None:
        """Apply this column's failure to the system as it stands.

        In the server columns a held worker is released once the servers are back, or, with
        ``in_flight``, right as they fail: it then sends its next request (the mark, the
        fence check, the commit) to servers that are going or gone."""
        if self.mode == "worker_kill":
            if victim is not None:
                victim.kill()
            else:
                for w in self.workers.procs:
                    w.kill()
            self.workers.start("survivor", app=self.app)
            return
        if in_flight:
            self.release.touch()
        await self.down()
        await self.up()
        self.release.touch()

    async def down(self) -> None:
        """The server columns' failure begins: nats-server gets SIGKILL, or the node leading
        ``KV_jl_state`` (where the fences live) and ``JL_STEPS`` does."""
        if self.mode == "server_restart":
            assert self.server is not None
            self.server.kill()
            return
        leader = await colocate(self.cluster)
        # The servers' own view, just before the kill: this node leads both.
        for stream in (STATE_STREAM, topology.STEPS_STREAM):
            info = await self.client.js.stream_info(stream)
            assert info.cluster is not None and info.cluster.leader == self.cluster.names[leader]
        self.cluster.kill(leader)
        self.killed = leader

    async def up(self) -> None:
        """The failure ends: the server is back on its store, or both streams have a new
        leader and the servers report the killed node as a replica that is not current."""
        if self.mode == "server_restart":
            assert self.server is not None
            self.server.start()
            await self.server.wait_jetstream()
            return
        gone = self.cluster.names[self.killed]
        for stream in (STATE_STREAM, topology.STEPS_STREAM):
            await self.cluster.wait_leader(stream, not_node=self.killed)

        async def servers_agree() -> bool:
            try:
                info = await self.client.js.stream_info(STATE_STREAM)
            except Exception:
                return False  # mid-election
            assert info.cluster is not None
            behind = {p.name for p in info.cluster.replicas or [] if not p.current}
            return info.cluster.leader not in (None, gone) and gone in behind

        await until(servers_agree, timeout=20)

    @property
    def worker_killed(self) -> bool:
        return self.mode == "worker_kill"


async def colocate(cluster: Any, tries: int = 5) -> int:
    """Move ``JL_STEPS``'s leadership to the node leading ``KV_jl_state`` (a leader stepdown
    with that node preferred), so one SIGKILL takes both leaders; returns that node."""
    target = int(await cluster.wait_leader(STATE_STREAM))

    async def there() -> bool:
        try:
            return bool(await cluster.stream_leader(topology.STEPS_STREAM, 0.5) == target)
        except Exception:
            return False  # mid-election

    for _ in range(tries):
        if await there():
            return target
        nc = await connect(cluster.urls, "test-stepdown")
        try:
            await nc.request(
                f"$JS.API.STREAM.LEADER.STEPDOWN.{topology.STEPS_STREAM}",
                json.dumps({"placement": {"preferred": cluster.names[target]}}).encode(),
                timeout=5,
            )
        finally:
            await nc.close()
        with contextlib.suppress(TimeoutError):
            await until(there, timeout=5)
    raise AssertionError(f"{topology.STEPS_STREAM} would not move to {cluster.names[target]}")


@pytest.fixture(params=MODES)
async def rig(
    request: pytest.FixtureRequest, tmp_path: Path, vendor_db: Path, vendor: Vendor
) -> AsyncIterator[Rig]:
    # "<mode>" or "<mode>+folded": the session log folded (``test_matrix_folded``).
    mode, _, layout = str(request.param).partition("+")
    release = tmp_path / "release"
    cluster: Any = None
    server: EmbeddedServer | None = None
    if mode == "takeover":
        from jetloop.tooling.trials.cluster import LocalCluster

        cluster = LocalCluster(tmp_path / "cluster", "jl-test")
        cluster.start()
        urls: list[str] = cluster.urls
        env = {"JETLOOP_REPLICAS": "3"}
        replicas = 3
    else:
        server = EmbeddedServer(tmp_path / "store", port=0, log_file=tmp_path / "nats.log")
        server.start()
        urls, env, replicas = [server.url], {}, 1
    workers = WorkerFactory(tmp_path, ",".join(urls), vendor_db, env=env)
    try:
        if cluster is not None:
            await cluster.wait_ready()
        else:
            assert server is not None
            await server.wait_jetstream()
        nc = await connect(urls, "test-topology")
        try:
            cfg = Settings(lease_seconds=LEASE, replicas=replicas).topology()
            cfg = dataclasses.replace(cfg, event_log=LogLayout(layout) if layout else None)
            await prepare(nc, cfg)
        finally:
            await nc.close()
        if cluster is not None:
            await colocate(cluster)
        client = await Client.connect(urls)
        try:
            yield Rig(
                mode,
                client,
                vendor,
                workers,
                release,
                tmp_path / "latch",
                server=server,
                cluster=cluster,
            )
        finally:
            await client.close()
    finally:
        workers.close()
        if cluster is not None:
            cluster.stop()
        if server is not None:
            server.kill()


def steps_asked(counts: dict[str, int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for payload, n in counts.items():
        k = json.loads(payload)["step"]
        out[k] = out.get(k, 0) + n
    return out


async def count(vendor: Vendor, op: str) -> int:
    return sum((await vendor.request_counts(op)).values())


async def held(rig: Rig, point: str, text: str, session: str = "m") -> tuple[Any, WorkerProcess]:
    victim = rig.worker(hold=point)
    h = await rig.client.send("tester", session, text)
    await victim.wait_for("fault.hold", point=point)
    return h, victim


async def in_flight(rig: Rig, tool: str) -> Any:
    """The server columns' write in flight: a worker makes ``tool`` and holds its request open
    at the vendor (``TEST_LATCH``, tests/apps.py); the servers fail with the request open; the
    latch opens during the outage, so the vendor applies the write and the worker sends its
    commit to servers that are down; then they come back."""
    rig.worker(TEST_LATCH=str(rig.latch))
    h = await rig.client.send("tester", "m", script([call(tool, name="x")]))

    async def opened() -> bool:
        return await count(rig.vendor, f"{tool}.open") == 1

    await until(opened)
    await marked(rig, h.turn_id)
    await rig.down()
    rig.latch.touch()

    async def applied() -> bool:
        return await count(rig.vendor, tool) == 1

    await until(applied)
    await rig.up()
    return h


async def marked(rig: Rig, turn_id: str) -> None:
    """A write's first attempt is marked in doubt before its tool is made."""
    rec = await rig.client.call("m", turn_id, 0, 0)
    assert rec is not None and rec.state == "in_doubt", rec
    assert rec.attempt is not None and rec.attempt.no == 1 and rec.attempts == 1


async def resumes(rig: Rig, turn_id: str, step: str = "m0.c0") -> list[Any]:
    """The audited resumes (``agent.run.crash_resumed``) of one step of a turn."""
    key = f"m.{turn_id}.{step}"
    return [
        e
        async for e in _events_until_done(rig.client, "m")
        if e.type == "agent.run.crash_resumed" and e.data["step"] == key
    ]


# --- the rows --------------------------------------------------------------------------


async def run_model_before_output(rig: Rig) -> None:
    h, v = await held(rig, "run_model.before_commit", script([call("write", name="x")]))
    await rig.fail(v)
    await rig.client.wait(h, timeout=90)
    asked = steps_asked(await rig.vendor.payload_counts("model_call"))
    # Asked again when the attempt was lost; a server failure need not cost it.
    assert asked[0] == 2 if rig.worker_killed else asked[0] in (1, 2)
    assert asked[1] == 1
    assert await rig.vendor.effect_count("write") == 1
    if rig.worker_killed:
        resumed = [
            e
            async for e in _events_until_done(rig.client, "m")
            if e.type == "agent.run.crash_resumed"
        ]
        assert [e.data["step"] for e in resumed] == [f"m.{h.turn_id}.m0"]


async def run_model_after_output(rig: Rig) -> None:
    h, v = await held(rig, "run_model.after_commit", script([call("write", name="x")]))
    await rig.fail(v)
    await rig.client.wait(h, timeout=90)
    assert steps_asked(await rig.vendor.payload_counts("model_call")) == {0: 1, 1: 1}


async def idempotent_write_before_mark(rig: Rig) -> None:
    h, v = await held(rig, "call_tool.before_mark", script([call("write", name="x")]))
    assert await rig.client.call("m", h.turn_id, 0, 0) is None, "no mark before the hold"
    await rig.fail(v)
    await rig.client.wait(h, timeout=90)
    assert await count(rig.vendor, "write") == 1
    assert await rig.vendor.effect_count("write") == 1
    # No attempt was marked before the failure: nothing was lost, the call is attempt 1.
    rec = await rig.client.call("m", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 1
    assert await resumes(rig, h.turn_id) == []


async def idempotent_write_while_running(rig: Rig) -> None:
    if rig.worker_killed:
        h, v = await held(rig, "call_tool.before_commit", script([call("write", name="x")]))
        await marked(rig, h.turn_id)
        await rig.fail(v)
    else:
        h = await in_flight(rig, "write")
    res = await rig.client.wait(h, timeout=90)
    keys = await rig.vendor.request_counts("write")
    assert len(keys) == 1, "the same idempotency key on every attempt"
    assert await rig.vendor.effect_count("write") == 1
    rec = await rig.client.call("m", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.outcome is not None
    assert rec.outcome.result == {"op": "write", "name": "x"}
    assert body(res.text)["seen"][0]["result"] == rec.outcome.result
    resumed = [e.data["settled"] for e in await resumes(rig, h.turn_id)]
    # A lost attempt is audited and made again with the same key: every attempt the call
    # records reached the vendor (a lost one was made again, not recorded as made).
    # The worker's attempt is lost when its worker dies; under a server failure it goes on
    # and commits once the servers are back (one attempt, one request), unless the outage
    # outlasted its lease: then exactly the worker-kill outcome (two, the second deduped).
    assert rec.attempts == 1 + len(resumed)
    assert resumed == [{rec.key: "made again"}] * (rec.attempts - 1)
    assert list(keys.values()) == [rec.attempts]
    if rig.worker_killed:
        assert rec.attempts == 2
    else:
        assert rec.attempts in (1, 2)
        assert list((await rig.vendor.request_counts("write.open")).values()) == [rec.attempts]


async def read_while_running(rig: Rig) -> None:
    h, v = await held(rig, "call_tool.before_commit", script([call("read", name="r")]))
    await rig.fail(v)
    await rig.client.wait(h, timeout=90)
    made = await count(rig.vendor, "read")
    assert made == 2 if rig.worker_killed else made in (1, 2)


async def every_attempt(rig: Rig, tool: str, state: str) -> None:
    """Every attempt lost (worker kill) or failing through a server failure."""
    if rig.worker_killed:
        # More losses allowed than attempts, so the call's attempts run out before the turn's
        # loss limit ends it: the survivor settles the call (`attempts_exhausted`).
        env = {"JETLOOP_MAX_LOSSES": "5"}
        h = await rig.client.send("tester", "ea", script([call(tool, name="x")]))
        for n in range(3):
            victim = rig.workers.start(f"victim{n}", hold="call_tool.before_commit", env=env)
            await victim.wait_for("fault.hold", point="call_tool.before_commit")
            victim.kill()
        rig.workers.start("survivor", env=env)
    else:
        broken = {"read": "broken_read", "write": "broken_write"}[tool]
        rig.worker()
        h = await rig.client.send("tester", "ea", script([call(broken, name="x")]))

        async def first_failed() -> bool:
            return await count(rig.vendor, broken) >= 1

        await until(first_failed)
        await rig.fail(None)
    res = await rig.client.wait(h, timeout=120)
    rec = await rig.client.call("ea", h.turn_id, 0, 0)
    assert rec is not None and rec.state == state and rec.attempts == 3
    assert body(res.text)["seen"][0]["status"] == {"failed": "error"}.get(state, state)
    if rig.worker_killed:
        assert rec.settlement == "attempts_exhausted"
        assert rec.outcome is not None and "every attempt (3)" in (rec.outcome.error or "")
        # Each lost attempt reached the vendor (it was held after the tool), with one key.
        assert list((await rig.vendor.request_counts(tool)).values()) == [3]


async def every_attempt_read(rig: Rig) -> None:
    await every_attempt(rig, "read", "failed")


async def every_attempt_write(rig: Rig) -> None:
    await every_attempt(rig, "write", "outcome_unknown")


async def single_attempt_before_mark(rig: Rig) -> None:
    h, v = await held(rig, "call_tool.before_mark", script([call("once", name="x")]))
    assert await rig.client.call("m", h.turn_id, 0, 0) is None, "no mark before the hold"
    await rig.fail(v)
    res = await rig.client.wait(h, timeout=90)
    # No attempt reached the in-doubt mark: the tool provably did not run, so it is made.
    assert body(res.text)["seen"][0]["status"] == "ok"
    assert await count(rig.vendor, "once") == 1
    rec = await rig.client.call("m", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 1
    assert await resumes(rig, h.turn_id) == []


async def single_attempt_after_mark(rig: Rig) -> None:
    h, v = await held(rig, "call_tool.in_tool", script([call("once", name="x")]))
    await marked(rig, h.turn_id)
    # Server columns: released right as the servers fail, so the fence check and the call
    # run into the outage.
    await rig.fail(v, in_flight=True)
    res = await rig.client.wait(h, timeout=90)
    await settled_at_most_once(rig, h, res, made_by_lost=not rig.worker_killed)
    if rig.worker_killed:
        assert await count(rig.vendor, "once") == 0, "the killed attempt never made the call"


async def single_attempt_while_running(rig: Rig) -> None:
    if rig.worker_killed:
        h, v = await held(rig, "call_tool.before_commit", script([call("once", name="x")]))
        await marked(rig, h.turn_id)
        await rig.fail(v)
    else:
        h = await in_flight(rig, "once")
    res = await rig.client.wait(h, timeout=90)
    # The attempt the failure hit had made the call (the vendor applied it before the
    # servers came back, or before the worker died): it is never made again.
    assert await count(rig.vendor, "once") == 1, "a single-attempt write never runs twice"
    await settled_at_most_once(rig, h, res, made_by_lost=True)


async def settled_at_most_once(rig: Rig, h: Any, res: Any, made_by_lost: bool) -> None:
    """A single-attempt write whose attempt a failure hit after its in-doubt mark: exactly
    one of two outcomes, each matching the vendor's records. The attempt went on and
    recorded what the call did (``ok``: made once, nothing resumed); or it was lost (a worker
    kill, an outage past the lease) and the redelivery settled the call ``outcome_unknown``
    without making it (audited; the vendor saw at most the lost attempt's one request)."""
    status = body(res.text)["seen"][0]["status"]
    rec = await rig.client.call("m", h.turn_id, 0, 0)
    assert rec is not None and rec.attempts == 1
    made = await count(rig.vendor, "once")
    resumed = [e.data["settled"] for e in await resumes(rig, h.turn_id)]
    if rig.worker_killed or resumed:
        assert resumed == [{rec.key: "outcome_unknown"}]
        assert (status, rec.state, rec.settlement) == (
            "outcome_unknown",
            "outcome_unknown",
            "outcome_unknown",
        )
        assert made <= (1 if made_by_lost else 0)
    else:
        assert (status, rec.state) == ("ok", "succeeded")
        assert rec.outcome is not None and rec.outcome.result == {"op": "once", "name": "x"}
        assert made == 1


MCP_CALLS = {
    "balance": {"account": "acct-1"},
    "set_limit": {"account": "acct-1", "limit": 10_000},
    "transfer": {"account": "acct-1", "amount": 500},
}


async def mcp_while_running(rig: Rig) -> None:
    """A call of each effect among an MCP server's tools (tests/apps_mcp.py: the example
    ledger server, over stdio as agent `tester` and over streamable HTTP as `tester_http`),
    each in a session of its own, all six held after the server made them and before their
    outcomes are committed; then the column's failure. Judged from the servers' own log of
    invocations by `_meta` idempotency key: the read made again, the idempotent write made
    again with the same key, the single-attempt write never made twice (``outcome_unknown``
    when its attempt was lost)."""
    led = Ledger(rig.release.parent / "mcp-log.jsonl", rig.release.parent / "mcp-state.json")
    led.start_http()
    rig.app = "tests.apps_mcp:app"
    rig.workers.env.update(led.env())
    try:
        victim = rig.worker(hold="call_tool.before_commit")
        handles = {
            (agent, tool): await rig.client.send(
                agent, f"m-{agent}-{tool}", script([call(tool, **args)])
            )
            for agent in ("tester", "tester_http")
            for tool, args in MCP_CALLS.items()
        }

        async def all_held() -> bool:
            held = victim.find("fault.hold", point="call_tool.before_commit")
            return len(held) == len(handles)

        await until(all_held, timeout=60)
        await rig.fail(victim)
        made = [i["key"] for i in invocations(led.log)]
        for (agent, tool), h in handles.items():
            session = f"m-{agent}-{tool}"
            res = await rig.client.wait(h, timeout=90)
            rec = await rig.client.call(session, h.turn_id, 0, 0)
            assert rec is not None
            status = body(res.text)["seen"][0]["status"]
            made = [i["key"] for i in invocations(led.log)]
            times = made.count(idempotency_key(session, h.turn_id, 0, 0))
            if tool == "transfer":
                assert times == 1, "a single-attempt write is never made twice"
                if rig.worker_killed:
                    assert (status, rec.state) == ("outcome_unknown", "outcome_unknown")
                else:
                    assert (status, rec.state) in (
                        ("ok", "succeeded"),
                        ("outcome_unknown", "outcome_unknown"),
                    )
            else:
                # Made again after a lost attempt (a worker kill always loses it; a server
                # failure only when the outage outlasted its lease), with the same key.
                assert status == "ok" and times == rec.attempts, (agent, tool, times)
                assert rec.attempts == 2 if rig.worker_killed else rec.attempts in (1, 2)
    finally:
        led.stop()


async def approval_while_waiting(rig: Rig) -> None:
    rig.worker()
    h = await rig.client.send("tester", "m", script([call("guarded", name="g")]))
    snap = await until(lambda: _snap_with(rig, lambda s: s.approvals))
    aid = snap.approvals[0].approval_id

    async def gated() -> Any:
        rec = await rig.client.call("m", h.turn_id, 0, 0)
        return rec if rec is not None and rec.approval_id == aid else None

    # The call waits in state for the decision, and the tool is not made meanwhile.
    assert (await until(gated)).state == "awaiting_approval"
    assert await count(rig.vendor, "guarded") == 0
    await rig.fail(None)
    rec = await rig.client.call("m", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "awaiting_approval" and rec.attempts == 0
    assert await count(rig.vendor, "guarded") == 0
    await rig.client.approve("m", aid, by="matrix")
    await rig.client.wait(h, timeout=90)
    assert await rig.vendor.effect_count("guarded") == 1
    assert await count(rig.vendor, "guarded") == 1
    rec = await rig.client.call("m", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 1


async def question_while_waiting(rig: Rig) -> None:
    rig.worker()
    h = await rig.client.send("tester", "m", script([call("ask_user", question="why?")]))
    snap = await until(lambda: _snap_with(rig, lambda s: s.questions))
    await rig.fail(None)
    await rig.client.answer("m", snap.questions[0].question_id, "because", by="matrix")
    res = await rig.client.wait(h, timeout=90)
    assert body(res.text)["seen"][0]["result"] == {"answer": "because"}


async def timer_while_waiting(rig: Rig) -> None:
    rig.worker()
    h = await rig.client.send("tester", "m", script([call("wait", seconds=2)]))
    await until(lambda: _snap_with(rig, lambda s: s.timers))
    await rig.fail(None)
    await rig.client.wait(h, timeout=90)
    fired = [e async for e in _events_until_done(rig.client, "m") if e.type == "timer.fired"]
    assert len(fired) == 1


async def poll_between_polls(rig: Rig) -> None:
    rig.worker()
    h = await rig.client.send("tester", "m", script([call("export", name="e", polls=3)]))

    async def polled() -> bool:
        return await count(rig.vendor, "task_poll") >= 1

    await until(polled)
    await rig.fail(None)
    res = await rig.client.wait(h, timeout=90)
    assert body(res.text)["seen"][0]["status"] == "ok"
    assert await count(rig.vendor, "task_start") == 1


async def poll_during_poll(rig: Rig) -> None:
    h, v = await held(rig, "poll_tool_task.in_poll", script([call("export", name="e", polls=2)]))
    await rig.fail(v)
    res = await rig.client.wait(h, timeout=90)
    assert body(res.text)["seen"][0]["status"] == "ok"
    assert await count(rig.vendor, "task_start") == 1


async def compaction_during_summary(rig: Rig) -> None:
    first = rig.worker()
    h1 = await rig.client.send("compactor", "m", script(answer="padding " * 60))
    await rig.client.wait(h1, timeout=60)
    first.kill()
    victim = rig.worker(hold="compact_context.in_call")
    h2 = await rig.client.send("compactor", "m", script(answer="after"))
    await victim.wait_for("fault.hold", point="compact_context.in_call")
    await rig.fail(victim)
    res = await rig.client.wait(h2, timeout=90)
    assert body(res.text)["summaries"] == ["SUMMARY of 2 messages"]
    assert await count(rig.vendor, "summary_call") in ((1,) if rig.worker_killed else (1, 2))
    snap = await rig.client.snapshot("m")
    assert snap is not None and [e.role for e in snap.history].count("summary") == 1


async def idle_session(rig: Rig) -> None:
    rig.worker()
    h = await rig.client.send("tester", "m", script())
    await rig.client.wait(h, timeout=60)
    await rig.fail(None)
    h2 = await rig.client.send("tester", "m", script([call("read", name="r")]))
    res = await rig.client.wait(h2, timeout=90)
    assert body(res.text)["seen"][0]["status"] == "ok"


async def queued_before_worker(rig: Rig) -> None:
    h = await rig.client.send("tester", "m", script([call("write", name="w")]))
    if rig.worker_killed:
        # The victim serves the session and model pools only: it runs model step 0, which
        # queues the call's step; the victim dies with that step still in the queue.
        victim = rig.workers.start("victim", pools="session,model")

        async def queued() -> bool:
            return await tool_steps_pending(rig) == 1

        await until(queued)
        victim.kill()
        rig.workers.start("survivor")
    else:
        await rig.fail(None)
        rig.worker()
    await rig.client.wait(h, timeout=90)
    turn = await rig.client.turn("m", h.turn_id)
    rec = await rig.client.call("m", h.turn_id, 0, 0)
    assert turn is not None and turn.attempts == 1
    assert rec is not None and rec.attempts == 1


async def after_wait_while_moving_on(rig: Rig) -> None:
    # An approval, a question and a timer end together; the worker is stopped in each
    # handler that moves its call on: the approved tool running, the answer and the firing
    # read but the call not yet settled.
    victim = rig.worker(hold="call_tool.in_tool,call_tool.wait_over")
    waits = [call("guarded", name="g"), call("ask_user", question="why?"), call("wait", seconds=1)]
    h = await rig.client.send("tester", "m", script(waits))
    snap = await until(lambda: _snap_with(rig, lambda s: s.approvals and s.questions))
    await rig.client.approve("m", snap.approvals[0].approval_id, by="matrix")
    await rig.client.answer("m", snap.questions[0].question_id, "because", by="matrix")

    async def all_held() -> bool:
        return len(victim.find("fault.hold")) == 3

    await until(all_held)
    assert {ln["point"] for ln in victim.find("fault.hold")} == {
        "call_tool.in_tool",
        "call_tool.wait_over",
    }
    await rig.fail(victim)
    res = await rig.client.wait(h, timeout=90)
    seen = body(res.text)["seen"]
    assert [s["status"] for s in seen] == ["ok", "ok", "ok"]
    assert seen[1]["result"] == {"answer": "because"}
    assert seen[2]["result"] == {"waited_seconds": 1}
    assert await rig.vendor.effect_count("guarded") == 1
    kinds = [e.type.value async for e in _events_until_done(rig.client, "m")]
    # Each wait's end is recorded once and read again, not asked again.
    for kind in ("approval.requested", "approval.decided", "question.asked"):
        assert kinds.count(kind) == 1, (kind, kinds)
    for kind in ("question.answered", "timer.set", "timer.fired"):
        assert kinds.count(kind) == 1, (kind, kinds)


async def after_result_before_commit(rig: Rig) -> None:
    h, v = await held(rig, "call_tool.before_commit", script([call("write", name="x")]))
    await marked(rig, h.turn_id)
    # Server columns: released right as the servers fail, so the commit is in flight.
    await rig.fail(v, in_flight=True)
    await rig.client.wait(h, timeout=90)
    rec = await rig.client.call("m", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded"
    # The held attempt had made the write. It is made again (same key) exactly when the
    # attempt was lost, which is audited; a server failure within the lease costs nothing.
    resumed = [e.data["settled"] for e in await resumes(rig, h.turn_id)]
    assert resumed == [{rec.key: "made again"}] * (rec.attempts - 1)
    assert rec.attempts == 2 if rig.worker_killed else rec.attempts in (1, 2)
    assert list((await rig.vendor.request_counts("write")).values()) == [rec.attempts]
    assert await rig.vendor.effect_count("write") == 1


async def tool_steps_pending(rig: Rig) -> int:
    """Tool steps published for the test agent. No worker serving the tool pool has run yet
    (its consumer does not even exist), so each of them is in the queue, not taken."""
    info = await rig.client.js.stream_info(topology.STEPS_STREAM, subjects_filter="jl.step.tool.>")
    return sum((info.state.subjects or {}).values())


async def _snap_with(rig: Rig, pred: Callable[[Any], Any]) -> Any:
    snap = await rig.client.snapshot("m")
    return snap if snap is not None and pred(snap) else None


async def _events_until_done(client: Client, session: str) -> AsyncIterator[Any]:
    async for ev in client.events(session):
        yield ev
        if ev.type in ("turn.completed", "turn.failed", "turn.cancelled"):
            return


ROWS: dict[str, Callable[[Rig], Awaitable[None]]] = {
    "run_model-before-output": run_model_before_output,
    "run_model-after-output": run_model_after_output,
    "idempotent_write-before-mark": idempotent_write_before_mark,
    "idempotent_write-while-running": idempotent_write_while_running,
    "read-while-running": read_while_running,
    "every_attempt-read": every_attempt_read,
    "every_attempt-write": every_attempt_write,
    "single_attempt-before-mark": single_attempt_before_mark,
    "single_attempt-after-mark": single_attempt_after_mark,
    "single_attempt-while-running": single_attempt_while_running,
    "mcp-while-running": mcp_while_running,
    "approval-while-waiting": approval_while_waiting,
    "question-while-waiting": question_while_waiting,
    "timer-while-waiting": timer_while_waiting,
    "poll-between-polls": poll_between_polls,
    "poll-during-poll": poll_during_poll,
    "compaction-during-summary": compaction_during_summary,
    "idle-session": idle_session,
    "queued-before-worker": queued_before_worker,
    "after-wait-while-moving-on": after_wait_while_moving_on,
    "after-result-before-commit": after_result_before_commit,
}


@pytest.mark.parametrize("row", list(ROWS))
async def test_matrix(rig: Rig, row: str) -> None:
    """One cell: the row's scenario under the column's failure (see docs/crash-matrix.md)."""
    await ROWS[row](rig)


# The rows where the folded log publishes differently (jetloop.schemas.log): a call's result
# entry with its outcome at its commit, a queued turn's start, a model step's answer.
FOLDED_ROWS = (
    "run_model-after-output",
    "read-while-running",
    "single_attempt-after-mark",
    "after-result-before-commit",
    "queued-before-worker",
)


@pytest.mark.parametrize("rig", ["worker_kill+folded", "server_restart+folded"], indirect=True)
@pytest.mark.parametrize("row", FOLDED_ROWS)
async def test_matrix_folded(rig: Rig, row: str) -> None:
    """The same cell with the session log folded: judged by the same readers."""
    await ROWS[row](rig)
