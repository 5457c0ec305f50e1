"""The folded log (``jetloop.schemas.log``): where a fact is both an event and a history
entry, one message (the entry, carrying the event) instead of two — read back the same.

One server: the same turn (two read-only calls) runs first with the log separate (a worker
started with ``JETLOOP_EVENT_LOG=separate``: a new deployment's log is folded), then on a
deployment switched to folded (a worker started with ``JETLOOP_EVENT_LOG=folded`` sets it in
``JL_EVENTS``'s metadata). Every reader jetloop ships — ``Client.events``, ``Client.wait``,
the read model and the gateway's event stream — tells both runs alike, and the folded log
holds 7 fewer messages for this turn (13 → 6) (no ``turn.accepted``, ``turn.started``,
``model.answered``, ``turn.completed`` or ``call.outcome`` on their own subjects, and the
step's two results, both reads, in one entry).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from nats.js import api

from jetloop.consumers.conversation import in_call_order
from jetloop.consumers.join import in_one_entry
from jetloop.schemas import (
    CallOutcome,
    CallRecord,
    CallState,
    HistoryEntry,
    HistoryRole,
    StepKind,
    TurnRecord,
    decode,
    encode,
    turn_id_for,
)
from jetloop.schemas.log import H_EVENTS, LogLayout, events_in
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.gateway.sse import follow
from jetloop.services.readmodel.model import Incoming, ReadModel
from jetloop.streams import topology
from jetloop.streams.history import HistoryReader
from jetloop.streams.topology import WORKERS_BUCKET
from tests.conftest import WorkerFactory, call, script

TEXT = script([call("read", name="a"), call("read", name="b")], answer="both read")


async def stored(c: Client, sid: str, what: str = ">") -> list[Any]:
    """Every message of the session's log (on ``jl.event.<sid>.<what>``), in order."""
    subject = topology.event_subject(sid, what)
    cfg = api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.NONE,
        filter_subject=subject,
        mem_storage=True,
        num_replicas=1,
    )
    sub = await c.js.pull_subscribe(subject, stream=topology.EVENTS_STREAM, config=cfg)
    out: list[Any] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(100, timeout=1.0)
            except TimeoutError:
                return out
            out += msgs
            if msgs[-1].metadata.num_pending == 0:
                return out
    finally:
        await sub.unsubscribe()


def same(key: str, sid: str) -> str:
    """``key`` with its session and turn named alike for both runs."""
    return key.replace(turn_id_for(sid, f"r-{sid}"), "T").replace(sid, "S")


def ordered(items: list[Any]) -> list[Any]:
    """``items`` with each run of call results or outcomes sorted (calls end in any order)."""
    out: list[Any] = []
    run: list[Any] = []
    for item in [*items, None]:
        if item is not None and item[0] in ("call.outcome", "tool"):
            run.append(item)
            continue
        out += sorted(run, key=repr)
        run = []
        if item is not None:
            out.append(item)
    return out


async def run(c: Client, sid: str) -> float:
    began = time.monotonic()
    h = await c.send("tester", sid, TEXT, f"r-{sid}")
    res = await c.wait(h, timeout=30)
    assert res.text is not None and res.text.startswith("both read")
    return time.monotonic() - began


async def sse_events(c: Client, sid: str) -> list[tuple[str, str]]:
    stopping = asyncio.Event()
    got: list[tuple[str, str]] = []
    async for item in follow(c.js, sid, 0, stopping, idle=0.2):
        if item is None:
            break
        _, ev = item
        got.append((ev.type.value, same(ev.key, sid)))
    return got


