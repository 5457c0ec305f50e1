"""pydantic-ai agents run durably: the wrapper's mapping, then turns on real worker processes.

The agents are plain ``pydantic_ai.Agent``s on pydantic-ai's own ``FunctionModel``
(tests/apps_pydantic_ai.py), wrapped by ``durable`` with effect declarations. Each model request
is a RunModel step and each tool call a CallTool step, so a worker SIGKILLed mid model call or
mid tool resumes with the crash-matrix semantics (docs/crash-matrix.md): the model is asked
again, a READ is made again, an idempotent write again with the same key, a single-attempt write
is never made twice (``outcome_unknown``). A native tool the provider runs inside the model
request cannot be deferred: it runs inside RunModel and repeats with it (the framework row of
the crash matrix, tested in all three columns on tests/test_matrix.py's rig).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("pydantic_ai", reason="the pydantic-ai extra is not installed")

from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import ApprovalRequired, FunctionToolset, PrefixedToolset, RunContext
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from jetloop.agents import Effect
from jetloop.agents.adapters.history import conversation
from jetloop.agents.frameworks.pydantic_ai import durable, to_model_messages, tool_context
from jetloop.agents.model import Message, ModelRequest, ToolCallRequest
from jetloop.demo.vendor import Vendor
from jetloop.schemas.errors import ProviderRejected, ProviderRetryable, ToolError
from jetloop.services.client import Client
from jetloop.streams.registry import Registry
from jetloop.tooling.trials.harness import WorkerProcess
from tests.apps_pydantic_ai import DEPS, Forecast
from tests.apps_pydantic_ai import app as pai_app
from tests.conftest import WorkerFactory, call, script, until
from tests.test_matrix import Rig, count, rig, steps_asked  # noqa: F401  (the rig fixture)

APP = "tests.apps_pydantic_ai:app"


def body(text: str | None) -> dict[str, Any]:
    """The JSON the scripted model appends to its final answer."""
    assert text is not None
    parsed: dict[str, Any] = json.loads(text.split("\n", 1)[1])
    return parsed


async def declare(client: Client) -> None:
    """The test app's agents declared as a deploy does, so a send before the worker is up
    waits for it instead of being refused as an unknown agent."""
    registry = await Registry.open(client.js)
    await registry.declare(list(pai_app.agents), "tests")


@pytest.fixture
async def pai(client: Client, workers: WorkerFactory) -> AsyncIterator[Client]:
    await declare(client)
    yield client


def start(workers: WorkerFactory, hold: str | None = None, **kw: Any) -> WorkerProcess:
    release = workers.tmp / "release" if hold else None
    return workers.start(app=APP, hold=hold, release_file=release, **kw)


# --- the wrapper, without a server ----------------------------------------------------------


def silent(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[TextPart("")])


def test_tools_get_their_declared_effect_and_undeclared_ones_are_single_attempt_writes() -> None:
    """Each function tool is a jetloop tool: the declared effect, else NON_IDEMPOTENT_WRITE;
    ``requires_approval=True`` and an ``approvals`` predicate are jetloop approvals; bad
    arguments are refused by pydantic-ai's own validator when the call is planned."""
    agent = pai_app.agent("pai")
    assert agent is not None
    effects = {t.name: t.effect for t in agent.tools}
    assert effects == {
        "lookup": Effect.READ,
        "write": Effect.IDEMPOTENT_WRITE,
        "once": Effect.NON_IDEMPOTENT_WRITE,
        "refund": Effect.IDEMPOTENT_WRITE,
        "pay": Effect.IDEMPOTENT_WRITE,
        "picky": Effect.READ,
    }
    refund, pay, lookup = agent.tool("refund"), agent.tool("pay"), agent.tool("lookup")
    assert refund is not None and pay is not None and lookup is not None
    assert refund.needs_approval(refund.args_model.model_validate({"order": "1", "cents": 1}))
    assert pay.needs_approval(pay.args_model.model_validate({"name": "a", "cents": 500}))
    assert not pay.needs_approval(pay.args_model.model_validate({"name": "a", "cents": 50}))
    assert lookup.approval is False
    with pytest.raises(ValueError, match="name: Field required"):
        lookup.args_model.model_validate({"city": "x"})
    with pytest.raises(ValueError, match="no tool named nope"):
        durable(PydanticAgent(FunctionModel(silent), name="x"), effects={"nope": Effect.READ})


