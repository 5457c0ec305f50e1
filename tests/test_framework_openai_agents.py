"""OpenAI Agents SDK agents on jetloop (jetloop/agents/frameworks/openai_agents.py), end to end.

Real nats-server, real worker processes (``tests.apps_openai_agents:app``), the SDK's own
``OpenAIResponsesModel`` talking to the local fake of the OpenAI Responses API; no network.
The fake answers by the conversation it is sent (``Scripted``): the user's text is a JSON
script, as in tests/apps.py, and model step k (the assistant messages since the user's)
answers ``steps[k]``. Crash tests SIGKILL a worker mid model call or mid tool and judge the
crash-matrix semantics from the call records, the fake's requests and the vendor's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("agents", reason="the openai-agents extra is not installed")

from agents import (
    Agent,
    LocalShellTool,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    function_tool,
)
from aiohttp import web
from openai import AsyncOpenAI

from jetloop.agents import Effect, Message, ModelRequest
from jetloop.agents.adapters import MalformedToolCall
from jetloop.agents.frameworks.openai_agents import durable
from jetloop.demo.vendor import Vendor
from jetloop.schemas.errors import ProviderRejected, ProviderRetryable
from jetloop.services.client import Client
from jetloop.streams.registry import Registry
from tests.conftest import WorkerFactory, held_for_approval, until
from tests.fakes import Failure, FakeCall, FakeOpenAIChat, FakeOpenAIResponses, Raw, Reply, Stall
from tests.fakes.base import Outcome
from tests.test_matrix import Rig, rig  # noqa: F401  (the crash matrix's rig fixture)

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.apps_openai_agents:app"
AGENT = "oai-travel"
TRIAGE = "You help travellers; hand billing questions to the billing agent."
BILLING = "You answer billing questions."
TRIAGE_TOOLS = [
    "lookup",
    "book",
    "save",
    "refund",
    "pay",
    "web_search",
    "transfer_to_billing_agent",
]


def script(*steps: list[dict[str, Any]], answer: str = "done", **options: Any) -> str:
    """The user text that makes the fake model ask for these calls, step by step."""
    return json.dumps({"steps": list(steps), "answer": answer, **options})


def call(tool: str, **args: Any) -> dict[str, Any]:
    return {"tool": tool, "args": args}


class Scripted(FakeOpenAIResponses):
    """The fake OpenAI Responses server, answering from the script in the user's text.

    ``stall_at: k`` stalls the first request of step k (a model call in flight);
    ``search_at: k`` makes step k's response carry a ``web_search_call`` item: the provider
    ran the hosted web search inside that model call.
    """

    def __init__(self) -> None:
        super().__init__()
        self.asked: Counter[tuple[str, int]] = Counter()

    @staticmethod
    def position(body: dict[str, Any]) -> tuple[str, int]:
        items = body["input"]
        last = max(i for i, it in enumerate(items) if it.get("role") == "user")
        k = sum(1 for it in items[last + 1 :] if it.get("role") == "assistant")
        return items[last]["content"], k

    def plan(self, body: dict[str, Any]) -> Outcome:
        text, k = self.position(body)
        spec = json.loads(text)
        self.asked[(text, k)] += 1
        if spec.get("stall_at") == k and self.asked[(text, k)] == 1:
            return Stall()
        steps = spec.get("steps", [])
        if k < len(steps):
            calls = tuple(FakeCall(c["tool"], c.get("args", {})) for c in steps[k])
            reply = Reply(text=f"step {k}", calls=calls)
        else:
            reply = Reply(text=spec.get("answer", "done"))
        if spec.get("search_at") != k:
            return reply
        out = self.render(reply, body)
        search = {
            "type": "web_search_call",
            "id": self.new_id("ws_"),
            "status": "completed",
            "action": {"type": "search", "query": "weather in Paris"},
        }
        out["output"].insert(0, search)
        return Raw(out)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            outcome = self.plan(await request.json())
        except (ValueError, KeyError, TypeError):
            outcome = None  # not a scripted request: the base answers it (and checks it)
        self._outcomes.clear()
        if outcome is not None:
            self._outcomes.append(outcome)
        return await super()._handle(request)

    def requests_of(self, text: str) -> list[dict[str, Any]]:
        return [b for b in self.bodies if self.position(b)[0] == text]


def tool_names(body: dict[str, Any]) -> list[str]:
    return [t.get("name") or t["type"] for t in body.get("tools") or []]


@pytest.fixture
async def fake() -> AsyncIterator[Scripted]:
    async with Scripted() as f:
        yield f


@pytest.fixture
def oai_workers(workers: WorkerFactory, fake: Scripted) -> Iterator[WorkerFactory]:
    workers.env["TEST_OPENAI_AGENTS_URL"] = fake.base_url
    yield workers


async def declared(c: Client) -> None:
    """The app's agent declared, as a deploy does: a send before its worker is accepted."""
    await (await Registry.open(c.js)).declare([AGENT], "tests")