async def test_the_folded_log_reads_as_the_separate_one(
    nats_ready: EmbeddedServer, workers: WorkerFactory
) -> None:
    c = await Client.connect(nats_ready.url)
    try:
        separate = workers.start("separate", env={"JETLOOP_EVENT_LOG": "separate"})
        await run(c, "fl1")
        separate.kill()
    finally:
        await c.close()

    folded = workers.start("folded", env={"JETLOOP_EVENT_LOG": "folded"})
    await folded.wait_for("worker.started")
    await folded.wait_for("worker.results_entry", now=True, timeout=30)
    c = await Client.connect(nats_ready.url)  # (a new client reads the layout anew)
    try:
        assert await topology.log_layout(c.js) == "folded"
        took = await run(c, "fl2")
        # Heard, not found by the wait's read every 5 s: the end rides in the last answer.
        assert took < 4.0, f"the wait took {took:.1f} s"

        logs = {sid: await stored(c, sid) for sid in ("fl1", "fl2")}
        subjects = {sid: [m.subject.split(".", 3)[3] for m in msgs] for sid, msgs in logs.items()}
        folded_away = {
            "turn.accepted",
            "turn.started",
            "model.answered",
            "turn.completed",
            "call.outcome",
        }
        assert folded_away <= set(subjects["fl1"])
        assert not folded_away & set(subjects["fl2"])
        # Folded into the user's words (accepted, started), the answers (answered,
        # completed) and the results (2 outcomes, both reads, told in one entry): 7 of the
        # separate log's 13 messages.
        assert (len(subjects["fl1"]), len(subjects["fl2"])) == (13, 6), subjects
        assert subjects["fl2"].count("history.tool") == 1
        carried = {
            m.subject.split(".", 3)[3]: (m.headers or {}).get(H_EVENTS)
            for m in logs["fl2"]
            if ".history." in m.subject and m.subject.endswith((".user", ".tool"))
        }
        assert carried == {
            "history.user": "turn.accepted turn.started",
            "history.tool": "call.outcome",
        }
        # The results entry: both results as its parts, in call order, both outcomes in it.
        (results,) = [
            decode(HistoryEntry, m.data) for m in logs["fl2"] if m.subject.endswith(".tool")
        ]
        assert results.parts is not None
        assert [same(p.key, "fl2") for p in results.parts] == [
            "S.T.m0.c0.result",
            "S.T.m0.c1.result",
        ]
        assert [p.result["name"] for p in results.parts] == ["a", "b"]
        assert [e.type.value for e in results.events] == ["call.outcome"] * 2

        # Every reader tells the same events, in the same order, and the same conversation.
        told = {
            sid: [(e.type.value, same(e.key, sid)) async for e in c.events(sid, follow=False)]
            for sid in ("fl1", "fl2")
        }
        # (The two calls end in either order: their outcomes are compared as a set.)
        assert ordered(told["fl1"]) == ordered(told["fl2"])
        assert [t for t, _ in told["fl2"]].count("call.outcome") == 2
        outcomes = [e async for e in c.events("fl2", ["call.outcome"], follow=False)]
        assert [e.data["state"] for e in outcomes] == ["succeeded", "succeeded"]
        ends = [e.type.value async for e in c.events("fl2", ["turn.>"], follow=False)]
        assert ends == ["turn.accepted", "turn.started", "turn.completed"]
        assert await sse_events(c, "fl2") == told["fl2"]

        reader = HistoryReader(c.nc)
        talk = {}
        for sid in ("fl1", "fl2"):
            talk[sid] = [
                (e.role.value, same(e.key, sid), e.text, e.status, e.result)
                for e in await reader.read(sid)
            ]
        assert ordered(talk["fl1"]) == ordered(talk["fl2"])
        entry = decode(HistoryEntry, logs["fl2"][0].data)
        assert [e.type.value for e in entry.events] == ["turn.accepted", "turn.started"]

        # The read model: the same turns, calls and audit.
        async with await ReadModel.open(nats_ready.store_dir.parent / "rm.sqlite") as model:
            await model.prepare()
            for sid in ("fl1", "fl2"):
                await model.apply(
                    [Incoming(m.metadata.sequence.stream, m.subject, m.data) for m in logs[sid]]
                )
            rows = {}
            for sid in ("fl1", "fl2"):
                tid = turn_id_for(sid, f"r-{sid}")
                turn = await model.turn_row(sid, tid)
                assert turn is not None
                calls = await model.turn_calls(sid, tid, 100)
                audit = await model.turn_events(sid, tid, 0, 100)
                rows[sid] = (
                    (turn["status"], turn["user_text"] == TEXT),
                    [(k["state"], k["tool"]) for k in calls],
                    [(a["type"], same(a["key"], sid)) for a in audit],
                )
            assert rows["fl1"][:2] == rows["fl2"][:2]
            assert ordered(rows["fl1"][2]) == ordered(rows["fl2"][2])
            assert rows["fl2"][0] == ("completed", True)
            assert rows["fl2"][2] == told["fl2"]
    finally:
        await c.close()


