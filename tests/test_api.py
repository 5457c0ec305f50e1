"""The Python API a program is written against (issue 16, items 5-8): a tool and a model
know their identity, past turns and their calls can be listed (client, CLI, gateway), the
event follower can stop, and the client prints nothing, raises only public errors and reads
unverified state only when told to. Real nats-server, real workers."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

import jetloop
from jetloop.demo.vendor import Vendor
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.gateway.app import make_app
from jetloop.services.settings import load_settings
from tests.conftest import WorkerFactory, body, call, script, until
from tests.test_cli import acli
from tests.test_gateway import READ, make_config, ok, problem

ROOT = Path(__file__).resolve().parent.parent


async def test_a_tool_and_a_model_know_their_identity(
    client: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A tool's context names its session, turn, model step and call (``call_id`` is
    ``<turn>-<model step>-<index>``); a model request names its session, turn and step."""
    workers.start()
    text = json.dumps(
        {"steps": [[call("read", name="x"), call("whoami", name="me")]], "identify": True}
    )
    h = await client.send("tester", "who", text)
    res = await client.wait(h, timeout=30)
    seen = body(res.text)["seen"]
    me = next(s["result"] for s in seen if s["tool"] == "whoami")
    assert me == {
        "session_id": "who",
        "turn_id": h.turn_id,
        "model_step": 0,
        "call_id": f"{h.turn_id}-0-1",
        "attempt": 1,
    }
    asked = [json.loads(p) for p in await vendor.payload_counts("model_identity")]
    assert sorted((a["model_step"], a["session_id"], a["turn_id"]) for a in asked) == [
        (0, "who", h.turn_id),
        (1, "who", h.turn_id),
    ]