async def count(vendor: Vendor, op: str) -> int:
    return sum((await vendor.request_counts(op)).values())


def start(workers: WorkerFactory, name: str | None = None, **kw: Any) -> Any:
    return workers.start(name, app=APP, **kw)


async def held(
    workers: WorkerFactory, client: Client, point: str, text: str, session: str = "s"
) -> tuple[Any, Any]:
    victim = start(workers, hold=point)
    await declared(client)
    h = await client.send(AGENT, session, text)
    await victim.wait_for("fault.hold", point=point)
    return h, victim


# --- the wrapper, in process -----------------------------------------------------------------


def request(messages: list[Message], purpose: str = "answer") -> ModelRequest:
    return ModelRequest("x", "Summarise.", messages, [], attempt=1, purpose=purpose)


def handed_off(calls: list[Any], target: str) -> list[Message]:
    return [
        Message("user", "hello"),
        Message("assistant", "over to billing", calls=calls),
        Message(
            "tool",
            call_id="t-0-0",
            tool="transfer_to_billing_agent",
            status="ok",
            result={"assistant": target},
        ),
    ]


def sdk_agents(model: Any) -> tuple[Any, Any]:
    @function_tool
    async def lookup(city: str) -> str:
        """Look up a city's weather."""
        return f"sunny in {city}"

    @function_tool(needs_approval=True)
    async def refund(amount: int) -> str:
        """Refund an amount."""
        return "refunded"

    billing = Agent(name="Billing agent", instructions=BILLING, model=model, tools=[lookup])
    triage = Agent(
        name="Triage agent", instructions=TRIAGE, model=model, tools=[refund], handoffs=[billing]
    )
    return triage, billing


