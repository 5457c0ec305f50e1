"""Every step kind and every outcome (issue 3), on a real nats-server with worker processes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from jetloop.consumers.calls import TOOL_CALL_NOT_RUN_ERROR_PREFIX
from jetloop.demo.vendor import Vendor
from jetloop.services.client import Client, TurnFailed
from jetloop.sessions.snapshot import SessionSnapshot
from tests.conftest import WorkerFactory, body, call, script, until


async def snapshot_when(client: Client, session: str, pred: object, timeout: float = 30) -> object:
    async def check() -> object:
        snap = await client.snapshot(session)
        return snap if snap is not None and pred(snap) else None  # type: ignore[operator]

    return await until(check, timeout)


# --- CallSingleAttemptTool ------------------------------------------------------------


@pytest.mark.parametrize(
    ("point", "settlement", "requests"),
    [
        pytest.param("call_tool.before_commit", "read_back", 1, id="applied-read-back"),
        pytest.param("call_tool.in_tool", None, 1, id="not-applied-made-once"),
    ],
)
async def test_single_attempt_write_with_reader(
    client: Client,
    workers: WorkerFactory,
    vendor: Vendor,
    point: str,
    settlement: str | None,
    requests: int,
) -> None:
    """With a reader, a call in doubt is read back by its key instead of guessed."""
    victim = workers.start("victim", hold=point)
    h = await client.send("tester", "rb", script([call("once_read", name="x")]))
    await victim.wait_for("fault.hold", point=point)
    victim.kill()
    workers.start("survivor")
    res = await client.wait(h, timeout=30)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "ok"
    rec = await client.call("rb", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.settlement == settlement
    assert sum((await vendor.request_counts("once_read")).values()) == requests


# --- attempts ------------------------------------------------------------------------


async def test_attempts_and_their_outcomes(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Transient failures retry within 3 attempts; then a read fails, a write is unknown;
    a call that cannot run fails with the did-not-run prefix; a ToolError fails at once."""
    workers.start()
    h = await client.send(
        "tester",
        "att",
        script(
            [
                call("flaky", name="f"),
                call("broken_read", name="r"),
                call("broken_write", name="w"),
                call("refuse", name="nothing"),
                call("write", wrong="args"),
                call("no_such_tool"),
            ]
        ),
    )
    res = await client.wait(h, timeout=60)
    seen = body(res.text)["seen"]
    by_tool = {s["tool"]: s for s in seen}
    assert by_tool["flaky"]["status"] == "ok"
    assert by_tool["broken_read"]["status"] == "error"
    assert by_tool["broken_read"]["error"].startswith("every attempt (3) failed")
    assert by_tool["broken_write"]["status"] == "outcome_unknown"
    assert by_tool["refuse"]["status"] == "error"
    assert by_tool["refuse"]["error"] == "no such thing as nothing"
    assert by_tool["write"]["error"].startswith(TOOL_CALL_NOT_RUN_ERROR_PREFIX)
    assert by_tool["no_such_tool"]["error"].startswith(TOOL_CALL_NOT_RUN_ERROR_PREFIX)
    assert len(await vendor.payload_counts("broken_read")) == 3  # attempts 1, 2, 3
    assert await vendor.effect_count("flaky") == 1
    recs = [await client.call("att", h.turn_id, 0, i) for i in range(3)]
    assert [r.attempts for r in recs if r] == [3, 3, 3]


async def test_model_step_exhausted_fails_the_turn_and_leaves_a_note(
    client: Client, workers: WorkerFactory
) -> None:
    """A model step that fails 3 times fails the turn; the next turn's model is told the
    failed turn's tools had run."""
    workers.start()
    h = await client.send(
        "tester", "mx", json.dumps({"steps": [[call("write", name="w")]], "fail_at_step": 1})
    )
    with pytest.raises(TurnFailed, match="model step 1 failed after 3 attempts"):
        await client.wait(h, timeout=60)
    h2 = await client.send("tester", "mx", script())
    res = await client.wait(h2, timeout=30)
    [note] = body(res.text)["notes"]
    assert "after 1 tool call(s) had already run" in note


# --- AwaitToolApproval -----------------------------------------------------------------


