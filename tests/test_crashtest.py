"""Crash-testing a user's own agent (issue 34): `jetloop trials --app`, `jetloop.testing`.

The README's agent passes as the README says (run through its own pytest example, as a user
runs it); the same agent with its non-idempotent tool declared an idempotent write fails,
naming the calls that ran twice; the demo app and an agent wrapped from pydantic-ai pass.
Each run starts its own nats-server and kills real worker processes (``--quick`` here: the
first boundary of each kind per tool; the whole list is what the command runs by default).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import jetloop as jl
from jetloop.services.natsauth import make_users
from jetloop.testing import Message, crash_test_async
from jetloop.tooling.crashtest.judge import format_report, judge
from jetloop.tooling.crashtest.ledger import Invocation
from tests.conftest import call, script
from tests.test_readme import blocks

pytestmark = pytest.mark.timeout(240)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def in_app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The README's shop app in a directory of its own, as a user keeps it (the workers load
    it from their working directory, as `jetloop worker` does)."""
    files, _ = blocks()
    for name in ("shop.py", "test_shop.py"):
        (tmp_path / name).write_text(files[name])
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


async def test_the_readme_agent_passes_its_own_pytest_example(in_app_dir: Path) -> None:
    """`pytest test_shop.py` beside the README's `shop.py`: the verdict is pass, nothing is
    lost, and the SMS tool (a non-idempotent write whose vendor does not dedupe) never runs
    twice."""
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_shop.py"],
        cwd=in_app_dir,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout, out.stdout


async def test_a_wrong_declaration_fails_with_the_calls_made_twice(in_app_dir: Path) -> None:
    """The same agent with `send_sms` declared an idempotent write: the kills inside it make
    it again with the same key, the SMS vendor sends each of those twice, and the report
    says so and fails; the honest `refund` repeats too, passing because its vendor dedupes."""
    wrong = (in_app_dir / "shop.py").read_text()
    marked = wrong.count("@jl.tool(effect=jl.Effect.NON_IDEMPOTENT_WRITE)")
    assert marked == 1
    wrong = wrong.replace(
        "@jl.tool(effect=jl.Effect.NON_IDEMPOTENT_WRITE)",
        "@jl.tool(effect=jl.Effect.IDEMPOTENT_WRITE)",
    )
    (in_app_dir / "shop_wrong.py").write_text(wrong)
    out = in_app_dir / "report.json"
    report = await crash_test_async(
        "shop_wrong:app",
        [Message(None, "refund order 42")],
        vendor_dedupes=["refund"],
        quick=True,
        seed=34,
        work_dir=in_app_dir / "run",
        json_out=out,
    )
    print(format_report(report))
    assert report.verdict == "fail"
    sms = report.tools["send_sms"]
    assert sms.effect == "idempotent_write" and sms.repeated_calls >= 1, sms
    assert all(len(r["keys"]) == 1 for r in sms.repeated), sms.repeated  # the same key
    assert any("send_sms" in f and "more than once" in f for f in report.failures)
    assert not any("refund" in f for f in report.failures), report.failures
    assert report.tools["refund"].repeated_calls >= 1 and report.tools["refund"].vendor_dedupes
    assert report.lost == [] and report.duplicated_answers == []
    # What the vendor saw: more SMS than the model asked for (each invocation that got past
    # the ledger's hold point sent one).
    sent = (in_app_dir / "outbox.jsonl").read_text().splitlines()
    assert sms.invocations >= len(sent) > sms.calls
    saved = json.loads(out.read_text())
    assert saved["verdict"] == "fail" and saved["lost"] == []
    assert set(saved["tools"]["send_sms"]) >= {
        "invocations",
        "calls",
        "repeated_calls",
        "outcome_unknown",
    }


async def test_a_read_that_writes_is_said(in_app_dir: Path) -> None:
    """The same agent with `send_sms` declared a read (it appends to its outbox): the kills
    inside it make it again, and the report says so for that tool, in the table and as a
    warning naming `--pure` (before: `verdict: pass`, `repeated 4`, no remark, while its file
    got duplicate lines). A read the user vouches for with `pure` is not warned of."""
    wrong = (
        (in_app_dir / "shop.py")
        .read_text()
        .replace(
            "@jl.tool(effect=jl.Effect.NON_IDEMPOTENT_WRITE)", "@jl.tool(effect=jl.Effect.READ)"
        )
    )
    (in_app_dir / "shop_read.py").write_text(wrong)
    report = await crash_test_async(
        "shop_read:app",
        [Message(None, "refund order 42")],
        vendor_dedupes=["refund"],
        quick=True,
        seed=54,
        work_dir=in_app_dir / "run",
    )
    text = format_report(report)
    print(text)
    sms = report.tools["send_sms"]
    assert sms.effect == "read" and sms.repeated_calls >= 1, sms
    (warned,) = [w for w in report.warnings if w.startswith("send_sms (read)")]
    assert "safe only if it changes nothing" in warned and "--pure send_sms" in warned
    assert f"WARN {warned}" in text
    assert "made again: safe only if it changes nothing" in text
    sent = (in_app_dir / "outbox.jsonl").read_text().splitlines()
    assert len(sent) > sms.calls, "the read that writes did write twice"


