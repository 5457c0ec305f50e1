"""OpenAI Agents SDK agents for the tests, run by worker processes
(``--app tests.apps_openai_agents:app``).

The agents are plain SDK agents: a triage agent with function tools, a hosted web search and
a handoff to a billing agent (other instructions, other tools). Their model is the SDK's
``OpenAIResponsesModel`` on an ``AsyncOpenAI`` client whose base URL is the test's fake
OpenAI server (``TEST_OPENAI_AGENTS_URL``); the tools log every execution at the vendor
(``JETLOOP_VENDOR_DB``), so a test counts what a crash repeated.
"""

from __future__ import annotations

import os
from typing import Any

from agents import Agent, OpenAIResponsesModel, RunContextWrapper, WebSearchTool, function_tool
from openai import AsyncOpenAI

from jetloop.agents import App, Effect
from jetloop.agents.frameworks.openai_agents import durable
from tests.apps import vendor

URL = os.environ.get("TEST_OPENAI_AGENTS_URL", "http://127.0.0.1:9/v1")
API_KEY = "sk-fake-0123456789"

# No retries in the client: the engine retries a failed model step (one retry loop).
client = AsyncOpenAI(base_url=URL, api_key=API_KEY, max_retries=0)
model = OpenAIResponsesModel(model="gpt-fake", openai_client=client)


@function_tool
async def lookup(ctx: RunContextWrapper[Any], city: str) -> dict[str, Any]:
    """Look up a city's weather (a read)."""
    await vendor().note("lookup", ctx.context.idempotency_key, {"city": city})
    return {"city": city, "weather": "sunny"}


@function_tool
async def book(ctx: RunContextWrapper[Any], flight: str) -> dict[str, Any]:
    """Book a flight at a vendor that does not dedupe (no effect declared: a single-attempt
    write)."""
    key = ctx.context.idempotency_key
    return await vendor().write("book", key, {"name": flight}, dedupe=False)


@function_tool
async def save(ctx: RunContextWrapper[Any], note: str) -> dict[str, Any]:
    """Save a note at a vendor that dedupes on the idempotency key."""
    return await vendor().write("save", ctx.context.idempotency_key, {"name": note})


@function_tool(needs_approval=True)
async def refund(ctx: RunContextWrapper[Any], amount: int) -> dict[str, Any]:
    """Refund an amount: a person approves every refund."""
    key = ctx.context.idempotency_key
    return await vendor().write("refund", key, {"name": str(amount)}, dedupe=False)


async def big_payment(ctx: Any, params: dict[str, Any], call_id: str) -> bool:
    return bool(params.get("amount", 0) >= 100)


@function_tool(needs_approval=big_payment)
async def pay(ctx: RunContextWrapper[Any], amount: int) -> dict[str, Any]:
    """Pay an amount: a person approves payments of 100 or more."""
    key = ctx.context.idempotency_key
    return await vendor().write("pay", key, {"name": str(amount)}, dedupe=False)


@function_tool
async def invoice(ctx: RunContextWrapper[Any], number: str) -> dict[str, Any]:
    """Read an invoice (the billing agent's tool)."""
    await vendor().note("invoice", ctx.context.idempotency_key, {"number": number})
    return {"number": number, "total": 42}


billing = Agent(
    name="Billing agent",
    instructions="You answer billing questions.",
    model=model,
    tools=[invoice],
)

triage = Agent(
    name="Triage agent",
    instructions="You help travellers; hand billing questions to the billing agent.",
    model=model,
    tools=[lookup, book, save, refund, pay, WebSearchTool()],
    handoffs=[billing],
)

EFFECTS = {
    "lookup": Effect.READ,
    "save": Effect.IDEMPOTENT_WRITE,
    "refund": Effect.IDEMPOTENT_WRITE,
    "invoice": Effect.READ,
}

travel = durable(triage, name="oai-travel", effects=EFFECTS)

app = App([travel])
