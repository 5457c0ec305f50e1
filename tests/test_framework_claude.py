"""A Claude Agent SDK agent on jetloop: segments, deferred custom tools, and crashes.

Real worker processes (``tests.apps_claude:app``) run the SDK's bundled Claude Code CLI
against the fake Anthropic Messages server of this test process (``ANTHROPIC_BASE_URL``),
offline. The CLI is heavy, so each test keeps its CLI runs few.

A worker is killed alone (SIGKILL to its pid, as the crash matrix does); the CLI it was
running must die with it (``jetloop.agents.frameworks.claude`` starts it with a parent-death signal)
rather than finish the lost segment as an orphan.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

# The `claude` extra: without it these tests are skipped, not broken.
pytest.importorskip("claude_agent_sdk")

from jetloop.agents.frameworks.claude import ClaudeSegments, durable_claude
from jetloop.agents.model import Message, ModelRequest, ToolCallRequest
from jetloop.agents.tools import Effect
from jetloop.demo.vendor import Vendor
from jetloop.services.client import Client
from jetloop.streams.registry import Registry
from jetloop.tooling.trials.harness import WorkerProcess
from tests.conftest import WorkerFactory, held_for_approval, until
from tests.fakes import FakeAnthropic, FakeCall, Reply
from tests.test_matrix import (  # the crash-matrix columns, reused
    Rig,
    _events_until_done,
    rig,  # noqa: F401 - a fixture
)

APP = "tests.apps_claude:app"
AGENT = "claude_shop"


@pytest.fixture
async def fake() -> AsyncIterator[FakeAnthropic]:
    async with FakeAnthropic() as f:
        yield f


def claude_env(fake: FakeAnthropic, home: Path) -> dict[str, str]:
    return {
        "CLAUDE_FAKE_URL": fake.base_url,
        "CLAUDE_FAKE_KEY": fake.api_key,
        "CLAUDE_HOME": str(home),
    }


async def declare(client: Client) -> None:
    """The agent declared as a deploy does, so a send waits for its worker."""
    registry = await Registry.open(client.js)
    await registry.declare([AGENT], "tests")


def start(
    workers: WorkerFactory, fake: FakeAnthropic, home: Path, name: str | None = None, **kw: Any
) -> WorkerProcess:
    return workers.start(name, app=APP, env=claude_env(fake, home), **kw)


def cli_processes(w: WorkerProcess) -> list[int]:
    """The pids of the Claude Code CLI processes the worker is running."""
    out = subprocess.run(["pgrep", "-P", str(w.pid)], capture_output=True, text=True)
    pids = [int(x) for x in out.stdout.split()]
    return [p for p in pids if "claude" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]


async def kill_worker(w: WorkerProcess) -> list[int]:
    """SIGKILL the worker alone; the CLI it was running (its pids returned) dies with it."""
    clis = cli_processes(w)
    w.kill()

    async def gone() -> bool:
        return not any(_alive(p) for p in clis)

    await until(gone, timeout=10)
    return clis


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def bash(log: Path, gate: Path | None = None) -> FakeCall:
    """The built-in Bash tool: appends a line to ``log``, then waits for ``gate`` if given."""
    command = f"echo ran >> {log}"
    if gate is not None:
        command += f"; while [ ! -f {gate} ]; do sleep 0.05; done"
    return FakeCall("Bash", {"command": command, "description": "log a line"})


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def tool_results(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        b
        for m in body["messages"]
        if isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]


def transcript_texts(body: dict[str, Any]) -> str:
    return json.dumps(body["messages"])


async def count(vendor: Vendor, op: str) -> int:
    return sum((await vendor.request_counts(op)).values())


# --- the wrapper, without the CLI -------------------------------------------------------


def test_wrapper_declares_each_custom_tool_by_its_effect() -> None:
    """Each ``@tool`` of an SDK MCP server becomes a jetloop tool: its declared effect, or a
    single-attempt write when undeclared; an ``inline`` tool stays with the CLI; effects for
    tools that do not exist, or tools of a server the options lack, are refused."""
    from tests.apps_claude import book, charge, lookup, options, shop_agent, stock

    assert {t.name: t.effect for t in shop_agent.tools} == {
        "charge": Effect.NON_IDEMPOTENT_WRITE,
        "book": Effect.IDEMPOTENT_WRITE,
        "refund": Effect.NON_IDEMPOTENT_WRITE,
        "lookup": Effect.READ,
    }
    assert shop_agent.tool("charge") is not None
    assert shop_agent.tool("charge").max_attempts == 1  # type: ignore[union-attr]
    assert shop_agent.tool("stock") is None, "inline: run by the CLI"
    # Arguments are checked against the tool's schema as the SDK's server checks them, so a
    # call the model got wrong is recorded as failed (RunModel's plan) and never made.
    args = shop_agent.tool("charge").args_model  # type: ignore[union-attr]
    assert args.model_validate({"amount": 5}).model_dump() == {"amount": 5}
    with pytest.raises(ValidationError, match="Input validation error"):
        args.model_validate({"amount": "five"})
    with pytest.raises(ValueError, match="unknown tools"):
        durable_claude("x", options(), tools={"shop": [book]}, effects={"charge": Effect.READ})
    with pytest.raises(ValueError, match=r"not in options\.mcp_servers"):
        durable_claude("x", options(), tools={"other": [charge, lookup, stock]})


def test_segment_resumes_the_history_and_prompts_with_the_last_user_text() -> None:
    """A segment's input: the history before the last user text (tool names as the CLI
    knows them, results as ``tool_result`` blocks) and that text as the prompt; after
    deferred calls, the conversation up to their results and a note to go on."""
    from tests.apps_claude import shop_agent

    model = shop_agent.model
    assert isinstance(model, ClaudeSegments)
    call = ToolCallRequest("charge", {"amount": 5}, provider_id="toolu_01abc")
    history = [
        Message(role="user", text="charge 5"),
        Message(role="assistant", text="charging", calls=[call]),
        Message(role="tool", call_id="t-0-0", tool="charge", status="ok", result="charged 5"),
    ]

    def request(messages: list[Message]) -> ModelRequest:
        return ModelRequest(agent=AGENT, instructions="", messages=messages, tools=[], attempt=1)

    messages, prompt = model.segment(request(history))
    assert prompt.endswith("The results of the tool calls above are in. Continue the task.")
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"][-1]["name"] == "mcp__shop__charge"
    assert messages[2]["content"][0]["tool_use_id"] == "toolu_01abc"
    later = [*history, Message(role="assistant", text="done"), Message(role="user", text="more")]
    messages, prompt = model.segment(request(later))
    assert prompt == "more"
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert model.segment(request([Message(role="user", text="hi")])) == ([], "hi")


# --- the adapter, in this process --------------------------------------------------------


async def test_segment_runs_cli_tools_inline_and_defers_custom_tools(
    fake: FakeAnthropic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One segment: the CLI runs Bash itself; the custom tool is not run but returned as a
    call (jetloop's tool name, the provider's id); the next segment resumes from the
    history with the result as a real ``tool_result`` of the MCP tool."""
    for k, v in claude_env(fake, tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("JETLOOP_VENDOR_DB", str(tmp_path / "vendor.sqlite"))
    from tests.apps_claude import make_agent

    shop_agent = make_agent()

    log = tmp_path / "bash.log"
    fake.script(
        Reply(text="first a note", calls=(bash(log),)),
        Reply(text="now the charge", calls=(FakeCall("mcp__shop__charge", {"amount": 5}),)),
        Reply(text="charged, all done"),
    )
    first = ModelRequest(
        agent=AGENT,
        instructions="",
        messages=[Message(role="user", text="charge 5")],
        tools=[],
        attempt=1,
        session_id="s",
        turn_id="t1",
    )
    r1 = await shop_agent.model.complete(first)
    assert lines(log) == 1, "Bash ran inside the segment"
    assert r1.text == "now the charge"
    assert [(c.name, c.arguments) for c in r1.tool_calls] == [("charge", {"amount": 5})]
    assert await count(Vendor(tmp_path / "vendor.sqlite"), "charge") == 0, "deferred, not run"
    call = r1.tool_calls[0]
    history = [
        Message(role="user", text="charge 5"),
        Message(role="assistant", text=r1.text, calls=[ToolCallRequest(**vars(call))]),
        Message(role="tool", call_id="t1-0-0", tool="charge", status="ok", result="charged 5"),
    ]
    second = ModelRequest(
        agent=AGENT,
        instructions="",
        messages=history,
        tools=[],
        attempt=1,
        session_id="s",
        turn_id="t1",
        model_step=1,
    )
    r2 = await shop_agent.model.complete(second)
    assert (r2.text, r2.tool_calls) == ("charged, all done", [])
    last = fake.bodies[-1]
    assert [(m["role"]) for m in last["messages"][:3]] == ["user", "assistant", "user"]
    use = last["messages"][1]["content"][-1]
    assert (use["type"], use["name"], use["id"]) == (
        "tool_use",
        "mcp__shop__charge",
        call.provider_id,
    )
    assert tool_results(last)[0]["tool_use_id"] == call.provider_id
    assert tool_results(last)[0]["content"] == "charged 5"
    assert lines(log) == 1, "a finished segment's CLI tools are not run again"


# --- real workers -----------------------------------------------------------------------


async def test_turn_on_a_worker_defers_each_custom_tool_by_its_effect(
    fake: FakeAnthropic, client: Client, workers: WorkerFactory, vendor: Vendor, tmp_path: Path
) -> None:
    """A turn on a real worker: three custom tools asked at once become three CallTool
    steps with the declared effect classes (charge undeclared → a non-idempotent write); the
    session's next turn resumes the whole conversation (the calls as MCP tool uses)."""
    await declare(client)
    fake.script(
        Reply(
            text="doing all three",
            calls=(
                FakeCall("mcp__shop__charge", {"amount": 7}),
                FakeCall("mcp__shop__book", {"slot": "9am"}),
                FakeCall("mcp__shop__lookup", {"order": "A1"}),
            ),
        ),
        Reply(text="all three done"),
    )
    start(workers, fake, tmp_path / "home")
    h = await client.send(AGENT, "c1", "charge, book, look up")
    res = await client.wait(h, timeout=60)
    assert (res.status, res.text) == ("completed", "all three done")
    effects = []
    for i in range(3):
        rec = await client.call("c1", h.turn_id, 0, i)
        assert rec is not None and rec.state == "succeeded"
        effects.append(rec.effect)
    assert effects == ["non_idempotent_write", "idempotent_write", "read"]
    assert await vendor.effect_count("charge") == 1
    assert await vendor.effect_count("book") == 1
    results = tool_results(fake.bodies[-1])
    assert [r["content"] for r in results] == ["charged 7", "booked 9am", "order A1 is paid"]
    # The next turn's segment resumes the whole session from jetloop's history.
    fake.script(Reply(text="yes, all three"))
    h2 = await client.send(AGENT, "c1", "did it work?")
    res2 = await client.wait(h2, timeout=60)
    assert (res2.status, res2.text) == ("completed", "yes, all three")
    sent = fake.bodies[-1]["messages"]
    assert sent[0]["content"][0]["text"] == "charge, book, look up"
    assert [b["name"] for b in sent[1]["content"] if b["type"] == "tool_use"] == [
        "mcp__shop__charge",
        "mcp__shop__book",
        "mcp__shop__lookup",
    ]
    assert {"type": "text", "text": "all three done"} in sent[3]["content"]
    assert "did it work?" in json.dumps(sent[-1])
    # The usage ledger prices each segment by the options' model (a list price is known).
    used = await client.usage("c1")
    assert len(used) == 3 and {x.model for x in used} == {"claude-sonnet-4-5"}, used
    assert all(x.cost_usd is not None for x in used)


async def test_worker_killed_mid_deferred_tools(
    fake: FakeAnthropic, client: Client, workers: WorkerFactory, vendor: Vendor, tmp_path: Path
) -> None:
    """SIGKILL while the deferred tools have run but not committed: the single-attempt
    write is settled ``outcome_unknown`` and never runs twice, the idempotent write is made
    again with the same key (applied once), the read is made again."""
    await declare(client)
    fake.script(
        Reply(
            text="doing all three",
            calls=(
                FakeCall("mcp__shop__charge", {"amount": 7}),
                FakeCall("mcp__shop__book", {"slot": "9am"}),
                FakeCall("mcp__shop__lookup", {"order": "A1"}),
            ),
        ),
        Reply(text="settled"),
    )
    home = tmp_path / "home"
    victim = start(workers, fake, home, hold="call_tool.before_commit")
    h = await client.send(AGENT, "c2", "charge, book, look up")

    async def all_held() -> bool:
        return len(victim.find("fault.hold", point="call_tool.before_commit")) == 3

    await until(all_held)
    await kill_worker(victim)
    start(workers, fake, home, "survivor")
    res = await client.wait(h, timeout=90)
    assert res.status == "completed"
    charge = await client.call("c2", h.turn_id, 0, 0)
    assert charge is not None and charge.state == "outcome_unknown" and charge.attempts == 1
    assert await count(vendor, "charge") == 1, "a single-attempt write never runs twice"
    book_keys = await vendor.request_counts("book")
    assert len(book_keys) == 1 and sum(book_keys.values()) == 2, "made again, the same key"
    assert await vendor.effect_count("book") == 1
    assert sum((await vendor.payload_counts("lookup")).values()) == 2, "a read repeats"
    results = tool_results(fake.bodies[-1])
    assert results[0]["is_error"] is True and "Outcome unknown" in results[0]["content"]
    assert [r["content"] for r in results[1:]] == ["booked 9am", "order A1 is paid"]


async def test_approval_holds_a_deferred_tool_until_approved(
    fake: FakeAnthropic, client: Client, workers: WorkerFactory, vendor: Vendor, tmp_path: Path
) -> None:
    """A deferred tool with an approval policy waits in state for a person's decision (the
    segment has ended, no CLI runs meanwhile); approved, it is made once and the next
    segment reads its result."""
    await declare(client)
    fake.script(
        Reply(text="refunding", calls=(FakeCall("mcp__shop__refund", {"order": "A1"}),)),
        Reply(text="refund done"),
    )
    start(workers, fake, tmp_path / "home")
    h = await client.send(AGENT, "ap", "refund A1")

    async def waiting() -> Any:
        snap = await client.snapshot("ap")
        return snap if snap is not None and snap.approvals else None

    snap = await until(waiting)
    await held_for_approval(client, "ap", h.turn_id, 0, 0)
    assert await count(vendor, "refund") == 0
    assert len(fake.received) == 1, "no segment runs while the call waits"
    await client.approve("ap", snap.approvals[0].approval_id, by="test")
    res = await client.wait(h, timeout=60)
    assert (res.status, res.text) == ("completed", "refund done")
    assert await vendor.effect_count("refund") == 1
    assert tool_results(fake.bodies[-1])[0]["content"] == "refunded A1"


# --- the crash-matrix row: a Claude Agent SDK turn segment, while it runs ------------------


class Answering:
    """The fake's outcomes chosen from each request, not from a queue: a segment that runs
    again asks the same questions again and must get the same answers (``popleft`` is all
    ``FakeProvider`` asks of its queue)."""

    def __init__(self, fake: FakeAnthropic, answer: Callable[[dict[str, Any]], Reply]) -> None:
        self.fake, self.answer = fake, answer

    def __bool__(self) -> bool:
        return True

    def popleft(self) -> Reply:
        return self.answer(self.fake.received[-1].body)


async def fail_while_running(
    r: Rig, victim: WorkerProcess, gate: Path, env: dict[str, str]
) -> None:
    """The column's failure, with the worker inside the segment; then the gate opens."""
    if r.worker_killed:
        assert await kill_worker(victim), "the worker was running its CLI"
        gate.touch()  # noqa: ASYNC240
        r.workers.start("survivor", app=APP, env=env)
    else:
        await r.down()
        await r.up()
        gate.touch()  # noqa: ASYNC240


@pytest.mark.timeout(180)
async def test_segment_while_running(
    rig: Rig,  # noqa: F811 - the fixture imported above
    fake: FakeAnthropic,
    tmp_path: Path,
) -> None:
    """A failure while a segment runs (its Bash tool is running): the worker is SIGKILLed
    with its CLI, or the servers fail (restart, takeover) under the running worker.

    Whatever the column, the turn completes and the deferred single-attempt charge after
    the segment is made exactly once. After a worker kill the segment's RunModel step runs
    again: its model calls and its Bash tool repeat (at-least-once). Under a server failure
    the step goes on, or, if the outage outlasted its lease, runs again the same way."""
    await declare(rig.client)
    log, gate = tmp_path / "bash.log", tmp_path / "gate"

    def answer(body: dict[str, Any]) -> Reply:
        results = tool_results(body)
        if any(r["content"].startswith("charged") for r in results):
            return Reply(text="charged 3, done")
        if results:  # Bash answered, inside the segment
            charge = FakeCall("mcp__shop__charge", {"amount": 3})
            return Reply(text="now the charge", calls=(charge,))
        return Reply(text="working", calls=(bash(log, gate),))

    fake._outcomes = Answering(fake, answer)  # type: ignore[assignment]
    home = tmp_path / "home"
    env = claude_env(fake, home)
    victim = rig.workers.start(app=APP, env=env)
    h = await rig.client.send(AGENT, "seg", "charge 3 after the work")

    async def bash_running() -> bool:
        return lines(log) == 1

    await until(bash_running)
    await fail_while_running(rig, victim, gate, env)
    res = await rig.client.wait(h, timeout=120)
    assert (res.status, res.text) == ("completed", "charged 3, done")
    ran = lines(log)
    if rig.worker_killed:
        assert ran == 2, "the segment ran again, and its Bash tool with it"
        resumed = [
            e.data["step"]
            async for e in _events_until_done(rig.client, "seg")
            if e.type == "agent.run.crash_resumed"
        ]
        assert resumed == [f"seg.{h.turn_id}.m0"], "the lost RunModel step, audited"
    else:
        assert ran >= 1
    assert await count(rig.vendor, "charge") == 1, "the deferred charge is made once"
    rec = await rig.client.call("seg", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.effect == "non_idempotent_write"


# --- the crash-matrix row: a tool the framework cannot defer, while it runs ----------------


@pytest.mark.timeout(180)
async def test_inline_tool_while_running(
    rig: Rig,  # noqa: F811 - the fixture imported above
    fake: FakeAnthropic,
    tmp_path: Path,
) -> None:
    """A custom tool declared ``inline`` is run by the CLI inside the segment: a failure
    while it runs (after it logged at the vendor, before it answered) leaves it at-least-once.
    After a worker kill the segment runs again and the tool with it (twice in all); under a
    server failure once, or twice if the outage outlasted the step's lease. The turn
    completes either way, and jetloop made no CallTool step for it."""
    await declare(rig.client)
    gate = tmp_path / "gate"

    def answer(body: dict[str, Any]) -> Reply:
        if tool_results(body):
            return Reply(text="4 left, done")
        return Reply(text="counting", calls=(FakeCall("mcp__shop__stock", {"item": "tea"}),))

    fake._outcomes = Answering(fake, answer)  # type: ignore[assignment]
    env = {**claude_env(fake, tmp_path / "home"), "CLAUDE_GATE": str(gate)}
    victim = rig.workers.start(app=APP, env=env)
    h = await rig.client.send(AGENT, "inl", "how much tea?")

    async def running() -> bool:
        return await count(rig.vendor, "stock") == 1

    await until(running)
    await fail_while_running(rig, victim, gate, env)
    res = await rig.client.wait(h, timeout=120)
    assert (res.status, res.text) == ("completed", "4 left, done")
    ran = await count(rig.vendor, "stock")
    if rig.worker_killed:
        assert ran == 2, "the segment ran again, and the inline tool with it"
    else:
        assert ran in (1, 2)
    assert await rig.client.call("inl", h.turn_id, 0, 0) is None, "no CallTool step"