def test_a_read_vouched_pure_is_not_warned_of() -> None:
    """The judge with a read made twice: warned of, unless it is in ``pure``; a read made
    once is not warned of either way."""
    agent = jl.Agent(name="a", instructions="", model=jl.ScriptedModel([]), tools=[lookup, other])
    loaded = jl.App([agent])

    def made(tool: str, call: str, attempt: int) -> Invocation:
        return Invocation(tool, "read", "s", "t", call, f"k-{call}", attempt, 1, 0.0, 1.0, "ok")

    invocations = [
        made("lookup", "t-0-0", 1),
        made("lookup", "t-0-0", 2),
        made("other", "t-0-1", 1),
    ]
    common: dict[str, Any] = dict(
        app="x:app",
        loaded=loaded,
        mode="worker_kill",
        seed=1,
        quick=True,
        boundaries=[],
        clean=[],
        rounds=[],
        invocations=invocations,
        events=[],
        vendor_dedupes=set(),
        seconds=1.0,
        workers=1,
    )
    # An attempt whose call could not be sent (an MCP server unreachable) ran nothing: it is
    # no repeat, and no invocation (before: counted, failing a correct agent).
    refused = Invocation(
        "pay", "non_idempotent_write", "s", "t", "t-0-2", "k", 1, 1, 0.0, 1.0, "not sent: X"
    )
    sent = Invocation("pay", "non_idempotent_write", "s", "t", "t-0-2", "k", 2, 1, 0.0, 1.0, "ok")
    counted = judge(**{**common, "invocations": [*invocations, refused, sent]})
    assert counted.tools["pay"].invocations == 1 and counted.tools["pay"].not_sent == 1
    assert counted.tools["pay"].repeated_calls == 0 and counted.failures == []
    warned = judge(**common).warnings
    assert len(warned) == 1 and warned[0].startswith("lookup (read) was made again in 1 calls")
    vouched = judge(**common, pure={"lookup"})
    assert vouched.warnings == [] and vouched.tools["lookup"].pure
    assert "(it does not, you said)" in format_report(vouched)


class Order(BaseModel):
    order: str


@jl.tool(effect=jl.Effect.READ)
async def lookup(args: Order, ctx: jl.ToolContext) -> str:
    """Look up an order."""
    return args.order


@jl.tool(effect=jl.Effect.READ)
async def other(args: Order, ctx: jl.ToolContext) -> str:
    """Look up another."""
    return args.order


async def test_the_readme_mcp_agent_passes(
    in_app_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's `bank.py`: its tools come from the example MCP server, run by each worker
    over stdio. Killed at each boundary: pass; the server's own log (one line per invocation,
    with the `_meta` key) shows the single-attempt `transfer` never made twice for one call,
    and the idempotent `set_limit` made again only with the same key."""
    files, _ = blocks()
    (in_app_dir / "bank.py").write_text(files["bank.py"])
    # As in the README: the tour's `jetloop up` store is in the working directory, and the
    # settings read it, as a person's do. Its credentials are not those of the run's own
    # server, and must not be used there.
    make_users(in_app_dir / ".jetloop")
    monkeypatch.delenv("JETLOOP_STORE_DIR")
    (in_app_dir / "examples").symlink_to(EXAMPLES)
    report = await crash_test_async(
        "bank:app",
        [Message(None, "pay 500 from acct-1")],
        vendor_dedupes=["set_limit"],
        quick=True,
        seed=36,
        work_dir=in_app_dir / "run",
    )
    print(format_report(report))
    assert report.ok, report.failures
    assert report.tools["transfer"].outcome_unknown >= 1
    log = [json.loads(ln) for ln in (in_app_dir / "ledger-log.jsonl").read_text().splitlines()]
    by_key: dict[str, list[str]] = {}
    for line in log:
        by_key.setdefault(line["key"], []).append(line["tool"])
    transfers = [k for k, tools in by_key.items() if "transfer" in tools]
    assert transfers and all(by_key[k] == ["transfer"] for k in transfers)
    assert any(tools.count("set_limit") > 1 for tools in by_key.values()), "made again, same key"


async def test_the_demo_app_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled demo agent, its writes declared deduped (its vendor dedupes on the key),
    an approval on the way (approved by the test): pass, nothing lost, no write without an
    invocation."""
    monkeypatch.setenv("JETLOOP_VENDOR_DB", str(tmp_path / "vendor.sqlite"))
    report = await crash_test_async(
        "jetloop.demo.agent:app",
        [
            Message(None, "create ticket printer on fire"),
            Message(None, "comment on T-1: still burning"),
            Message(None, "close T-1"),
        ],
        vendor_dedupes=["create_ticket", "add_comment", "close_ticket"],
        quick=True,
        seed=35,
        work_dir=tmp_path / "run",
    )
    print(format_report(report))
    assert report.ok, report.failures
    assert sum(1 for r in report.rounds if not r.missed) >= 10
    assert report.tools["close_ticket"].invocations >= 1


