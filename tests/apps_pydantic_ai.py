"""pydantic-ai agents for the tests, served by real workers (``--app tests.apps_pydantic_ai:app``).

Each is a plain ``pydantic_ai.Agent`` on pydantic-ai's own ``FunctionModel``, wrapped by
``durable`` with effect declarations and nothing else. The model function decides from the
messages alone, so any worker process answers the same: the user text is the JSON script of
tests/conftest.py (``script(...)``): model step k asks for the calls of ``steps[k]``; after the
last step it answers ``answer``, a newline, and a JSON body of what it saw. Every model call is
logged at the vendor as op ``model_call`` ({"turn", "step"}) so tests count what a crash re-asked.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import ModelRetry, RunContext
from pydantic_ai.capabilities import NativeTool
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    NativeToolCallPart,
    NativeToolReturnPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.native_tools import WebSearchTool

from jetloop.agents import App, Effect, Limits
from jetloop.agents.frameworks.pydantic_ai import durable, tool_context
from jetloop.demo.vendor import Vendor

DEPS = "deps-of-the-test"


def vendor() -> Vendor:
    return Vendor(Path(os.environ["JETLOOP_VENDOR_DB"]))


def turn_of(messages: list[ModelMessage]) -> tuple[dict[str, Any], list[ModelMessage]]:
    """The current turn: its script, and the messages since its user message."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if not isinstance(m, ModelRequest):
            continue
        for p in m.parts:
            if isinstance(p, UserPromptPart) and isinstance(p.content, str):
                try:
                    spec = json.loads(p.content)
                except ValueError:
                    continue
                if isinstance(spec, dict):
                    return spec, messages[i:]
    raise AssertionError("no scripted user message")


def prompts(messages: list[ModelMessage]) -> list[str]:
    """Every user prompt the model was shown, oldest first (the history across turns)."""
    return [
        p.content
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, UserPromptPart) and isinstance(p.content, str)
    ]


async def note_call(spec_text: str, step: int) -> None:
    digest = hashlib.sha1(spec_text.encode()).hexdigest()[:12]
    await vendor().note("model_call", None, {"turn": digest, "step": step})


async def latch() -> None:
    """With ``TEST_MODEL_LATCH`` set (a file path), the model call is logged at the vendor as
    ``model_call.open`` and held open until that file exists: a test kills the worker while
    pydantic-ai's ``Model.request`` is in progress."""
    path = os.environ.get("TEST_MODEL_LATCH")
    if not path:
        return
    await vendor().note("model_call.open", None, {})
    # Polls a file the test process creates (as tests/apps.py does): a stat, no I/O wait.
    while not Path(path).exists():  # noqa: ASYNC110, ASYNC240
        await asyncio.sleep(0.02)


async def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The model of ``pai``: runs the script, then reports what it saw."""
    spec, turn = turn_of(messages)
    k = sum(1 for m in turn if isinstance(m, ModelResponse))
    await note_call(json.dumps(spec, sort_keys=True), k)
    await latch()
    steps = spec.get("steps", [])
    if k < len(steps):
        return ModelResponse(
            parts=[
                TextPart(f"step {k}"),
                *[ToolCallPart(c["tool"], c.get("args", {})) for c in steps[k]],
            ]
        )
    seen = [
        {"tool": p.tool_name, "content": p.content}
        for m in turn
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]
    body = {
        "seen": seen,
        "prompts": prompts(messages),
        "instructions": info.instructions,
        "tools": sorted(t.name for t in info.function_tools),
    }
    return ModelResponse(
        parts=[TextPart(spec.get("answer", "done") + "\n" + json.dumps(body, sort_keys=True))]
    )


pai = PydanticAgent(
    FunctionModel(scripted),
    name="pai",
    instructions="Follow the script.",
    deps_type=str,
)


@pai.tool
async def lookup(ctx: RunContext[str], name: str) -> dict[str, Any]:
    """A read: logged at the vendor, changes nothing; shows the deps it was given."""
    call = tool_context()
    await vendor().note("read", call.idempotency_key, {"name": name})
    return {"name": name, "deps": ctx.deps, "tool_call_id": ctx.tool_call_id}


@pai.tool_plain
async def write(name: str) -> dict[str, Any]:
    """An idempotent write: the vendor dedupes on the key."""
    return await vendor().write("write", tool_context().idempotency_key, {"name": name})


@pai.tool_plain
async def once(name: str) -> dict[str, Any]:
    """A write at a vendor that does not dedupe; not declared, so made at most once."""
    key = tool_context().idempotency_key
    return await vendor().write("once", key, {"name": name}, dedupe=False)


@pai.tool_plain(requires_approval=True)
async def refund(order: str, cents: int) -> dict[str, Any]:
    """A refund: always needs a person's approval."""
    key = tool_context().idempotency_key
    return await vendor().write("refund", key, {"order": order, "cents": cents})


@pai.tool_plain
async def pay(name: str, cents: int) -> dict[str, Any]:
    """A payment: big ones need approval (declared to the wrapper)."""
    key = tool_context().idempotency_key
    return await vendor().write("pay", key, {"name": name, "cents": cents})


@pai.tool_plain
async def picky(n: int) -> int:
    """Refuses negative numbers the way pydantic-ai tools do: ModelRetry."""
    if n < 0:
        raise ModelRetry(f"{n} is negative; give a positive number")
    return n * 2


class Forecast(BaseModel):
    city: str
    temp: int


async def forecast_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The model of ``pai-typed``: looks the city up, then answers through the output tool."""
    spec, turn = turn_of(messages)
    k = sum(1 for m in turn if isinstance(m, ModelResponse))
    await note_call(json.dumps(spec, sort_keys=True), k)
    if k == 0:
        return ModelResponse(parts=[ToolCallPart("lookup", {"name": spec["city"]})])
    [out] = [t.name for t in info.output_tools]
    return ModelResponse(parts=[ToolCallPart(out, {"city": spec["city"], "temp": 21})])


typed = PydanticAgent(FunctionModel(forecast_model), name="pai-typed", output_type=Forecast)
typed.tool(lookup)


async def search_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The model of ``pai-native``: its provider runs the native web search inside the request
    (logged at the vendor as ``native_search``), then answers; pydantic-ai cannot defer it."""
    spec, turn = turn_of(messages)
    k = sum(1 for m in turn if isinstance(m, ModelResponse))
    await note_call(json.dumps(spec, sort_keys=True), k)
    assert [t.kind for t in info.model_request_parameters.native_tools] == ["web_search"]
    await vendor().note("native_search", None, {"query": spec["query"]})
    return ModelResponse(
        parts=[
            NativeToolCallPart("web_search", {"query": spec["query"]}, tool_call_id="ws1"),
            NativeToolReturnPart("web_search", {"hits": 3}, tool_call_id="ws1"),
            TextPart(f"found 3 pages about {spec['query']}"),
        ]
    )


searcher = PydanticAgent(
    FunctionModel(search_model),
    name="pai-native",
    capabilities=[NativeTool(WebSearchTool())],
)

app = App(
    [
        durable(
            pai,
            effects={
                "lookup": Effect.READ,
                "picky": Effect.READ,
                "write": Effect.IDEMPOTENT_WRITE,
                "refund": Effect.IDEMPOTENT_WRITE,
                "pay": Effect.IDEMPOTENT_WRITE,
            },
            approvals={"pay": lambda args: args["cents"] > 100},
            deps=DEPS,
            limits=Limits(max_model_steps=8),
        ),
        durable(typed, effects={"lookup": Effect.READ}, deps=DEPS),
        durable(searcher),
    ]
)
