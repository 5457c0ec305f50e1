"""The CLI for people: chat with approvals and answers, inspect, snapshot, events, send;
and what a newcomer sees when NATS is not there. Real servers, the CLI as a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from jetloop.demo.vendor import Vendor
from jetloop.services.cli.main import PATIENCE
from jetloop.services.client import Client
from jetloop.services.embedded import EmbeddedServer, free_port
from jetloop.streams import topology
from jetloop.streams.connection import connect
from tests.conftest import WorkerFactory, call, script, until

# What a subprocess may take beyond the command's own bound: Python's start on a busy box.
SLACK = 5.0


def cli(
    url: str, *args: str, stdin: str = "", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jetloop.services.cli", *args, "--nats", url],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )


async def acli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(cli, url, *args)


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def unreachable(url: str) -> str:
    return f"Error: cannot reach NATS at {url} (is 'jetloop up' running?)"


async def test_chat_approves_answers_and_says_how_to_resume(
    nats_ready: EmbeddedServer, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A person types a message, approves the held call with y, answers the question,
    and Ctrl-D (end of input) prints how to resume."""
    workers.start()
    lines_in = [
        script([call("guarded", name="g")], answer="approved and done"),
        "y",
        script([call("ask_user", question="Which floor?")], answer="asked"),
        "third",
    ]
    out = await asyncio.to_thread(
        cli,
        nats_ready.url,
        "chat",
        "--agent",
        "tester",
        "--resume",
        "c1",
        stdin="\n".join(lines_in) + "\n",
    )
    assert out.returncode == 0, out.stderr
    assert "approve guarded" in out.stdout and "agent> approved and done" in out.stdout
    assert "Which floor? >" in out.stdout and '"answer": "third"' in out.stdout
    assert "jetloop chat --agent tester --resume c1" in out.stdout
    assert await vendor.effect_count("guarded") == 1