async def test_approval_runs_the_call_once(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A held call waits holding nothing; an approval runs it once; a repeat of it
    returns the recorded one (a conflicting one: tests/test_decisions.py)."""
    workers.start()
    h = await client.send("tester", "ap", script([call("guarded", name="g")]))
    snap = await snapshot_when(client, "ap", lambda s: s.approvals and s.status == "waiting")
    [ap] = snap.approvals  # type: ignore[attr-defined]
    assert ap.tool == "guarded" and ap.args == {"name": "g"}
    assert await vendor.effect_count("guarded") == 0
    first = await client.approve("ap", ap.approval_id, by="alice")
    again = await client.approve("ap", ap.approval_id, by="bob")
    assert first.status == again.status == "approved" and again.decided_by == "alice"
    res = await client.wait(h, timeout=30)
    assert [s["status"] for s in body(res.text)["seen"]] == ["ok"]
    assert await vendor.effect_count("guarded") == 1


async def test_rejection_is_shown_to_the_model(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A rejected call is denied with the reason; the tool never runs."""
    workers.start()
    h = await client.send("tester", "rj", script([call("guarded", name="g")]))
    snap = await snapshot_when(client, "rj", lambda s: s.approvals)
    [ap] = snap.approvals  # type: ignore[attr-defined]
    await client.reject("rj", ap.approval_id, by="carol", reason="not today")
    res = await client.wait(h, timeout=30)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "denied" and seen["error"] == "denied by carol: not today"
    assert await vendor.effect_count("guarded") == 0


async def test_approval_while_no_worker_runs_and_policy_overrides(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """The wait lives in state: the worker can die while it waits, the decision is taken
    with no worker up, a new worker runs the tool once. Predicates and per-session
    overrides decide which calls wait."""
    w = workers.start()
    await client.set_approval("pol", "write", True, agent="tester")
    h = await client.send(
        "tester",
        "pol",
        script([call("pay", name="small"), call("pay", name="big-one"), call("write", name="w")]),
    )

    def only_waits(s: SessionSnapshot) -> bool:
        # The small payment needs no approval and runs beside the two that wait: kill the
        # worker only once it is recorded. Killed between its in-doubt mark and its commit,
        # it is rightly settled outcome_unknown (a single-attempt write with no reader).
        made = [c.state for c in s.calls if c.index == 0]
        return len(s.approvals) == 2 and made == ["succeeded"]

    snap = await snapshot_when(client, "pol", only_waits)
    tools = sorted(a.tool for a in snap.approvals)  # type: ignore[attr-defined]
    assert tools == ["pay", "write"]
    w.kill()
    for ap in snap.approvals:  # type: ignore[attr-defined]
        await client.approve("pol", ap.approval_id, by="dave")
    workers.start()
    res = await client.wait(h, timeout=30)
    assert [s["status"] for s in body(res.text)["seen"]] == ["ok", "ok", "ok"]
    assert sum((await vendor.request_counts("pay")).values()) == 2
    assert await vendor.effect_count("write") == 1


async def test_control_over_nats(client: Client, workers: WorkerFactory) -> None:
    """The NATS request/reply control API approves and reads snapshots; bad requests get
    an error reply."""
    workers.start()
    h = await client.send("tester", "nc", script([call("guarded", name="g")]))
    snap = await snapshot_when(client, "nc", lambda s: s.approvals)
    [ap] = snap.approvals  # type: ignore[attr-defined]
    reply = await client.nc.request(
        "jl.control.approve",
        json.dumps({"session_id": "nc", "approval_id": ap.approval_id, "by": "eve"}).encode(),
        timeout=10,
    )
    got = json.loads(reply.data)
    assert got["ok"] and got["result"]["status"] == "approved"
    await client.wait(h, timeout=30)
    reply = await client.nc.request(
        "jl.control.snapshot", json.dumps({"session_id": "nc"}).encode(), timeout=10
    )
    got = json.loads(reply.data)
    assert got["ok"] and got["result"]["status"] == "idle"
    bad = json.loads((await client.nc.request("jl.control.approve", b"{}", timeout=10)).data)
    assert bad == {
        "ok": False,
        "error": {
            "status": 422,
            "title": "invalid request",
            "detail": "session_id: Field required",
        },
    }


# --- AwaitQuestionAnswer ---------------------------------------------------------------


async def test_question_and_answer(client: Client, workers: WorkerFactory) -> None:
    """The model asks; the answer resumes the turn with it."""
    w = workers.start()
    h = await client.send("tester", "qa", script([call("ask_user", question="Which color?")]))
    snap = await snapshot_when(client, "qa", lambda s: s.questions)
    [q] = snap.questions  # type: ignore[attr-defined]
    assert q.question == "Which color?"
    w.kill()
    workers.start()
    await client.answer("qa", q.question_id, "blue", by="frank")
    res = await client.wait(h, timeout=30)
    [seen] = body(res.text)["seen"]
    assert seen == {"tool": "ask_user", "status": "ok", "result": {"answer": "blue"}, "error": None}


# --- AwaitTimer ------------------------------------------------------------------------


async def test_timer_fires_once(client: Client, workers: WorkerFactory) -> None:
    """A wait is a message schedule: no worker holds it, it fires once."""
    import time

    w = workers.start()
    t0 = time.time()
    h = await client.send("tester", "tm", script([call("wait", seconds=2)]))
    await snapshot_when(client, "tm", lambda s: s.timers)
    w.kill()  # the wait needs no worker: a new one takes the firing
    workers.start()
    res = await client.wait(h, timeout=30)
    assert time.time() - t0 >= 2.0
    [seen] = body(res.text)["seen"]
    assert seen["result"] == {"waited_seconds": 2}
    fired = []
    async for ev in client.events("tm"):
        if ev.type == "timer.fired":
            fired.append(ev)
        if ev.type == "turn.completed":
            break
    assert len(fired) == 1


# --- PollToolTask ----------------------------------------------------------------------


async def test_task_polls_until_done_and_starts_once(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A task's handle is recorded once; polls are spaced and resume after a kill without
    starting a second task."""
    w = workers.start()
    h = await client.send("tester", "tk", script([call("export", name="e", polls=4)]))

    async def polled() -> bool:
        return sum((await vendor.request_counts("task_poll")).values()) >= 1

    await until(polled)
    w.kill()
    workers.start()
    res = await client.wait(h, timeout=30)
    [seen] = body(res.text)["seen"]
    assert seen["status"] == "ok" and seen["result"]["rows"] == 42
    assert await vendor.effect_count("task_start") == 1
    assert sum((await vendor.request_counts("task_start")).values()) == 1


# --- cancel ----------------------------------------------------------------------------


async def test_cancel_tells_tools_and_cancels_tasks(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Cancel: running tools see ctx.cancelled, tasks are cancelled, the turn ends
    cancelled and the next queued message runs."""
    workers.start()
    h = await client.send(
        "tester",
        "cx",
        script([call("patient", name="p", seconds=30), call("export", name="e", polls=1000)]),
    )
    h2 = await client.send("tester", "cx", script([call("write", name="after")]))
    await snapshot_when(client, "cx", lambda s: s.tasks)
    turn = await client.cancel("cx", by="grace")
    assert turn.status == "cancelled"
    with pytest.raises(TurnFailed, match="cancelled"):
        await client.wait(h, timeout=30)
    await client.wait(h2, timeout=30)

    async def told() -> bool:
        return bool(await vendor.request_counts("patient_cancelled"))

    await until(told)
    assert sum((await vendor.request_counts("task_cancel")).values()) == 1
    assert await vendor.effect_count("patient") == 0


# --- reconcile -------------------------------------------------------------------------


async def test_reconcile_outcome_unknown(client: Client, workers: WorkerFactory) -> None:
    """Only an outcome_unknown call can be reconciled; who and when are recorded; the next
    turn's model sees it."""
    victim = workers.start("victim", hold="call_tool.before_commit")
    h = await client.send("tester", "rc", script([call("once", name="x"), call("read", name="y")]))
    await victim.wait_for("fault.hold")
    victim.kill()
    workers.start()
    await client.wait(h, timeout=30)
    snap = await client.snapshot("rc")
    assert snap is not None
    by_tool = {c.tool: c for c in snap.calls}
    unknown = by_tool["once"]
    assert unknown.state == "outcome_unknown"
    from jetloop.schemas.errors import ControlError

    with pytest.raises(ControlError, match="only an outcome_unknown call"):
        await client.reconcile(by_tool["read"].call_key, True, by="heidi")
    rec = await client.reconcile(unknown.call_key, True, by="heidi", result={"paid": True})
    assert rec.state == "succeeded" and rec.reconciled_by == "heidi"
    assert rec.reconciled_at is not None
    h2 = await client.send("tester", "rc", script())
    res = await client.wait(h2, timeout=30)
    [note] = body(res.text)["notes"]
    assert "reconciled by heidi" in note and "'paid': True" in note


# --- CompactContext --------------------------------------------------------------------

PAD = "padding " * 60  # makes one answer alone pass the compactor's 150-token budget


async def test_compaction_stores_one_summary(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Past the budget, the history before the turn is summarised once; the model gets the
    summary in its place; the durable history keeps every entry."""
    workers.start()
    h1 = await client.send("compactor", "cp", script(answer=PAD))
    await client.wait(h1, timeout=30)
    h2 = await client.send("compactor", "cp", script(answer="second"))
    res = await client.wait(h2, timeout=30)
    got = body(res.text)
    assert got["summaries"] == ["SUMMARY of 2 messages"]
    assert got["messages"] == 2  # the summary and the new user message
    assert sum((await vendor.payload_counts("summary_call")).values()) == 1
    snap = await client.snapshot("cp")
    assert snap is not None and snap.summary == "SUMMARY of 2 messages"
    roles = [e.role for e in snap.history]
    assert roles.count("user") == 2 and roles.count("summary") == 1
    # The usage ledger has the summary call beside the two turns' model steps.
    used = sorted(
        (x.turn_id == h2.turn_id, x.purpose, x.model_step) for x in await client.usage("cp")
    )
    assert used == [(False, "answer", 0), (True, "answer", 0), (True, "summary", 0)], used


async def test_compaction_failing_fails_the_turn_and_the_next_message_compacts_again(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Every attempt of the summary call fails: the turn fails, the next message compacts
    again."""
    workers.start()
    h1 = await client.send("compactor", "cf", script(answer="broken summary " + PAD))
    await client.wait(h1, timeout=30)
    h2 = await client.send("compactor", "cf", script())
    with pytest.raises(TurnFailed, match="context compaction failed after 3 attempts"):
        await client.wait(h2, timeout=60)
    assert sum((await vendor.payload_counts("summary_call")).values()) == 3
    h3 = await client.send("compactor", "cf", script())
    with pytest.raises(TurnFailed, match="context compaction failed"):
        await client.wait(h3, timeout=60)
    assert sum((await vendor.payload_counts("summary_call")).values()) == 6


# --- crash cells of the waits ----------------------------------------------------------


async def test_timer_due_while_server_down_fires_when_back(
    client: Client, workers: WorkerFactory, nats_ready: object
) -> None:
    """A timer that comes due while nats-server is down fires once it is back: its recorded
    due time lies inside the outage, and it fired after the server was back, not before."""
    import asyncio
    import time

    from jetloop.services.embedded import EmbeddedServer

    server = nats_ready
    assert isinstance(server, EmbeddedServer)
    workers.start()
    h = await client.send("tester", "td", script([call("wait", seconds=2)]))
    await snapshot_when(client, "td", lambda s: s.timers)
    rec = await client.call("td", h.turn_id, 0, 0)
    assert rec is not None and rec.timer_due is not None
    due = rec.timer_due
    server.kill()
    t_down = time.time()
    # The outage itself: it lasts until the timer is half a second past due.
    await asyncio.sleep(max(0.0, due + 0.5 - time.time()))
    t_up = time.time()
    server.start()
    res = await client.wait(h, timeout=60)
    assert t_down < due < t_up, "the timer came due during the outage"
    [fired] = [e async for e in _events_to_end(client, "td") if e.type == "timer.fired"]
    assert fired.data["due"] == due
    assert due + fired.data["late_seconds"] >= t_up, "it fired once the server was back"
    assert body(res.text)["seen"][0]["result"] == {"waited_seconds": 2}


async def _events_to_end(client: Client, session: str) -> AsyncIterator[Any]:
    async for ev in client.events(session):
        yield ev
        if ev.type in ("turn.completed", "turn.failed"):
            return


async def test_a_retry_is_given_the_checkpointed_arguments(
    client: Client, workers: WorkerFactory
) -> None:
    """A tool that changes its arguments in place and fails: the next attempt is given the
    arguments as the model asked for them (records are remembered decoded by the worker;
    a tool gets a copy of its own)."""
    workers.start()
    h = await client.send("tester", "meddle", script([call("meddler", data={"x": [1]})]))
    res = await client.wait(h, timeout=60)
    (seen,) = body(res.text)["seen"]
    assert seen["status"] == "ok"
    assert seen["result"] == {"given": {"x": [1]}}
