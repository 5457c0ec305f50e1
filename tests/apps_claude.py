"""A Claude Agent SDK agent for worker processes: ``--app tests.apps_claude:app``.

An SDK agent as its user writes it (``ClaudeAgentOptions`` with an in-process MCP server of
``@tool`` functions and the built-in ``Bash``), made durable by ``durable_claude`` with one
effect declaration per tool. Its CLI talks to the test's fake Anthropic server
(``CLAUDE_FAKE_URL``, ``CLAUDE_FAKE_KEY``) with every kind of traffic but the model's off,
and a home of its own (``CLAUDE_HOME``). The tools log at the demo vendor
(``JETLOOP_VENDOR_DB``), so a test counts what ran.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from claude_agent_sdk import ClaudeAgentOptions, create_sdk_mcp_server, tool

from jetloop.agents import Agent, App, Effect
from jetloop.agents.frameworks.claude import call_context, durable_claude
from jetloop.demo.vendor import Vendor


def vendor() -> Vendor:
    return Vendor(Path(os.environ["JETLOOP_VENDOR_DB"]))


@tool("charge", "Charge the customer's card (the vendor does not dedupe).", {"amount": int})
async def charge(args: dict[str, Any]) -> dict[str, Any]:
    ctx = call_context()
    done = await vendor().write(
        "charge", ctx.idempotency_key, {"amount": args["amount"]}, dedupe=False
    )
    return {"content": [{"type": "text", "text": f"charged {done['amount']}"}]}


@tool("book", "Book a slot (the vendor dedupes on the key).", {"slot": str})
async def book(args: dict[str, Any]) -> dict[str, Any]:
    ctx = call_context()
    done = await vendor().write("book", ctx.idempotency_key, {"slot": args["slot"]})
    return {"content": [{"type": "text", "text": f"booked {done['slot']}"}]}


@tool("refund", "Refund an order (a person approves each refund).", {"order": str})
async def refund(args: dict[str, Any]) -> dict[str, Any]:
    ctx = call_context()
    await vendor().write("refund", ctx.idempotency_key, {"order": args["order"]}, dedupe=False)
    return {"content": [{"type": "text", "text": f"refunded {args['order']}"}]}


@tool("lookup", "Look an order up.", {"order": str})
async def lookup(args: dict[str, Any]) -> dict[str, Any]:
    await vendor().note("lookup", call_context().idempotency_key, {"order": args["order"]})
    return {"content": [{"type": "text", "text": f"order {args['order']} is paid"}]}


@tool("stock", "Count an item in the stockroom.", {"item": str})
async def stock(args: dict[str, Any]) -> dict[str, Any]:
    """Run by the CLI inside the segment (``inline``): at-least-once. With ``CLAUDE_GATE``
    set (a file path) it waits for that file after logging, so a test can fail it midway."""
    await vendor().note("stock", None, {"item": args["item"]})
    gate = os.environ.get("CLAUDE_GATE")
    # Polls a file the test process creates (as tests/apps.py's latch does).
    while gate and not Path(gate).exists():  # noqa: ASYNC110, ASYNC240
        await asyncio.sleep(0.02)
    return {"content": [{"type": "text", "text": f"{args['item']}: 4 left"}]}


def options() -> ClaudeAgentOptions:
    home = os.environ.get("CLAUDE_HOME", "/tmp/jetloop-claude-home")
    Path(home).mkdir(parents=True, exist_ok=True)
    shop = create_sdk_mcp_server("shop", tools=[charge, book, refund, lookup, stock])
    return ClaudeAgentOptions(
        model="claude-sonnet-4-5",
        system_prompt="You run a shop.",
        tools=["Bash"],
        allowed_tools=["Bash", "mcp__shop__stock"],
        mcp_servers={"shop": shop},
        cwd=home,
        env={
            "ANTHROPIC_BASE_URL": os.environ.get("CLAUDE_FAKE_URL", ""),
            "ANTHROPIC_API_KEY": os.environ.get("CLAUDE_FAKE_KEY", ""),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "HOME": home,
            "CLAUDE_CONFIG_DIR": str(Path(home) / ".claude"),
        },
    )


def make_agent() -> Agent:
    """The wrapper and the effect declarations: the only lines jetloop adds to the SDK agent
    (options are read from the environment when this is called)."""
    return durable_claude(
        "claude_shop",
        options(),
        tools={"shop": [charge, book, refund, lookup, stock]},
        inline={"stock"},  # run by the CLI inside the segment, not deferred
        effects={"book": Effect.IDEMPOTENT_WRITE, "lookup": Effect.READ},  # charge: undeclared
        approval={"refund": True},  # AwaitToolApproval before each refund
    )


shop_agent = make_agent()

app = App([shop_agent])
