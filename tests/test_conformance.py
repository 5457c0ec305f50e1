"""A second language speaks the documented protocol: conformance/conformance.mjs (Node.js,
written from docs/protocol.md alone) against `jetloop up`, connected with the client credential
of a namespace other than the default one, made while `up` runs.

Skipped, saying why, when ``node`` or the script's packages (``npm ci`` in conformance/,
which ``.ci/run`` does when npm is there) are missing."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from jetloop.services.client import Client
from jetloop.services.embedded import free_port
from tests.conftest import until
from tests.test_up import start_up, stop, wait_ready

HERE = Path(__file__).resolve().parent.parent / "conformance"
NODE = shutil.which("node")


def _skip_reason() -> str | None:
    if NODE is None:
        return "node is not installed: the Node.js conformance client cannot run"
    if not (HERE / "node_modules" / "@nats-io" / "jetstream").is_dir():
        return "conformance/node_modules is missing: run `npm ci` in conformance/"
    return None


async def served(url: str) -> bool:
    """Whether a worker serves the demo agent in the credential's namespace yet."""
    try:
        async with await Client.connect(url, verify=False, give_up_after=2) as c:
            return any("demo" in w.agents for w in await (await c.registry()).workers())
    except Exception:
        return False


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
@pytest.mark.parametrize("event_log", ["separate", "folded"])
async def test_node_client_follows_the_protocol_doc(tmp_path: Path, event_log: str) -> None:
    """Publish, duplicate, follow events to the answer, approve over jl.control (a repeat
    returns the decision, a conflicting one is 409), a snapshot, a jl_state record, a blob,
    dead letters with their headers kept: every check of the script passes, with the session
    log in either layout (the script reads both, as the page says)."""
    assert NODE is not None
    port = free_port()
    proc = start_up(tmp_path, port, env={"JETLOOP_EVENT_LOG": event_log})
    log = tmp_path / "up.log"
    try:
        await asyncio.to_thread(wait_ready, proc, log)
        store = tmp_path / "store"
        made = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "jetloop.services.cli", "namespace", "create", "conf"],
            env={**os.environ, "JETLOOP_STORE_DIR": str(store)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr
        cred = json.loads((store / "namespaces" / "conf.json").read_text())
        url = f"nats://{cred['user']}:{quote(cred['password'], safe='')}@127.0.0.1:{port}"
        await until(lambda: served(url), timeout=30)
        env = {**os.environ, "JL_NATS_URL": url, "JL_AGENT": "demo", "JL_TIMEOUT_MS": "40000"}
        run = await asyncio.to_thread(
            subprocess.run,
            [NODE, "conformance.mjs"],
            cwd=HERE,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = [json.loads(ln) for ln in run.stdout.splitlines() if ln.startswith("{")]
        assert run.returncode == 0, (run.stdout, run.stderr[-3000:], log.read_text()[-3000:])
        assert lines[-1]["conformance"] == "passed"
        layouts = [ln["layout"] for ln in lines if "layout" in ln]
        assert layouts == [event_log], "the script read the log's layout as the stream says"
        checks = {ln["check"] for ln in lines if "check" in ln}
        assert {
            "duplicate",
            "answer",
            "approve",
            "same decision repeats",
            "conflicting decision is 409",
            "snapshot",
            "blob",
            "dead letters",
            "dead letter keeps headers",
        } <= checks
    finally:
        stop(proc, log)
