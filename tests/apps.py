"""Agents for the tests: a model scripted by the user's message, and vendor-backed tools.

The user text is JSON: ``{"steps": [[{"tool": ..., "args": {...}}, ...], ...], "answer": s}``.
Model step k asks for the calls of ``steps[k]`` (all in parallel); after the last step it
answers ``answer`` followed by a JSON summary of the tool results it saw. Every model call
is logged at the vendor as op ``model_call`` so tests can count what a crash re-asked.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from agents import (
    Agent,
    App,
    Effect,
    Limits,
    ModelRequest,
    ModelResponse,
    ScriptedModel,
    ToolCallRequest,
    ToolContext,
    tool,
)
from demo.agent import current_turn
from demo.vendor import Vendor


def vendor() -> Vendor:
    return Vendor(Path(os.environ["JETLOOP_VENDOR_DB"]))


class Named(BaseModel):
    name: str


class Sized(BaseModel):
    size: int


class Slow(BaseModel):
    name: str
    seconds: float


@tool(effect=Effect.IDEMPOTENT_WRITE)
async def write(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """An idempotent write: the vendor dedupes on the key."""
    return await vendor().write("write", ctx.idempotency_key, {"name": args.name})


@tool(effect=Effect.NON_IDEMPOTENT_WRITE)
async def once(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A single-attempt write at a vendor that does not dedupe."""
    return await vendor().write("once", ctx.idempotency_key, {"name": args.name}, dedupe=False)


@tool(effect=Effect.READ)
async def read(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A read: logged, changes nothing."""
    await vendor().note("read", ctx.idempotency_key, {"name": args.name})
    return {"name": args.name, "value": len(args.name)}


@tool(effect=Effect.READ)
async def big(args: Sized, ctx: ToolContext) -> str:
    """A read with a large result."""
    return "".join(chr(ord("a") + (i % 26)) for i in range(26)) * (args.size // 26) + "z" * (
        args.size % 26
    )


@tool(effect=Effect.IDEMPOTENT_WRITE)
async def slow(args: Slow, ctx: ToolContext) -> dict[str, Any]:
    """An idempotent write that takes a while."""
    await asyncio.sleep(args.seconds)
    return await vendor().write("slow", ctx.idempotency_key, {"name": args.name})


async def script(req: ModelRequest) -> ModelResponse:
    turn = current_turn(req.messages)
    spec = json.loads(turn[0].text or "{}")
    k = sum(1 for m in turn if m.role == "assistant")
    await vendor().note(
        "model_call",
        None,
        {"turn": hashlib.sha1((turn[0].text or "").encode()).hexdigest()[:12], "step": k},
    )
    steps = spec.get("steps", [])
    if k < len(steps):
        return ModelResponse(
            text=f"step {k}",
            tool_calls=[
                ToolCallRequest(name=c["tool"], arguments=c.get("args", {})) for c in steps[k]
            ],
        )
    seen = []
    for m in turn:
        if m.role != "tool":
            continue
        r = m.result
        if isinstance(r, str) and len(r) > 1000:
            r = {"len": len(r), "sha256": hashlib.sha256(r.encode()).hexdigest()}
        seen.append({"tool": m.tool, "status": m.status, "result": r, "error": m.text})
    return ModelResponse(text=spec.get("answer", "done") + "\n" + json.dumps(seen, sort_keys=True))


tester = Agent(
    name="tester",
    instructions="Follow the script.",
    model=ScriptedModel(script),
    tools=(write, once, read, big, slow),
    limits=Limits(max_model_steps=8),
)

app = App([tester])