async def test_unreachable_nats_is_one_line_within_the_timeout() -> None:
    """With nothing on the port, `send --timeout 2` and `events` (no --timeout) each exit 1
    with one line naming the URL, within their bound, and no reconnect warnings."""
    url = f"nats://127.0.0.1:{free_port()}"

    async def timed(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
        t0 = time.monotonic()
        out = await asyncio.to_thread(cli, url, *args, timeout=30)
        return out, time.monotonic() - t0

    # The bounds are beyond the CLI's own start, measured beside them (a process started
    # while other tests run on the same cores may take seconds to import).
    (sent, t_sent), (followed, t_followed), (_, boot) = await asyncio.gather(
        timed("send", "--agent", "tester", "--session", "s", "--timeout", "2", "hi"),
        timed("events", "s"),
        timed("inspect", "--help"),
    )
    for out in (sent, followed):
        assert out.returncode == 1, out
        assert out.stdout == ""
        assert lines(out.stderr) == [unreachable(url)]
    assert t_sent < boot + 2 + SLACK, (t_sent, boot)
    assert t_followed < boot + PATIENCE + SLACK, (t_followed, boot)


async def test_a_server_gone_mid_command_ends_it_with_one_line(nats_ready: EmbeddedServer) -> None:
    """`events` following a session whose server is killed ends within a few seconds with
    one line, instead of warning every half second for ever."""
    url = nats_ready.url
    nc = await connect([url], "test")
    kv = await nc.jetstream().key_value(topology.STATE_BUCKET)
    await kv.put("session.gone", b"\x80")  # a state record is enough to exist
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "jetloop.services.cli", "events", "gone", "--nats", url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        try:

            async def following() -> bool:
                return bool(await nc.jetstream().consumers_info(topology.EVENTS_STREAM))

            await until(following, timeout=20)
        finally:
            await nc.close()
        nats_ready.kill()
        t0 = time.monotonic()
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 1
    assert lines(err.decode()) == [
        f"Error: lost the connection to NATS at {url} (is 'jetloop up' running?)"
    ]
    assert elapsed < PATIENCE + SLACK


async def test_a_repeated_request_id_says_duplicate_even_after_a_restart(
    nats_ready: EmbeddedServer, workers: WorkerFactory
) -> None:
    """The second send of a request id says "duplicate" (the PubAck does), and so does a
    third after a server restart, when the work-queue stream has forgotten the id and
    only the turn record remembers it; the turn ran once."""
    workers.start()
    url = nats_ready.url
    send = ("send", "--agent", "tester", "--session", "dup", "--request-id", "r-1", script())
    first = await acli(url, *send)
    assert first.returncode == 0, first.stderr
    assert "duplicate" not in first.stdout
    second = await acli(url, *send)
    assert second.returncode == 0, second.stderr
    assert "duplicate" in lines(second.stdout)[0]
    await asyncio.to_thread(nats_ready.stop)  # graceful: the deletion of the request is kept
    await asyncio.to_thread(nats_ready.start)
    await nats_ready.wait_jetstream()
    third = await acli(url, *send)
    assert third.returncode == 0, third.stderr
    assert "duplicate request (the turn is completed)" in lines(third.stdout)[0]
    snap = await acli(url, "snapshot", "dup", "--json")
    assert json.loads(snap.stdout)["turns_done"] == 1


async def test_events_and_inspect_say_what_is_missing_in_one_line(
    nats_ready: EmbeddedServer, workers: WorkerFactory
) -> None:
    """`events` of an unknown session and `inspect` of a missing key, stream or message
    exit 1 with one line; what exists is shown (events, keys, history, messages with
    headers, dead letters with their reason, every consumer), as text and as JSON."""
    workers.start()
    url = nats_ready.url
    sent = await acli(url, "send", "--agent", "tester", "--session", "ij", script())
    assert sent.returncode == 0, sent.stderr
    nc = await connect([url], "test")
    try:
        js = nc.jetstream()
        await js.publish(
            "jl.dead.jl.step.x",
            b"\x81\xa1a\x01",
            headers={"Jl-Dead-Reason": "a bad step", "Jl-Dead-Subject": "jl.step.x"},
        )
        durables = {
            (s.config.name, c.name)
            for s in await js.streams_info()
            for c in await js.consumers_info(s.config.name or "")
            if c.config.durable_name
        }
        events_last = (await js.stream_info(topology.EVENTS_STREAM)).state.last_seq
    finally:
        await nc.close()

    missing = await asyncio.gather(
        acli(url, "events", "nosuch", "--no-follow"),
        acli(url, "inspect", "--kv", "session.nope"),
        acli(url, "inspect", "--history", "session.nope"),
        acli(url, "inspect", "--stream", "JL_EVENTS", "--seq", "999999"),
        acli(url, "inspect", "--stream", "NOPE"),
    )
    wanted = [
        "Error: no session nosuch",
        "Error: no key session.nope in jl_state (list them: jetloop inspect --keys)",
        "Error: no key session.nope in jl_state (list them: jetloop inspect --keys)",
        "Error: no message 999999 in JL_EVENTS (it holds ",
        "Error: no stream NOPE (list them: jetloop inspect)",
    ]
    for out, line in zip(missing, wanted, strict=True):
        assert out.returncode == 1 and len(lines(out.stderr)) == 1, out
        assert out.stderr.startswith(line), out

    events, report, keys, history, stream, stream_text, dead, snap = await asyncio.gather(
        acli(url, "events", "ij", "--no-follow"),
        acli(url, "inspect", "--json"),
        acli(url, "inspect", "--keys", "session.", "--json"),
        acli(url, "inspect", "--history", "session.ij", "--json"),
        acli(url, "inspect", "--stream", "JL_EVENTS", "--last", "3", "--json"),
        acli(url, "inspect", "--stream", "JL_EVENTS", "--last", "2"),
        acli(url, "inspect", "--dead"),
        acli(url, "snapshot", "ij", "--json"),
    )
    assert events.returncode == 0 and "· completed" in events.stdout
    got = json.loads(report.stdout)
    assert {s["name"] for s in got["streams"]} >= {"JL_TURNS", "JL_STEPS", "JL_EVENTS", "JL_DEAD"}
    assert {(c["stream"], c["name"]) for c in got["consumers"] if c["durable"]} == durables
    assert {"JL_TURNS", "JL_STEPS"} <= {s for s, _ in durables}
    assert all({"pending", "ack_pending", "redelivered"} <= c.keys() for c in got["consumers"])
    assert json.loads(keys.stdout)["keys"] == ["session.ij"]
    revisions = json.loads(history.stdout)["revisions"]
    assert len(revisions) >= 2
    assert all(r["value"]["session_id"] == "ij" for r in revisions)
    msgs = json.loads(stream.stdout)["messages"]
    seqs = [m["seq"] for m in msgs]
    assert len(seqs) == 3 and seqs == list(range(seqs[0], seqs[0] + 3)) and seqs[-1] >= events_last
    assert all(m["headers"]["Jl-Session"] == "ij" for m in msgs)
    assert len(re.findall(r"^#\d+ ", stream_text.stdout, re.M)) == 2
    assert "Jl-Kind: " in stream_text.stdout
    assert "reason: a bad step" in dead.stdout and "jl.step.x" in dead.stdout
    assert json.loads(snap.stdout)["session_id"] == "ij"


async def test_an_approval_decided_from_the_cli_is_counted_by_the_worker(
    nats_ready: EmbeddedServer, workers: WorkerFactory, client: Client
) -> None:
    """The CLI process that approves is gone before anything scrapes it: the worker that
    resumes the held call counts the decision."""
    port = free_port()
    workers.start(env={"JETLOOP_METRICS_PORT": str(port)})
    h = await client.send("tester", "m1", script([call("guarded", name="g")]))

    async def held() -> str | None:
        snap = await client.snapshot("m1")
        return snap.approvals[0].approval_id if snap and snap.approvals else None

    aid = await until(held)
    approved = await acli(nats_ready.url, "approve", "m1", aid, "--by", "alice")
    assert approved.returncode == 0, approved.stderr
    await client.wait(h, timeout=30)

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    text = await asyncio.to_thread(scrape)
    assert "jetloop_approvals_requested_total 1.0" in text
    assert "jetloop_approvals_decided_total 1.0" in text


async def test_sessions_lists_from_the_read_model(
    nats_ready: EmbeddedServer, workers: WorkerFactory, tmp_path: Path
) -> None:
    """`jetloop sessions` finds a session the projector has written to the read model."""
    from jetloop.services.readmodel.projector import Projector

    workers.start()
    db = tmp_path / "rm.sqlite"
    sent = await acli(nats_ready.url, "send", "--agent", "tester", "--session", "findme", script())
    assert sent.returncode == 0, sent.stderr
    async with Projector([nats_ready.url], db, burst=True) as projector:
        await projector.run()
    out = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "jetloop.services.cli",
            "sessions",
            "--db",
            str(db),
            "--q",
            "findme",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = json.loads(out.stdout)
    assert found["total"] == 1 and found["sessions"][0]["session_id"] == "findme"


def test_a_model_step_without_text_reads_cleanly() -> None:
    """A model step that only calls tools prints ``model step 0: → tool(…)``, one space
    before the arrow; one with text prints the text before it."""
    from jetloop.schemas import Event
    from jetloop.schemas.events import AnsweredCall, ModelAnsweredData
    from jetloop.services.cli.main import _describe

    call = AnsweredCall(call_id="c0", tool="refund", args={"order": "42"}, effect="write")
    for text, line in (
        (None, '· model step 0: → refund({"order": "42"})'),
        ("Refunding.", '· model step 0: Refunding. → refund({"order": "42"})'),
    ):
        data = ModelAnsweredData(model_step=0, text=text, calls=[call])
        assert _describe(Event.of(data, key="k", session_id="s", turn_id="t")) == line


async def test_events_show_the_users_words_and_the_answer(
    nats_ready: EmbeddedServer, client: Client, workers: WorkerFactory
) -> None:
    """`jetloop events` says what the user sent (on the turn's accepted line, from its
    record) and the answer (on its completed line): before, neither was there."""
    workers.start()
    sent = script([call("write", name="w")], answer="all written, line one\nline two")
    h = await client.send("tester", "ev-words", sent)
    await client.wait(h, timeout=60)
    out = await acli(nats_ready.url, "events", "ev-words", "--no-follow")
    assert out.returncode == 0, out.stderr
    accepted = [ln for ln in out.stdout.splitlines() if ln.startswith("· accepted")]
    assert accepted == [f"· accepted: {json.dumps(sent)}"], out.stdout
    assert "· completed: all written, line one\n  line two" in out.stdout, out.stdout
