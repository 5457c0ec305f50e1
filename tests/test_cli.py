"""The CLI for people: chat with approvals and answers, inspect, snapshot, on a real server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from demo.vendor import Vendor
from services.embedded import EmbeddedServer
from tests.conftest import WorkerFactory, call, script


def cli(url: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args, "--nats", url],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )


async def test_chat_approves_answers_and_says_how_to_resume(
    nats_ready: EmbeddedServer, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A person types a message, approves the held call with y, answers the question,
    and Ctrl-D (end of input) prints how to resume."""
    workers.start()
    lines = [
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
        stdin="\n".join(lines) + "\n",
    )
    assert out.returncode == 0, out.stderr
    assert "approve guarded" in out.stdout and "agent> approved and done" in out.stdout
    assert "Which floor? >" in out.stdout and '"answer": "third"' in out.stdout
    assert "jetloop chat --agent tester --resume c1" in out.stdout
    assert await vendor.effect_count("guarded") == 1


async def test_inspect_and_snapshot_as_json(
    nats_ready: EmbeddedServer, workers: WorkerFactory
) -> None:
    """inspect lists streams and consumers; snapshot --json is machine-readable."""
    workers.start()
    sent = await asyncio.to_thread(
        cli, nats_ready.url, "send", "--agent", "tester", "--session", "ij", script()
    )
    assert sent.returncode == 0, sent.stderr
    out = await asyncio.to_thread(cli, nats_ready.url, "inspect", "--json")
    report = json.loads(out.stdout)
    assert {s["name"] for s in report["streams"]} >= {"JL_TURNS", "JL_STEPS", "JL_EVENTS"}
    assert {c["name"] for c in report["consumers"]} == {
        "jl_turns",
        "jl_session",
        "jl_model",
        "jl_tool",
    }
    snap = await asyncio.to_thread(cli, nats_ready.url, "snapshot", "ij", "--json")
    assert json.loads(snap.stdout)["session_id"] == "ij"


async def test_sessions_lists_from_the_read_model(
    nats_ready: EmbeddedServer, workers: WorkerFactory, tmp_path: object
) -> None:
    """`jetloop sessions` finds a session the projector has written to the read model."""
    from pathlib import Path

    from services.projector import Projector

    workers.start()
    db = Path(str(tmp_path)) / "rm.sqlite"
    sent = await asyncio.to_thread(
        cli, nats_ready.url, "send", "--agent", "tester", "--session", "findme", script()
    )
    assert sent.returncode == 0, sent.stderr
    async with Projector([nats_ready.url], db, burst=True) as projector:
        await projector.run()
    out = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "services.cli",
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