def test_a_separate_message_reads_as_itself() -> None:
    """``events_in`` of an entry of the separate log is empty; of an event, the event."""
    entry = HistoryEntry(key="s.t.user", role=HistoryRole.USER, turn_id="t", text="hi")
    assert events_in("jl.event.s.history.user", encode(entry)) == []


async def test_a_worker_that_does_not_read_it_means_an_entry_per_result(
    nats_ready: EmbeddedServer, workers: WorkerFactory
) -> None:
    """While a live worker's presence does not list ``results_entry`` (a release before it,
    which reads a step's reads record but not an entry of several results), each result of
    the step's reads goes to the log in an entry of its own, which every release reads."""
    c = await Client.connect(nats_ready.url)
    kv = await c.js.key_value(WORKERS_BUCKET)
    older = {"agents": ["tester"], "pools": ["tool"], "since": time.time()}
    older |= {"kinds": sorted(StepKind), "records": ["step_reads"]}
    await kv.put("worker.older-release", json.dumps(older).encode())
    try:
        w = workers.start()
        await w.wait_for("worker.step_reads", now=True, timeout=30)
        h = await c.send("tester", "fl4", TEXT, "r-fl4")
        await c.wait(h, timeout=30)
        entries = [
            decode(HistoryEntry, m.data)
            for m in await stored(c, "fl4")
            if m.subject.endswith(".history.tool")
        ]
        assert sorted(same(e.key, "fl4") for e in entries) == [
            "S.T.m0.c0.result",
            "S.T.m0.c1.result",
        ]
        assert all(e.parts is None for e in entries)
        assert not w.find("worker.results_entry", now=True)
    finally:
        await kv.delete("worker.older-release")
        await c.close()


async def test_an_entry_of_results_is_read_as_its_parts_each_key_once(
    nats_ready: EmbeddedServer,
) -> None:
    """A results entry reads as its parts, in place; an entry of a key read before (a
    result told on its own, then with the others after a crash, or the other way round) is
    kept once, where it was first read."""
    c = await Client.connect(nats_ready.url)
    try:

        def result(i: int) -> HistoryEntry:
            return HistoryEntry(
                key=f"rp.t.m0.c{i}.result", role=HistoryRole.TOOL, turn_id="t", result=i
            )

        told = [
            HistoryEntry(key="rp.t.user", role=HistoryRole.USER, turn_id="t", text="hi"),
            result(1),
            HistoryEntry(
                key="rp.t.m0.results",
                role=HistoryRole.TOOL,
                turn_id="t",
                parts=[result(0), result(1), result(2)],
            ),
            result(2),
            HistoryEntry(
                key="rp.t.m0.results",  # the same entry again, past the dedupe window
                role=HistoryRole.TOOL,
                turn_id="t",
                parts=[result(0), result(1), result(2)],
            ),
        ]
        for n, entry in enumerate(told):
            subject = topology.history_subject("rp", entry.role.value)
            await c.js.publish(subject, encode(entry), headers={"Nats-Msg-Id": f"rp-{n}"})
        got = await HistoryReader(c.nc).read("rp")
        assert [(e.key, e.result) for e in got] == [
            ("rp.t.user", None),
            ("rp.t.m0.c1.result", 1),
            ("rp.t.m0.c0.result", 0),
            ("rp.t.m0.c2.result", 2),
        ]
        assert [e.key for e in await HistoryReader(c.nc, direct=False).read("rp")] == [
            e.key for e in got
        ]
    finally:
        await c.close()