def test_conversation_becomes_pydantic_ai_messages() -> None:
    """jetloop's history, paired by jetloop.agents.adapters.history, as ModelRequest /
    ModelResponse: each call with its result under the same id, notes as prompt parts."""
    from pydantic_ai import messages as pm

    msgs = [
        Message("user", "hi"),
        Message("assistant", "looking", calls=[ToolCallRequest("lookup", {"name": "a"}, "c1")]),
        Message("tool", call_id="t1-0-0", tool="lookup", status="ok", result={"v": 1}),
        Message("note", "a note"),
    ]
    out = to_model_messages(conversation(msgs))
    assert [type(m).__name__ for m in out] == ["ModelRequest", "ModelResponse", "ModelRequest"]
    assert isinstance(out[1], pm.ModelResponse) and out[1].text == "looking"
    [tc] = out[1].tool_calls
    assert (tc.tool_name, tc.args, tc.tool_call_id) == ("lookup", {"name": "a"}, "c1")
    ret, note = out[2].parts
    assert isinstance(ret, pm.ToolReturnPart) and ret.tool_call_id == "c1"
    assert ret.content == '{"v": 1}'
    assert isinstance(note, pm.UserPromptPart) and "a note" in str(note.content)


def shouting(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """A model whose provider fails as the user's last words say, else echoes the count."""
    last = messages[-1].parts[-1]
    said = str(last.content) if isinstance(last, UserPromptPart) else ""
    if said in ("429", "400"):
        raise ModelHTTPError(int(said), "fake", {"error": said})
    if said.startswith("call "):
        return ModelResponse(parts=[ToolCallPart(said.removeprefix("call "), {"side": 2})])
    return ModelResponse(parts=[TextPart(f"{len(messages)} messages")])


@dataclass
class Call:
    """A ToolContext as the engine gives one, for a tool run without the engine."""

    namespace: str = "default"
    session_id: str = "s"
    turn_id: str = "t1"
    model_step: int = 0
    call_id: str = "t1-0-0"
    idempotency_key: str = "key-1"
    attempt: int = 1
    cancelled: bool = False

    async def heartbeat(self) -> None:
        return None


async def test_provider_errors_summary_calls_and_sync_tools() -> None:
    """A 429 from the pydantic-ai model retries the step, a 400 fails it at once; the
    compaction call goes to the agent's model with the engine's instructions, no tools; a
    sync tool (run by pydantic-ai in a thread) still reads its call's idempotency key."""
    agent = PydanticAgent(FunctionModel(shouting), name="x")

    @agent.tool_plain
    def keyed(a: int) -> str:
        return f"{tool_context().idempotency_key}:{a}"

    wrapped = durable(agent, effects={"keyed": Effect.READ})

    def ask(text: str, purpose: str = "answer") -> ModelRequest:
        msgs = [Message("user", text)]
        return ModelRequest("x", "Summarise.", msgs, [], attempt=1, purpose=purpose)

    with pytest.raises(ProviderRetryable) as retry:
        await wrapped.model.complete(ask("429"))
    assert retry.value.status == 429
    with pytest.raises(ProviderRejected):
        await wrapped.model.complete(ask("400"))
    summary = await wrapped.model.complete(ask("hello", purpose="summary"))
    assert summary.text == "1 messages" and summary.tool_calls == []
    tool = wrapped.tool("keyed")
    assert tool is not None
    assert await tool.fn(tool.args_model.model_validate({"a": 3}), Call()) == "key-1:3"


async def test_tools_of_other_toolsets_are_deferred_when_named() -> None:
    """A tool pydantic-ai only lists at run time (here a prefixed toolset; an MCP server is the
    same) is not known when the app loads: named in ``effects``, it becomes a jetloop tool
    too and runs through pydantic-ai's ToolManager, with its deps."""

    def area(ctx: RunContext[int], side: int) -> int:
        return side * side * ctx.deps

    toolset = PrefixedToolset(FunctionToolset([area]), "geo")
    agent = PydanticAgent(FunctionModel(shouting), name="x", toolsets=[toolset], deps_type=int)
    wrapped = durable(agent, effects={"geo_area": Effect.READ}, deps=10)
    tool = wrapped.tool("geo_area")
    assert tool is not None and tool.effect is Effect.READ
    assert await tool.fn(tool.args_model.model_validate({"side": 3}), Call()) == 90

    # Not named: not a jetloop tool, and still not run inside the model step; the engine
    # records the call as one to an unknown tool, which the model then sees.
    unnamed = durable(agent, deps=10)
    assert unnamed.tool("geo_area") is None
    asked = await unnamed.model.complete(
        ModelRequest("x", "", [Message("user", "call geo_area")], [], 1)
    )
    assert [(c.name, c.arguments) for c in asked.tool_calls] == [("geo_area", {"side": 2})]


async def test_an_mcp_toolset_is_served_by_jetloops_mcp_client(tmp_path: Any) -> None:
    """An ``MCPToolset`` (stdio) among the agent's toolsets: its tools are jetloop tools with
    the effects the server's annotations give (``effects=`` over them), offered to the model
    in its step as pydantic-ai offers tools, and a call carries the key in ``_meta``; pydantic-ai
    never starts the server itself (one server process answers everything)."""
    import sys

    from fastmcp.client.transports import StdioTransport
    from pydantic_ai.mcp import MCPToolset

    from jetloop.agents.model import ToolSpec
    from tests.apps_mcp import SERVER
    from tests.mcp_ledger import invocations

    log = tmp_path / "log.jsonl"
    env = {"MCP_LEDGER_LOG": str(log), "MCP_LEDGER_STATE": str(tmp_path / "state.json")}
    offered: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        offered.extend(t.name for t in info.function_tools)
        return ModelResponse(parts=[ToolCallPart("transfer", {"account": "a", "amount": 5})])

    toolset = MCPToolset(
        StdioTransport(command=sys.executable, args=[str(SERVER)], env=env), id="ledger"
    )
    agent = PydanticAgent(FunctionModel(model), name="bank", toolsets=[toolset])
    wrapped = durable(agent, effects={"close_account": Effect.IDEMPOTENT_WRITE})
    assert [s.name for s in wrapped.mcp_servers] == ["ledger"]
    try:
        tools = {t.name: t for t in await wrapped.list_tools()}
        assert {n: t.effect for n, t in tools.items()} == {
            "balance": Effect.READ,
            "set_limit": Effect.IDEMPOTENT_WRITE,
            "transfer": Effect.NON_IDEMPOTENT_WRITE,
            "close_account": Effect.IDEMPOTENT_WRITE,
        }
        specs = [ToolSpec(t.name, t.description, t.json_schema()) for t in tools.values()]
        asked = await wrapped.model.complete(
            ModelRequest("bank", "", [Message("user", "pay")], specs, 1)
        )
        assert sorted(offered) == sorted(tools)
        [c] = asked.tool_calls
        tool = tools[c.name]
        out = await tool.fn(tool.args_model.model_validate(c.arguments), Call())
        assert out == "moved 5 out of a"
        assert [(i["tool"], i["key"]) for i in invocations(log)] == [("transfer", "key-1")]
    finally:
        await wrapped.mcp_servers[0].close()


async def test_the_readme_example_runs_on_pydantic_ais_test_model() -> None:
    """docs/agents.md's "### pydantic-ai" block, with pydantic-ai's ``TestModel`` for the real
    model: the app it builds serves ``weather``, whose model step asks for its tool, whose tool step
    runs, and whose next model step answers."""
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "docs" / "agents.md").read_text()
    section = readme.split("### pydantic-ai\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert '"openai:gpt-4o"' in code
    scope: dict[str, Any] = {}
    exec(compile(code.replace('"openai:gpt-4o"', '"test"'), "agents.md", "exec"), scope)
    weather = scope["app"].agent("weather")
    assert [(t.name, t.effect) for t in weather.tools] == [("forecast", Effect.READ)]
    first = await weather.model.complete(
        ModelRequest("weather", "", [Message("user", "Paris?")], [], 1)
    )
    [asked] = first.tool_calls
    tool = weather.tool("forecast")
    result = await tool.fn(tool.args_model.model_validate(asked.arguments), Call())
    assert result == {"city": asked.arguments["city"], "temp": 21}
    history = [
        Message("user", "Paris?"),
        Message("assistant", first.text, calls=[asked]),
        Message("tool", call_id="t1-0-0", tool="forecast", status="ok", result=result),
    ]
    last = await weather.model.complete(ModelRequest("weather", "", history, [], 1))
    assert last.tool_calls == [] and "forecast" in last.text


async def test_a_tool_asking_for_approval_from_its_body_fails_with_what_to_declare() -> None:
    """``ApprovalRequired`` raised inside a tool is a decision jetloop cannot see before the
    call: the call fails (the model sees why), saying to declare the tool in ``approvals``;
    declared, the call waits for approval and then runs with ``tool_call_approved``."""

    def transfer(ctx: RunContext[None], cents: int) -> str:
        if cents > 100 and not ctx.tool_call_approved:
            raise ApprovalRequired()
        return f"sent {cents}"

    agent = PydanticAgent(FunctionModel(shouting), name="x", tools=[transfer])
    plain = durable(agent, effects={"transfer": Effect.IDEMPOTENT_WRITE})
    tool = plain.tool("transfer")
    assert tool is not None
    with pytest.raises(ToolError, match=r"declare it with durable\(\.\.\., approvals="):
        await tool.fn(tool.args_model.model_validate({"cents": 500}), Call())
    gated = durable(agent, approvals={"transfer": lambda args: args["cents"] > 100})
    tool = gated.tool("transfer")
    assert tool is not None
    args = tool.args_model.model_validate({"cents": 500})
    assert tool.needs_approval(args) and await tool.fn(args, Call()) == "sent 500"


# --- turns on real workers ------------------------------------------------------------------


async def test_a_turn_runs_each_model_request_and_tool_as_a_step(
    pai: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """One turn: two model requests (two RunModel steps), three tool calls (CallTool steps,
    each with its effect), the tool's RunContext carrying the wrapper's deps, and the
    agent's instructions and tool definitions reaching its pydantic-ai model."""
    start(workers)
    text = script([call("lookup", name="a"), call("write", name="b"), call("once", name="c")])
    h = await pai.send("pai", "s1", text)
    res = await pai.wait(h, timeout=60)
    seen = body(res.text)
    assert seen["instructions"] == "Follow the script."
    assert seen["tools"] == ["lookup", "once", "pay", "picky", "refund", "write"]
    contents = {s["tool"]: json.loads(s["content"]) for s in seen["seen"]}
    assert contents["lookup"]["deps"] == DEPS
    assert contents["lookup"]["tool_call_id"] == f"{h.turn_id}-0-0"
    assert contents["write"] == {"op": "write", "name": "b"}
    assert contents["once"] == {"op": "once", "name": "c"}
    for i, effect in enumerate(["read", "idempotent_write", "non_idempotent_write"]):
        rec = await pai.call("s1", h.turn_id, 0, i)
        assert rec is not None and rec.state == "succeeded" and rec.attempts == 1
        assert rec.effect == effect
    assert steps_asked(await vendor.payload_counts("model_call")) == {0: 1, 1: 1}
    # The usage ledger names the pydantic-ai model each request went to.
    used = await pai.usage("s1")
    assert [x.model_step for x in used] == [0, 1]
    assert all(x.model == "function:scripted:" for x in used), {x.model for x in used}


async def test_model_retry_and_bad_arguments_reach_the_model_as_failed_calls(
    pai: Client, workers: WorkerFactory
) -> None:
    """A tool raising ``ModelRetry``, and a call whose arguments pydantic-ai's validator
    refuses, are failed calls the model sees (it can correct them), not retried steps."""
    start(workers)
    h = await pai.send("pai", "s1", script([call("picky", n=-1), call("picky", m=1)]))
    res = await pai.wait(h, timeout=60)
    first, second = body(res.text)["seen"]
    assert "-1 is negative; give a positive number" in first["content"]
    assert "n: Field required" in second["content"]
    rec = await pai.call("s1", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "failed" and rec.attempts == 1


async def test_history_is_kept_across_turns_and_structured_output_reads_back(
    pai: Client, workers: WorkerFactory
) -> None:
    """The session's history is the conversation: turn two's model sees turn one's prompt.
    A structured output arrives as the answer's JSON and ``output()`` validates it back."""
    start(workers)
    first = script(answer="one")
    await pai.wait(await pai.send("pai", "s1", first), timeout=60)
    second = script([call("lookup", name="x")], answer="two")
    res = await pai.wait(await pai.send("pai", "s1", second), timeout=60)
    assert body(res.text)["prompts"] == [first, second]

    h = await pai.send("pai-typed", "s2", json.dumps({"city": "Paris"}))
    res = await pai.wait(h, timeout=60)
    typed = pai_app.agent("pai-typed")
    assert typed is not None
    assert typed.output(res.text) == Forecast(city="Paris", temp=21)  # type: ignore[attr-defined]
    rec = await pai.call("s2", h.turn_id, 0, 0)
    assert rec is not None and rec.tool == "lookup" and rec.state == "succeeded"


async def test_approval_required_tools_wait_for_a_decision(
    pai: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """``requires_approval=True`` and the declared predicate hold a call for a person
    (AwaitToolApproval): the tool runs once after approval, never after a rejection, and a
    call the predicate lets through runs at once."""
    start(workers)
    text = script(
        [call("refund", order="42", cents=500), call("pay", name="big", cents=500)],
        [call("pay", name="small", cents=5)],
    )
    h = await pai.send("pai", "s1", text)

    async def two_waiting() -> Any:
        snap = await pai.snapshot("s1")
        return snap if snap is not None and len(snap.approvals) == 2 else None

    snap = await until(two_waiting)
    by_tool = {a.tool: a.approval_id for a in snap.approvals}
    assert await count(vendor, "refund") == 0 and await count(vendor, "pay") == 0
    await pai.approve("s1", by_tool["refund"], by="alice")
    await pai.reject("s1", by_tool["pay"], by="alice", reason="too much")
    res = await pai.wait(h, timeout=60)
    seen = body(res.text)["seen"]
    assert json.loads(seen[0]["content"]) == {"op": "refund", "order": "42", "cents": 500}
    assert seen[1]["content"].startswith("Denied") and "too much" in seen[1]["content"]
    assert json.loads(seen[2]["content"]) == {"op": "pay", "name": "small", "cents": 5}
    assert await count(vendor, "refund") == 1
    assert list((await vendor.payload_counts("pay")).values()) == [1]


# --- worker kill mid model call and mid tool ------------------------------------------------


async def kill_at(pai: Client, workers: WorkerFactory, point: str, text: str) -> tuple[Any, Any]:
    """A worker holds at ``point`` of the turn's first step of that kind, gets SIGKILL, and a
    new worker finishes the turn."""
    victim = start(workers, hold=point)
    h = await pai.send("pai", "k", text)
    await victim.wait_for("fault.hold", point=point)
    victim.kill()
    start(workers, name="survivor")
    return h, await pai.wait(h, timeout=60)


async def test_worker_kill_mid_model_call_asks_the_model_again(
    pai: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Killed while pydantic-ai's ``Model.request`` is in progress (the model function holds
    the request open): the new worker asks the model again (RunModel repeats), and the write
    it planned is made once."""
    victim = start(workers, env={"TEST_MODEL_LATCH": str(workers.tmp / "never")})
    h = await pai.send("pai", "k", script([call("write", name="w")]))

    async def in_call() -> bool:
        return await count(vendor, "model_call.open") == 1

    await until(in_call)
    victim.kill()
    start(workers, name="survivor")
    res = await pai.wait(h, timeout=60)
    assert steps_asked(await vendor.payload_counts("model_call")) == {0: 2, 1: 1}
    assert await vendor.effect_count("write") == 1
    rec = await pai.call("k", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 1
    assert json.loads(body(res.text)["seen"][0]["content"]) == {"op": "write", "name": "w"}


async def test_worker_kill_before_the_answer_is_committed_asks_the_model_again(
    pai: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Killed after the model answered, before the answer was committed: asked again too."""
    h, res = await kill_at(
        pai, workers, "run_model.before_commit", script([call("write", name="w")])
    )
    assert steps_asked(await vendor.payload_counts("model_call")) == {0: 2, 1: 1}
    assert await vendor.effect_count("write") == 1
    rec = await pai.call("k", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 1
    assert json.loads(body(res.text)["seen"][0]["content"]) == {"op": "write", "name": "w"}


async def test_worker_kill_mid_read_tool_makes_it_again(
    pai: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """A READ tool whose worker dies after it ran, before its result was committed, is
    made again by the new worker; the model is not asked again."""
    h, res = await kill_at(
        pai, workers, "call_tool.before_commit", script([call("lookup", name="r")])
    )
    assert list((await vendor.request_counts("read")).values()) == [2]
    rec = await pai.call("k", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 2
    assert json.loads(body(res.text)["seen"][0]["content"])["name"] == "r"
    assert steps_asked(await vendor.payload_counts("model_call")) == {0: 1, 1: 1}


async def test_worker_kill_mid_idempotent_write_repeats_it_with_the_same_key(
    pai: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """An IDEMPOTENT_WRITE tool is made again with the same idempotency key (the key the
    pydantic-ai tool reads from ``tool_context()``): two requests, one effect."""
    h, res = await kill_at(
        pai, workers, "call_tool.before_commit", script([call("write", name="w")])
    )
    assert list((await vendor.request_counts("write")).values()) == [2]
    assert await vendor.effect_count("write") == 1
    rec = await pai.call("k", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 2
    assert json.loads(body(res.text)["seen"][0]["content"]) == {"op": "write", "name": "w"}


async def test_worker_kill_mid_single_attempt_write_is_never_made_twice(
    pai: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """An undeclared tool is a single-attempt write: killed after it ran, the call is settled
    ``outcome_unknown`` and not made again; the model is told."""
    h, res = await kill_at(
        pai, workers, "call_tool.before_commit", script([call("once", name="o")])
    )
    assert await count(vendor, "once") == 1, "a single-attempt write never runs twice"
    rec = await pai.call("k", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "outcome_unknown" and rec.attempts == 1
    assert rec.settlement == "outcome_unknown"
    assert body(res.text)["seen"][0]["content"].startswith("Outcome unknown")


async def test_worker_kill_after_the_mark_never_starts_the_single_attempt_write(
    pai: Client, workers: WorkerFactory, vendor: Vendor
) -> None:
    """Killed after the in-doubt mark, before the tool started: ``outcome_unknown`` as well,
    and the pydantic-ai tool never ran at all."""
    h, res = await kill_at(pai, workers, "call_tool.in_tool", script([call("once", name="o")]))
    assert await count(vendor, "once") == 0, "the killed attempt never made the call"
    rec = await pai.call("k", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "outcome_unknown" and rec.attempts == 1
    assert body(res.text)["seen"][0]["content"].startswith("Outcome unknown")


# --- the crash-matrix row: a tool the framework cannot defer, while it runs -----------------


async def test_native_tool_runs_inside_run_model_and_repeats_with_it(rig: Rig) -> None:  # noqa: F811
    """A native tool (pydantic-ai's ``WebSearchTool``) is executed by the provider inside the
    model request: pydantic-ai cannot defer it, so it runs inside RunModel. Failed while it
    runs (held after the request, before its answer is committed): a worker kill repeats the
    request and the search with it (at-least-once); a server restart or a takeover within
    the lease lets the attempt go on (once), past it repeats it (twice). The turn completes
    with one answer either way."""
    rig.app = APP
    await declare(rig.client)
    victim = rig.worker(hold="run_model.before_commit")
    h = await rig.client.send("pai-native", "m", json.dumps({"query": "jetloop"}))
    await victim.wait_for("fault.hold", point="run_model.before_commit")
    assert await count(rig.vendor, "native_search") == 1
    await rig.fail(victim)
    res = await rig.client.wait(h, timeout=90)
    assert res.text == "found 3 pages about jetloop"
    searched = await count(rig.vendor, "native_search")
    asked = steps_asked(await rig.vendor.payload_counts("model_call"))
    assert searched == asked[0], "the native tool runs exactly as often as its model request"
    assert searched == 2 if rig.worker_killed else searched in (1, 2)
    snap = await rig.client.snapshot("m")
    assert snap is not None
    assert [e.role for e in snap.history] == ["user", "assistant"]