async def test_a_pydantic_ai_agent_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pydantic-ai agent wrapped with `durable` (tests/apps_pydantic_ai.py: its model is
    pydantic-ai's FunctionModel, scripted by the message): a read and an idempotent write,
    killed at each boundary: pass."""
    monkeypatch.setenv("JETLOOP_VENDOR_DB", str(tmp_path / "vendor.sqlite"))
    text = script([call("lookup", name="a")], [call("write", name="b")])
    report = await crash_test_async(
        "tests.apps_pydantic_ai:app",
        [Message("pai", text)],
        vendor_dedupes=["write"],
        quick=True,
        seed=36,
        work_dir=tmp_path / "run",
    )
    print(format_report(report))
    assert report.ok, report.failures
    assert report.tools["write"].invocations >= 1 and report.tools["lookup"].invocations >= 1


async def test_an_openai_agents_sdk_agent_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OpenAI Agents SDK agent wrapped with `durable` (tests/apps_openai_agents.py), its
    model the SDK's own, talking to the local fake of the Responses API that answers by the
    conversation: a read, a tool left undeclared (so a single-attempt write) and an
    idempotent write, killed at each boundary: pass, the undeclared one never made twice."""
    pytest.importorskip("agents", reason="the openai-agents extra is not installed")
    from tests.test_framework_openai_agents import AGENT, Scripted
    from tests.test_framework_openai_agents import call as oai_call
    from tests.test_framework_openai_agents import script as oai_script

    monkeypatch.setenv("JETLOOP_VENDOR_DB", str(tmp_path / "vendor.sqlite"))
    text = oai_script(
        [oai_call("lookup", city="Paris")],
        [oai_call("book", flight="AF1")],
        [oai_call("save", note="booked")],
    )
    async with Scripted() as fake:
        monkeypatch.setenv("TEST_OPENAI_AGENTS_URL", fake.base_url)
        report = await crash_test_async(
            "tests.apps_openai_agents:app",
            [Message(AGENT, text)],
            vendor_dedupes=["save"],
            quick=True,
            seed=37,
            work_dir=tmp_path / "run",
        )
    print(format_report(report))
    assert report.ok, report.failures
    book = report.tools["book"]
    assert book.effect == "non_idempotent_write" and book.repeated_calls == 0, book
    assert book.invocations >= 1 and report.tools["save"].invocations >= 1


async def test_a_claude_agent_sdk_agent_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Claude Agent SDK agent wrapped with `durable_claude` (tests/apps_claude.py), its
    bundled CLI talking to the local fake of the Messages API that answers by the
    conversation: one call of a tool left undeclared (a single-attempt write whose vendor
    does not dedupe), deferred to a jetloop step, killed at each boundary: pass, the charge
    never made twice. (One call: every segment is a run of the CLI, the heavy part.)"""
    pytest.importorskip("claude_agent_sdk", reason="the claude extra is not installed")
    from tests.fakes import FakeAnthropic, FakeCall, Reply
    from tests.test_framework_claude import AGENT, Answering, claude_env, tool_results

    def answer(body: dict[str, Any]) -> Reply:
        if tool_results(body):
            return Reply(text="charged")
        return Reply(calls=(FakeCall("mcp__shop__charge", {"amount": 3}),))

    monkeypatch.setenv("JETLOOP_VENDOR_DB", str(tmp_path / "vendor.sqlite"))
    async with FakeAnthropic() as fake:
        fake._outcomes = Answering(fake, answer)  # type: ignore[assignment]
        for name, value in claude_env(fake, tmp_path / "home").items():
            monkeypatch.setenv(name, value)
        report = await crash_test_async(
            "tests.apps_claude:app",
            [Message(AGENT, "charge 3")],
            quick=True,
            seed=38,
            work_dir=tmp_path / "run",
        )
    print(format_report(report))
    assert report.ok, report.failures
    charge = report.tools["charge"]
    assert charge.effect == "non_idempotent_write" and charge.repeated_calls == 0, charge
    assert charge.invocations >= 1 and charge.outcome_unknown >= 1, charge


async def test_the_readme_agent_passes_with_the_server_restarted(in_app_dir: Path) -> None:
    """`--mode server_restart`: at each boundary the nats-server is SIGKILLed and started
    again on its store, under the running worker; the README's agent passes, its SMS never
    sent twice. A random round restarts the server too (before: it killed the worker, and
    the report called it a server restart)."""
    report = await crash_test_async(
        "shop:app",
        [Message(None, "refund order 42")],
        vendor_dedupes=["refund"],
        mode="server_restart",
        rounds=1,
        quick=True,
        seed=39,
        work_dir=in_app_dir / "run",
    )
    print(format_report(report))
    assert report.ok, report.failures
    assert report.mode == "server_restart" and sum(1 for r in report.rounds if not r.missed) >= 5
    assert {r.mode for r in report.rounds} == {"server_restart"}
    assert [r for r in report.rounds if r.boundary is None and r.killed_at is not None]
    assert report.tools["send_sms"].repeated_calls == 0
