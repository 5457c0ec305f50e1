"""The benchmark app (``jetloop.tooling.bench.app:app``): a zero-latency scripted model,
no-op tools.

Agent ``bench``: its model answers at once, without I/O. A user message ``fan <n>`` makes
model step 0 ask for ``n`` parallel calls of the no-op tool ``noop`` and model step 1 answer
(``fan 5`` is the 7-step turn: a model step, five tool steps, a model step); any other
message is answered by model step 0 (a one-model-step turn). Agent ``parked`` asks for one
call that waits: ``approve`` (a tool that needs approval) or ``timer_at <epoch>`` (the
built-in durable timer), for the waiting-at-scale benchmark.

What remains of a turn's latency with this app is the engine and JetStream.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel

from jetloop.agents import (
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
    wait,
)


class NoArgs(BaseModel):
    """A no-op tool takes nothing."""


@tool(effect=Effect.READ)
async def noop(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    """Does nothing and returns at once."""
    return {"ok": True}


@tool(effect=Effect.IDEMPOTENT_WRITE, approval=True)
async def approved_noop(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    """Does nothing, once a person approved it."""
    return {"ok": True}


def _user_text(req: ModelRequest) -> str:
    # The current turn starts at the last user message; only it matters to the script.
    for m in reversed(req.messages):
        if m.role == "user":
            return m.text or ""
    return ""


def _answered_calls(req: ModelRequest) -> bool:
    """Has the model of this turn already asked for calls (is this model step 1)?"""
    for m in reversed(req.messages):
        if m.role == "user":
            return False
        if m.role == "assistant" and m.calls:
            return True
    return False


def fan_script(req: ModelRequest) -> ModelResponse:
    """``fan <n>``: n no-op calls, then an answer; anything else: an answer at once."""
    words = _user_text(req).split()
    if len(words) == 2 and words[0] == "fan" and not _answered_calls(req):
        calls = [ToolCallRequest(name="noop", arguments={}) for _ in range(int(words[1]))]
        return ModelResponse(text="calling", tool_calls=calls)
    return ModelResponse(text="ok")


def parked_script(req: ModelRequest) -> ModelResponse:
    """``approve``: one call held for approval; ``timer_at <epoch>``: one durable timer due
    at that wall-clock time (so that many sessions come due together)."""
    if _answered_calls(req):
        return ModelResponse(text="released")
    words = _user_text(req).split()
    if words and words[0] == "timer_at":
        seconds = max(0.0, float(words[1]) - time.time())
        return ModelResponse(
            text="waiting", tool_calls=[ToolCallRequest("wait", {"seconds": seconds})]
        )
    return ModelResponse(text="asking", tool_calls=[ToolCallRequest("approved_noop", {})])


bench = Agent(
    name="bench",
    instructions="Benchmark: answer at once.",
    model=ScriptedModel(fan_script),
    tools=(noop,),
    limits=Limits(max_model_steps=4),
)

parked = Agent(
    name="parked",
    instructions="Benchmark: wait for a person or a timer.",
    model=ScriptedModel(parked_script),
    tools=(approved_noop, wait),
    limits=Limits(max_model_steps=4),
)

app = App([bench, parked])