def test_the_sdk_is_an_extra_imported_only_by_the_wrapper() -> None:
    """The core (the public face, the worker, the CLI) runs without the SDK; the wrapper
    imports it as what it is, the top-level ``agents`` package."""
    code = (
        "import sys, jetloop, jetloop.agents.frameworks, jetloop.services.cli,"
        " jetloop.services.worker\n"
        "assert 'agents' not in sys.modules, 'the core imported the SDK'\n"
        "import agents, jetloop.agents.frameworks.openai_agents as w\n"
        "assert w.SdkAgent is agents.Agent and agents.__name__ == 'agents'\n"
        "print(agents.__file__)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).parent.name == "agents"
    assert not Path(out.stdout.strip()).is_relative_to(ROOT / "jetloop")


def test_wrapping_declares_effects_and_refuses_what_it_cannot_run() -> None:
    triage, _ = sdk_agents("gpt-fake")
    agent = durable(triage, effects={"lookup": Effect.READ})
    assert agent.name == "triage-agent" and agent.instructions == TRIAGE
    effects = {t.name: (t.effect, t.approval) for t in agent.tools}
    # Undeclared: a single-attempt write; a handoff: a read; needs_approval carried over.
    assert effects == {
        "refund": (Effect.NON_IDEMPOTENT_WRITE, True),
        "lookup": (Effect.READ, False),
        "transfer_to_billing_agent": (Effect.READ, False),
    }
    lookup = agent.tool("lookup")
    assert lookup is not None and lookup.json_schema()["required"] == ["city"]
    with pytest.raises(ValueError, match="effects name tools no agent has"):
        durable(triage, effects={"lokup": Effect.READ})
    shell = Agent(name="shell", tools=[LocalShellTool(executor=lambda req: "")])
    with pytest.raises(TypeError, match="LocalShellTool runs in the SDK's own loop"):
        durable(shell)
    with pytest.raises(TypeError, match="expected an OpenAI Agents SDK Agent"):
        durable(agent)


async def test_mcp_servers_are_served_by_jetloops_mcp_client(tmp_path: Path) -> None:
    """An agent's ``MCPServerStdio`` is no longer refused: its tools are jetloop tools with the
    effects of the server's annotations (``effects=`` over them), ``require_approval`` and an
    ``allowed_tool_names`` filter kept; the active agent's model is offered them as the SDK
    offers tools, and a call carries the key in ``_meta``; the SDK never connects itself."""
    from agents.items import ModelResponse as SdkResponse
    from agents.mcp import MCPServerStdio
    from agents.models.interface import Model
    from agents.usage import Usage
    from openai.types.responses import ResponseFunctionToolCall

    from jetloop.agents.model import ToolSpec
    from tests.apps_mcp import SERVER
    from tests.mcp_ledger import invocations

    class Offering(Model):
        offered: list[str] = []

        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            Offering.offered = [t.name for t in args[3]]
            call = ResponseFunctionToolCall(
                arguments='{"account": "a", "amount": 5}',
                call_id="c1",
                name="transfer",
                type="function_call",
            )
            return SdkResponse(output=[call], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    log = tmp_path / "log.jsonl"
    env = {"MCP_LEDGER_LOG": str(log), "MCP_LEDGER_STATE": str(tmp_path / "state.json")}
    server = MCPServerStdio(
        {"command": sys.executable, "args": [str(SERVER)], "env": env},
        name="ledger",
        require_approval={"always": {"tool_names": ["close_account"]}},
        tool_filter={"allowed_tool_names": ["balance", "transfer", "close_account"]},
    )
    sdk = Agent(name="bank", instructions="Pay.", model=Offering(), mcp_servers=[server])
    agent = durable(sdk, effects={"balance": Effect.IDEMPOTENT_WRITE})
    [mcp] = agent.mcp_servers
    try:
        tools = {t.name: t for t in await agent.list_tools()}
        assert {n: (t.effect, t.approval) for n, t in tools.items()} == {
            "balance": (Effect.IDEMPOTENT_WRITE, False),
            "transfer": (Effect.NON_IDEMPOTENT_WRITE, False),
            "close_account": (Effect.NON_IDEMPOTENT_WRITE, True),
        }
        specs = [ToolSpec(t.name, t.description, t.json_schema()) for t in tools.values()]
        asked = await agent.model.complete(
            ModelRequest("bank", "Pay.", [Message("user", "pay")], specs, 1)
        )
        assert sorted(Offering.offered) == sorted(tools)
        [c] = asked.tool_calls
        assert c.name == "transfer" and not isinstance(c, MalformedToolCall)

        class Ctx:
            idempotency_key, call_id, attempt, namespace = "key-1", "t1-0-0", 1, "default"

        tool = tools["transfer"]
        out = await tool.fn(tool.args_model.model_validate(c.arguments), Ctx())  # type: ignore[arg-type]
        assert out == "moved 5 out of a"
        assert [(i["tool"], i["key"]) for i in invocations(log)] == [("transfer", "key-1")]
        assert server.session is None, "the SDK never connected to the server itself"
    finally:
        await mcp.close()
    with pytest.raises(TypeError, match="allowed_tool_names"):
        durable(
            Agent(
                name="x",
                mcp_servers=[
                    MCPServerStdio({"command": "x"}, tool_filter={"blocked_tool_names": ["a"]})
                ],
            )
        )


async def test_chat_completions_model_conversation_and_errors() -> None:
    """The SDK's Chat Completions model: the handoff's result in the conversation makes the
    billing agent answer; the summary call has no tools; provider errors are classified."""
    async with FakeOpenAIChat() as chat:
        async with AsyncOpenAI(
            base_url=chat.base_url, api_key=chat.api_key, max_retries=0
        ) as client:
            triage, _ = sdk_agents(OpenAIChatCompletionsModel("gpt-fake", client))
            model = durable(triage, effects={"lookup": Effect.READ}).model
            chat.script(Reply(text="hi", calls=(FakeCall("transfer_to_billing_agent"),)))
            first = await model.complete(request([Message("user", "hello")]))
            assert [c.name for c in first.tool_calls] == ["transfer_to_billing_agent"]
            assert chat.bodies[0]["messages"][0] == {"role": "system", "content": TRIAGE}
            messages = handed_off(first.tool_calls, "Billing agent")
            chat.script(Reply(calls=(FakeCall("lookup", {"city": "Oslo"}), FakeCall("refund"))))
            second = await model.complete(request(messages))
            sent = chat.bodies[1]
            assert sent["messages"][0] == {"role": "system", "content": BILLING}
            assert [t["function"]["name"] for t in sent["tools"]] == ["lookup"]
            assert sent["messages"][-1]["content"] == '{"assistant": "Billing agent"}'
            lookup, refund = second.tool_calls
            assert lookup.arguments == {"city": "Oslo"} and not isinstance(
                lookup, MalformedToolCall
            )
            # The triage agent's tool, asked of the billing agent: refused, not run.
            assert isinstance(refund, MalformedToolCall) and "not available" in refund.problem
            chat.script(Reply(text="SUMMARY"))
            summary = await model.complete(request(messages, purpose="summary"))
            assert summary.text == "SUMMARY" and "tools" not in chat.bodies[2]
            chat.script(Failure(429, "slow down", "rate_limit_error"), Failure(400, "bad input"))
            with pytest.raises(ProviderRetryable):
                await model.complete(request(messages))
            with pytest.raises(ProviderRejected):
                await model.complete(request(messages))


async def test_handoffs_in_one_answer_and_per_turn_agents() -> None:
    """A second handoff in one answer is refused as the SDK refuses it; without
    ``sticky_handoffs`` a new turn starts at the first agent again."""
    async with FakeOpenAIResponses() as fake:
        async with AsyncOpenAI(
            base_url=fake.base_url, api_key=fake.api_key, max_retries=0
        ) as client:
            triage, _ = sdk_agents(OpenAIResponsesModel("gpt-fake", client))
            model = durable(triage, effects={"lookup": Effect.READ}, sticky_handoffs=False).model
            twice = FakeCall("transfer_to_billing_agent")
            fake.script(Reply(calls=(twice, twice)))
            answer = await model.complete(request([Message("user", "hello")]))
            first, second = answer.tool_calls
            assert not isinstance(first, MalformedToolCall)
            assert isinstance(second, MalformedToolCall) and "Multiple handoffs" in second.problem
            messages = handed_off(answer.tool_calls[:1], "Billing agent")
            fake.script(Reply(text="billing here"), Reply(text="triage again"))
            await model.complete(request(messages))
            await model.complete(
                request(
                    [*messages, Message("assistant", "billing here"), Message("user", "next turn")]
                )
            )
            assert [b["instructions"] for b in fake.bodies[1:]] == [BILLING, TRIAGE]


# --- a turn: tools, handoffs, hosted tools ------------------------------------------------


async def test_turn_runs_tools_and_hands_off(
    client: Client, oai_workers: WorkerFactory, fake: Scripted, vendor: Vendor
) -> None:
    start(oai_workers)
    await declared(client)
    text = script(
        [call("lookup", city="Paris"), call("transfer_to_billing_agent")],
        [call("invoice", number="A-1")],
        answer="billing done",
    )
    res = await client.wait(await client.send(AGENT, "t", text), timeout=60)
    assert res.text == "billing done"
    first, second, third = fake.requests_of(text)
    # Step 0 is the triage agent's: its instructions, its tools (the hosted web search too).
    assert first["instructions"] == TRIAGE
    assert tool_names(first) == TRIAGE_TOOLS
    # The handoff's result switched the active agent: steps 1 and 2 are the billing agent's.
    for later in (second, third):
        assert later["instructions"] == BILLING
        assert tool_names(later) == ["invoice"]
    outputs = [i["output"] for i in second["input"] if i.get("type") == "function_call_output"]
    assert outputs == ['{"city": "Paris", "weather": "sunny"}', '{"assistant": "Billing agent"}']
    assert await count(vendor, "lookup") == 1 and await count(vendor, "invoice") == 1
    # Each tool call was a CallTool step of its own, with the effect class declared for it.
    for index, (tool, effect) in enumerate(
        [("lookup", "read"), ("transfer_to_billing_agent", "read")]
    ):
        rec = await client.call("t", res.turn_id, 0, index)
        assert rec is not None and rec.tool == tool and rec.state == "succeeded"
        assert rec.effect == effect
    # The next turn starts with the agent the handoff chose (as the SDK's last_agent).
    text2 = script(answer="still billing")
    res2 = await client.wait(await client.send(AGENT, "t", text2), timeout=60)
    assert res2.text == "still billing"
    (fourth,) = fake.requests_of(text2)
    assert fourth["instructions"] == BILLING
    # The usage ledger names the SDK model every request went to.
    used = await client.usage("t")
    assert len(used) == 4 and {x.model for x in used} == {"gpt-fake"}, used


async def test_tool_of_another_agent_is_refused(
    client: Client, oai_workers: WorkerFactory, fake: Scripted, vendor: Vendor
) -> None:
    """The billing agent's tool asked for by the triage agent: refused (the model sees why)
    and never run, while the triage agent's own tool in the same answer runs."""
    start(oai_workers)
    await declared(client)
    text = script([call("invoice", number="A-1"), call("book", flight="X1")])
    res = await client.wait(await client.send(AGENT, "r", text), timeout=60)
    assert res.text == "done"
    rec = await client.call("r", res.turn_id, 0, 0)
    assert rec is not None and rec.state == "failed"
    assert rec.outcome is not None and "not available to this agent" in (rec.outcome.error or "")
    assert await count(vendor, "invoice") == 0
    assert await count(vendor, "book") == 1


async def test_approval_required_tools_wait_for_a_person(
    client: Client, oai_workers: WorkerFactory, fake: Scripted, vendor: Vendor
) -> None:
    """``needs_approval=True`` always waits; a callable policy waits when it says so."""
    start(oai_workers)
    await declared(client)
    text = script([call("refund", amount=30), call("pay", amount=5), call("pay", amount=500)])
    h = await client.send(AGENT, "a", text)

    async def two_waiting() -> Any:
        snap = await client.snapshot("a")
        return snap if snap is not None and len(snap.approvals) == 2 else None

    snap = await until(two_waiting)

    async def small_one_paid() -> bool:
        return await count(vendor, "pay") == 1

    # The small payment needed no approval and runs; the other two wait, not made.
    await until(small_one_paid)
    assert await count(vendor, "refund") == 0
    refund = await held_for_approval(client, "a", h.turn_id, 0, 0)
    big_pay = await held_for_approval(client, "a", h.turn_id, 0, 2)
    assert (refund.tool, big_pay.tool) == ("refund", "pay")
    ids = {a.approval_id for a in snap.approvals}
    assert ids == {refund.approval_id, big_pay.approval_id}
    await client.approve("a", refund.approval_id, by="test")
    await client.reject("a", big_pay.approval_id, by="test", reason="too much")
    res = await client.wait(h, timeout=60)
    assert res.text == "done"
    assert await count(vendor, "refund") == 1
    assert await count(vendor, "pay") == 1, "the rejected payment was never made"
    rec = await client.call("a", h.turn_id, 0, 2)
    assert rec is not None and rec.state == "denied"


# --- worker kills mid model call and mid tool ------------------------------------------------


async def test_worker_kill_mid_model_call_repeats_it(
    client: Client, oai_workers: WorkerFactory, fake: Scripted, vendor: Vendor
) -> None:
    """A worker SIGKILLed while its model request is at the provider: the RunModel step is
    run again by a new worker, the request is sent again, and the turn goes on."""
    victim = start(oai_workers)
    await declared(client)
    text = script([call("lookup", city="Paris")], stall_at=0)
    h = await client.send(AGENT, "m", text)

    async def in_flight() -> bool:
        return len(fake.requests_of(text)) == 1

    await until(in_flight)
    victim.kill()
    start(oai_workers, "survivor")
    res = await client.wait(h, timeout=60)
    assert res.text == "done"
    assert fake.asked[(text, 0)] == 2, "the model call was made again"
    assert fake.asked[(text, 1)] == 1
    assert await count(vendor, "lookup") == 1


async def test_worker_kill_mid_read_repeats_it(
    client: Client, oai_workers: WorkerFactory, fake: Scripted, vendor: Vendor
) -> None:
    text = script([call("lookup", city="Paris")])
    h, victim = await held(oai_workers, client, "call_tool.before_commit", text)
    assert await count(vendor, "lookup") == 1
    victim.kill()
    start(oai_workers, "survivor")
    res = await client.wait(h, timeout=60)
    assert res.text == "done"
    rec = await client.call("s", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 2
    # A READ is made again: the vendor saw the call twice, with one key.
    assert list((await vendor.request_counts("lookup")).values()) == [2]


async def test_worker_kill_mid_idempotent_write_repeats_it_with_the_same_key(
    client: Client, oai_workers: WorkerFactory, fake: Scripted, vendor: Vendor
) -> None:
    text = script([call("save", note="n")])
    h, victim = await held(oai_workers, client, "call_tool.before_commit", text)
    victim.kill()
    start(oai_workers, "survivor")
    await client.wait(h, timeout=60)
    rec = await client.call("s", h.turn_id, 0, 0)
    assert rec is not None and rec.state == "succeeded" and rec.attempts == 2
    assert list((await vendor.request_counts("save")).values()) == [2], "one key, sent twice"
    assert await vendor.effect_count("save") == 1, "the vendor deduped the repeat"


async def test_worker_kill_mid_undeclared_tool_is_outcome_unknown_never_twice(
    client: Client, oai_workers: WorkerFactory, fake: Scripted, vendor: Vendor
) -> None:
    """``book`` declares no effect: it is a single-attempt write. Killed after it ran, before
    its result was recorded, it is settled ``outcome_unknown`` and not made again."""
    text = script([call("book", flight="X1")])
    h, victim = await held(oai_workers, client, "call_tool.before_commit", text)
    assert await count(vendor, "book") == 1
    victim.kill()
    start(oai_workers, "survivor")
    res = await client.wait(h, timeout=60)
    assert res.text == "done"
    rec = await client.call("s", h.turn_id, 0, 0)
    assert rec is not None and rec.effect == "non_idempotent_write"
    assert (rec.state, rec.settlement, rec.attempts) == ("outcome_unknown", "outcome_unknown", 1)
    assert await count(vendor, "book") == 1, "a single-attempt write never runs twice"
    # The model was told the outcome is unknown.
    last = fake.requests_of(text)[-1]
    (output,) = [i["output"] for i in last["input"] if i.get("type") == "function_call_output"]
    assert output.startswith("Outcome unknown")


# --- a tool the framework cannot defer (a hosted tool) ---------------------------------------


async def test_hosted_tool_repeats_with_its_model_call(rig: Rig, fake: Scripted) -> None:  # noqa: F811
    """Crash-matrix row "a tool the framework cannot defer — while it runs": the provider ran
    the hosted web search inside the model call; the RunModel step is stopped after the call
    returned, before its output was recorded, then the column's failure. A lost attempt
    (worker kill) calls the model again, so the search runs again; a server failure within
    the lease may cost nothing (1 or 2)."""
    rig.workers.env["TEST_OPENAI_AGENTS_URL"] = fake.base_url
    rig.app = APP
    victim = rig.worker(hold="run_model.before_commit")
    await declared(rig.client)
    text = script(answer="sunny, found on the web", search_at=0)
    h = await rig.client.send(AGENT, "w", text)
    await victim.wait_for("fault.hold", point="run_model.before_commit")
    assert fake.asked[(text, 0)] == 1, "one search so far"
    await rig.fail(victim)
    res = await rig.client.wait(h, timeout=90)
    assert res.text == "sunny, found on the web"
    searches = fake.asked[(text, 0)]
    # Every request of the step offered the hosted tool, and each answer carried a search.
    assert all("web_search" in tool_names(b) for b in fake.requests_of(text))
    if rig.worker_killed:
        assert searches == 2, "the hosted tool ran again with its model call"
    else:
        assert searches in (1, 2)
    turn = await rig.client.turn("w", h.turn_id)
    assert turn is not None and turn.status == "completed"