def test_a_steps_reads_are_told_in_one_entry_only_well_inside_the_limit() -> None:
    """Two kept reads make one entry (their results as parts, both outcomes carried, one
    event type in the header); a single read, or an entry over half the server's limit on
    a message, is told one entry per read instead."""
    turn = TurnRecord(session_id="s", turn_id="t", agent="a", request_id="r", text="hi")
    reads = [
        CallRecord(
            key=f"s.t.0.{i}",
            tool="read",
            effect="read",
            state=CallState.SUCCEEDED,
            attempts=1,
            outcome=CallOutcome(state=CallState.SUCCEEDED, result={"value": "x" * 3000}),
        )
        for i in range(2)
    ]
    together = in_one_entry(turn, reads, 1024 * 1024)
    assert together is not None
    (out,) = together.records
    entry = decode(HistoryEntry, out.body)
    assert out.headers["Nats-Msg-Id"] == entry.key == "s.t.m0.results"
    assert out.headers[H_EVENTS] == "call.outcome"
    assert [p.key for p in entry.each()] == ["s.t.m0.c0.result", "s.t.m0.c1.result"]
    assert [e.data["call_key"] for e in entry.events] == ["s.t.0.0", "s.t.0.1"]
    assert in_one_entry(turn, reads[:1], 1024 * 1024) is None
    assert in_one_entry(turn, reads, 2 * len(out.body) - 2) is None


def test_the_model_is_given_a_steps_results_in_call_order() -> None:
    """The folded log stores a step's results as the calls end; the conversation gives them in
    the order of the calls, as the separate log stores them (other entries stay in place)."""
    keys = ["s.t.user", "s.t.m0.assistant", "s.t.m0.c2.result", "s.t.m0.c0.result"]
    keys += ["s.t.m0.c1.result", "s.t.m1.assistant", "s.t.m1.c0.result"]
    got = [k for k, _ in in_call_order([(k, None) for k in keys])]
    assert got == [
        "s.t.user",
        "s.t.m0.assistant",
        "s.t.m0.c0.result",
        "s.t.m0.c1.result",
        "s.t.m0.c2.result",
        "s.t.m1.assistant",
        "s.t.m1.c0.result",
    ]


async def test_a_new_deployment_is_folded_and_an_old_one_keeps_its_layout(
    server: EmbeddedServer,
) -> None:
    """A ``JL_EVENTS`` the topology makes says ``folded``; one made before layouts (no key in
    its metadata, as 0.1.0 made it) is kept ``separate`` by every later apply that does not
    set a layout, and an apply that sets one switches it."""
    await server.wait_jetstream()
    c = await Client.connect(server.url)
    try:
        await topology.apply(c.js, topology.TopologyConfig())
        assert await topology.log_layout(c.js) == "folded"
        # As 0.1.0 left it: the stream without the layout's key.
        info = await c.js.stream_info(topology.EVENTS_STREAM)
        cfg = info.config
        cfg.metadata = {
            k: v for k, v in (cfg.metadata or {}).items() if k != topology.LOG_LAYOUT_KEY
        }
        await c.js.update_stream(cfg)
        assert await topology.log_layout(c.js) == "separate"
        await topology.apply(c.js, topology.TopologyConfig())
        info = await c.js.stream_info(topology.EVENTS_STREAM)
        assert (info.config.metadata or {}).get(topology.LOG_LAYOUT_KEY) == "separate"
        await topology.apply(c.js, topology.TopologyConfig(event_log=LogLayout.FOLDED))
        assert await topology.log_layout(c.js) == "folded"
    finally:
        await c.close()