async def test_past_turns_and_their_calls_are_listed(
    client: Client, workers: WorkerFactory, nats_ready: EmbeddedServer, tmp_path: Path
) -> None:
    """A session's turns, newest first and bounded by a limit, and one turn's calls with
    their outcomes: from the client, the CLI and the gateway; an unknown session or turn is
    ``UnknownSession`` / ``UnknownTurn``, a 404 problem, an error line."""
    workers.start()
    first = await client.send("tester", "hist", script([call("write", name="a")]), "r-1")
    await client.wait(first, timeout=30)
    second = await client.send(
        "tester", "hist", script([call("read", name="b"), call("refuse", name="c")]), "r-2"
    )
    await client.wait(second, timeout=30)

    page = await client.turns("hist")
    assert page.total == 2 and page.untrusted == []
    assert [(t.turn_id, t.request_id, t.status) for t in page.turns] == [
        (second.turn_id, "r-2", jetloop.TurnStatus.COMPLETED),
        (first.turn_id, "r-1", jetloop.TurnStatus.COMPLETED),
    ]
    assert [t.tool_calls_made for t in page.turns] == [2, 1]
    older = await client.turns("hist", limit=1, offset=1)
    assert (older.total, [t.turn_id for t in older.turns]) == (2, [first.turn_id])

    detail = await client.turn_calls("hist", second.turn_id)
    assert detail.turn.turn_id == second.turn_id and detail.calls_more == 0
    assert [(c.call_id, c.tool, c.state) for c in detail.calls] == [
        (f"{second.turn_id}-0-0", "read", "succeeded"),
        (f"{second.turn_id}-0-1", "refuse", "failed"),
    ]
    assert detail.calls[0].result == {"name": "b", "value": 1}
    assert detail.calls[1].error == "no such thing as c"
    bounded = await client.turn_calls("hist", second.turn_id, limit=1)
    assert (len(bounded.calls), bounded.calls_more) == (1, 1)

    with pytest.raises(jetloop.UnknownSession):
        await client.turns("nobody")
    with pytest.raises(jetloop.UnknownTurn):
        await client.turn_calls("hist", "t00000000000000000000")
    with pytest.raises(ValueError, match="limit"):
        await client.turns("hist", limit=0)

    out = await acli(nats_ready.url, "turns", "hist", "--limit", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "session hist: 2 turn(s), showing 1-1", out.stdout
    assert f"{second.turn_id} request=r-2 completed model step 1, 2 call(s)" in out.stdout
    out = await acli(nats_ready.url, "turn", "hist", first.turn_id, "--json")
    assert out.returncode == 0, out.stderr
    assert [c["tool"] for c in json.loads(out.stdout)["calls"]] == ["write"]
    out = await acli(nats_ready.url, "turns", "nobody")
    assert (out.returncode, out.stderr.strip()) == (1, "Error: no such session: nobody")

    config = make_config(tmp_path)
    async with TestClient(TestServer(make_app(config, nats_ready.url))) as api:
        got = await ok(await api.get("/v1/sessions/hist/turns?limit=1", headers=READ))
        assert (got["total"], got["turns"][0]["turn_id"]) == (2, second.turn_id)
        got = await ok(await api.get(f"/v1/sessions/hist/turns/{first.turn_id}", headers=READ))
        assert [(c["tool"], c["state"]) for c in got["calls"]] == [("write", "succeeded")]
        assert got["turn"]["request_id"] == "r-1"
        p = await problem(await api.get("/v1/sessions/nobody/turns", headers=READ), 404)
        assert (p["title"], p["detail"]) == ("no such session", "nobody")
        p = await problem(
            await api.get("/v1/sessions/hist/turns/t00000000000000000000", headers=READ), 404
        )
        assert p["title"] == "no such turn"
        await problem(await api.get("/v1/sessions/hist/turns?limit=0", headers=READ), 422)


async def test_events_stop_at_the_tail_or_at_a_turns_end(
    client: Client, workers: WorkerFactory
) -> None:
    """``follow=False`` ends once the stored events are read (at once when there are none);
    ``until_turn_ends`` ends after that turn's last event, even when ``types`` leaves the
    turn's own events out."""
    assert [e async for e in client.events("empty", follow=False)] == []
    workers.start()
    h = await client.send("tester", "ev", script([call("read", name="a")]))
    outcomes = [
        (e.type, e.data["tool"])
        async for e in client.events("ev", types=["call.outcome"], until_turn_ends=h.turn_id)
    ]
    assert outcomes == [(jetloop.EventType.CALL_OUTCOME, "read")]
    stored = [e.type async for e in client.events("ev", follow=False)]
    assert stored[0] == jetloop.EventType.TURN_ACCEPTED
    assert stored[-1] == jetloop.EventType.TURN_COMPLETED
    ended = [e.type async for e in client.events("ev", until_turn_ends=h.turn_id)]
    assert ended == stored


async def test_reading_state_needs_the_key_or_an_explicit_choice(
    client: Client, workers: WorkerFactory
) -> None:
    """Without a seal key a read is refused with an error naming JETLOOP_SEAL_KEY, unless
    ``verify=False`` chose to read unchecked (a snapshot is asked of the workers, who verify
    it); with the wrong key a record is ``RecordNotTrusted`` (a public error, not the
    engine's internal one)."""
    workers.start()
    h = await client.send("tester", "sk", script([call("read", name="a")]))
    await client.wait(h, timeout=30)

    keyless = Client(client.nc)
    with pytest.raises(jetloop.SealKeyMissing, match="JETLOOP_SEAL_KEY"):
        await keyless.turn("sk", h.turn_id)
    snap = await keyless.snapshot("sk")
    assert snap is not None and snap.turn is not None and snap.turn.turn_id == h.turn_id
    unchecked = Client(client.nc, verify=False)
    turn = await unchecked.turn("sk", h.turn_id)
    assert turn is not None and turn.status == jetloop.TurnStatus.COMPLETED
    assert (await unchecked.turns("sk")).total == 1

    wrong = Client(client.nc, sealer=load_settings(seal_key="ab" * 32).sealer())
    with pytest.raises(jetloop.RecordNotTrusted) as untrusted:
        await wrong.turn("sk", h.turn_id)
    assert isinstance(untrusted.value, jetloop.JetloopError)
    assert untrusted.value.key == f"turn.sk.{h.turn_id}"
    listed = await wrong.turns("sk")  # a listing shows it, and says it is not trusted
    assert [t.turn_id for t in listed.turns] == [h.turn_id] and len(listed.untrusted) == 1


PROGRAM = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    import jetloop

    async def main() -> None:
        async with await jetloop.Client.connect(sys.argv[1]) as c:
            Path(sys.argv[2]).write_text("connected")
            for _ in range(200):  # the test stops the server: disconnects, failed reconnects
                if not c.nc.is_connected:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)

    asyncio.run(main())
    """
)


async def test_the_client_prints_nothing_when_nats_goes_away(tmp_path: Path) -> None:
    """A program using the client sees no NATS warnings on its stdout or stderr when the
    server goes away: the client logs to the ``jetloop.*`` loggers, which print nothing
    unless the program configures logging."""
    srv = EmbeddedServer(tmp_path / "store", port=0, log_file=tmp_path / "nats.log")
    srv.start()
    try:
        await srv.wait_jetstream()
        ready = tmp_path / "ready"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            PROGRAM,
            srv.url,
            str(ready),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=tmp_path,
        )
        for _ in range(600):
            if ready.exists():
                break
            await asyncio.sleep(0.05)
        assert ready.exists()
    finally:
        srv.kill()
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, stderr.decode()
    assert (stdout.decode(), stderr.decode()) == ("", "")


async def test_a_client_closed_in_an_outage_stops_reconnecting_even_if_the_cancel_is_lost(
    tmp_path: Path,
) -> None:
    """``close()`` during an outage ends nats-py's reconnect loop, and the client never
    connects again. nats-py ends that loop by cancelling its task; on Python 3.11 the cancel
    is lost when it lands as a refused connection completes (``asyncio.wait_for``), and the
    loop then went on for ever (a program's ``asyncio.run`` hung at exit: seen in CI). Here
    the loop is made to miss the cancel for certain: ``close()`` is shown another task."""
    srv = EmbeddedServer(tmp_path / "store", port=0, log_file=tmp_path / "nats.log")
    srv.start()
    client = await Client.connect(srv.url)
    try:
        srv.kill()
        for _ in range(200):
            if client.nc.is_reconnecting:
                break
            await asyncio.sleep(0.02)
        reconnecting = client.nc._reconnection_task
        assert reconnecting is not None and not reconnecting.done()
        decoy = asyncio.ensure_future(asyncio.sleep(60))
        client.nc._reconnection_task = decoy  # close() cancels this one, not the loop
        await client.close()
        assert decoy.cancelled() or decoy.cancelling()
        # The loop's next attempt (after the reconnect wait) sees the client closed.
        await asyncio.wait_for(asyncio.shield(reconnecting), 5)
        srv.start()  # the server back on the same port: the closed client stays closed
        await asyncio.sleep(1.5)
        assert client.nc.is_closed and not client.nc.is_connected
    finally:
        srv.kill()


def test_a_client_closed_in_an_outage_with_publishes_queued_closes_quietly(tmp_path: Path) -> None:
    """``close()`` while the server is gone and publishes wait for the link (a worker's
    heartbeats, stopped by Ctrl-C in an outage) drops them and closes: on uvloop, the loop
    workers run on, nats-py wrote them to the dead socket and close() raised RuntimeError."""
    import uvloop

    async def outage_then_close() -> None:
        srv = EmbeddedServer(tmp_path / "store", port=0, log_file=tmp_path / "nats.log")
        srv.start()
        try:
            client = await Client.connect(srv.url)
            srv.kill()
            for _ in range(200):
                if client.nc.is_reconnecting:
                    break
                await asyncio.sleep(0.02)
            assert client.nc.is_reconnecting
            await client.nc.publish("jl.test.queued", b"x" * 100)
            assert client.nc._pending_data_size > 0  # waiting for a link
            await asyncio.wait_for(client.close(), 5)
            assert client.nc.is_closed
        finally:
            srv.kill()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(outage_then_close())


async def test_waiting_makes_no_consumer_and_shares_one_subscription(
    client: Client, workers: WorkerFactory
) -> None:
    """``Client.wait`` hears a turn end on a core subscription to its session's turn events,
    shared by every wait of the client on that session, and reads the turn's record: it
    makes no consumer (a gateway holding many waiting requests made one per request), a turn
    that ended before the wait is found at once, and nothing is left subscribed after."""
    workers.start()
    info = await client.js.stream_info("JL_EVENTS")
    consumers = [info.state.consumer_count]
    slow = script([call("slow", name="s", seconds=0.4)])
    handles = [await client.send("tester", "waits", slow, f"r-{i}") for i in range(3)]
    handles.append(await client.send("tester", "waits-too", slow, "r-0"))

    async def count() -> None:
        while True:
            consumers.append((await client.js.stream_info("JL_EVENTS")).state.consumer_count)
            await asyncio.sleep(0.05)

    counting = asyncio.create_task(count())
    waits = [asyncio.create_task(client.wait(h, timeout=60)) for h in handles]
    await asyncio.sleep(0.2)
    ends = client._turn_ends()
    assert sorted(ends._sessions) == ["waits", "waits-too"]  # one subscription per session
    results = await asyncio.gather(*waits)
    counting.cancel()
    assert [r.status for r in results] == ["completed"] * 4
    assert set(consumers) == {consumers[0]}, consumers  # no wait made a consumer
    assert ends._sessions == {} and ends._waits == {}
    # Ended before the wait began: found in the record, at once.
    again = await asyncio.wait_for(client.wait(handles[0], timeout=60), 5)
    assert again.turn_id == handles[0].turn_id and again.status == "completed"


async def test_a_wait_that_hears_nothing_still_ends(
    client: Client, workers: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A core message is not durable and a credential may not be allowed the subscription (a
    server configured by an older ``jetloop up``): a wait that hears no end still returns,
    by reading the turn's record again every ``RECHECK_SECONDS``."""
    from jetloop.services import client as client_module
    from jetloop.services.turnends import TurnEnds

    async def deaf(self: TurnEnds, msg: object) -> None:
        return None

    monkeypatch.setattr(TurnEnds, "_on", deaf)
    monkeypatch.setattr(client_module, "RECHECK_SECONDS", 0.3)
    workers.start()
    h = await client.send("tester", "deaf", script([call("slow", name="s", seconds=0.5)]))
    res = await client.wait(h, timeout=30)
    assert res.status == "completed"


async def test_a_wait_on_a_turn_just_sent_reads_its_record_once(
    client: Client, workers: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``send`` listens for the turn's end before it publishes, so the wait that follows
    hears every end of the turn and reads its record once, when the end is heard; a wait on
    a duplicate (sent before, maybe ended before anyone listened) reads it first."""
    workers.start()
    reads: list[str] = []
    read = client.turn

    async def counted(session_id: str, turn_id: str) -> object:
        reads.append(turn_id)
        return await read(session_id, turn_id)

    monkeypatch.setattr(client, "turn", counted)
    h = await client.send("tester", "once", script([call("read", name="r")]), "r-1")
    assert (await client.wait(h, timeout=30)).status == "completed"
    assert reads == [h.turn_id]
    again = await client.send("tester", "once", script([call("read", name="r")]), "r-1")
    assert again.duplicate
    assert (await asyncio.wait_for(client.wait(again, timeout=30), 5)).status == "completed"
    assert reads == [h.turn_id, h.turn_id]
    ends = client._turn_ends()
    assert ends._sessions == {} and ends._waits == {} and ends._early == {}


async def test_a_refused_subscription_makes_a_wait_read(
    client: Client, workers: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server refusing the subscription to turn ends (it says so only in an error to
    the connection) wakes a wait that listens first: it reads the record and returns, not
    after ``RECHECK_SECONDS``; a turn sent later is not listened for first."""
    from jetloop.services import client as client_module
    from jetloop.services.turnends import TurnEnds

    async def deaf(self: TurnEnds, msg: object) -> None:
        return None

    monkeypatch.setattr(TurnEnds, "_on", deaf)
    monkeypatch.setattr(client_module, "RECHECK_SECONDS", 60.0)
    w = workers.start()
    await w.wait_for("worker.started", timeout=30)
    h = await client.send("tester", "refused", script(answer="fine"))
    waiting = asyncio.create_task(client.wait(h, timeout=30))

    async def ended() -> bool:
        turn = await client.turn("refused", h.turn_id)
        return turn is not None and turn.status.terminal

    await until(ended)
    await asyncio.sleep(0.2)
    assert not waiting.done()  # it heard nothing, and reads only when woken
    client.nc.refused(
        'nats: Permissions Violation for Subscription to "jl.event.refused.turn.completed"'
    )
    assert (await asyncio.wait_for(waiting, 5)).status == "completed"
    await client.send("tester", "refused", script(answer="again"))
    assert client._turn_ends()._early == {}  # no longer listened for first: read first


async def test_a_send_that_will_not_wait_listens_for_nothing(
    client: Client, workers: WorkerFactory
) -> None:
    """``send(will_wait=False)`` (the gateway without ``wait``, a webhook, a follower of the
    log) holds no subscription for a wait that never comes; a wait on it reads first."""
    workers.start()
    h = await client.send("tester", "nowait", script(answer="fine"), will_wait=False)
    ends = client._turn_ends()
    assert ends._early == {} and ends._sessions == {}
    assert (await client.wait(h, timeout=30)).status == "completed"
