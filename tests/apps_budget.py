"""Agents with budgets, for worker processes: ``--app tests.apps_budget:app``.

Their scripted model is priced as ``gpt-4o-mini`` and reports 100 input and 20 output tokens
for every answer. A message that starts with ``loop`` makes it call ``look`` at every model
step, for ever (only a cap ends the turn); any other message is answered at once, with
``seen: <the notes it was given>`` so a test reads what the model was told.
"""

from __future__ import annotations

from pydantic import BaseModel

from jetloop.agents import (
    Agent,
    App,
    Budget,
    Effect,
    Limits,
    ModelRequest,
    ModelResponse,
    ScriptedModel,
    ToolCallRequest,
    ToolContext,
    tool,
)

USAGE = {"input_tokens": 100, "output_tokens": 20}


class Nothing(BaseModel):
    pass


@tool(effect=Effect.READ)
async def look(args: Nothing, ctx: ToolContext) -> str:
    """Look around."""
    return "nothing new"


def answer(req: ModelRequest) -> ModelResponse:
    users = [m for m in req.messages if m.role == "user"]
    if (users[-1].text or "").startswith("loop"):
        return ModelResponse(tool_calls=[ToolCallRequest("look", {})], usage=dict(USAGE))
    notes = [m.text or "" for m in req.messages if m.role == "note"]
    return ModelResponse(text="seen: " + " | ".join(notes), usage=dict(USAGE))


class PricedModel(ScriptedModel):
    model = "gpt-4o-mini"


app = App(
    [
        Agent(
            name="capped",
            instructions="Look until stopped.",
            model=PricedModel(answer),
            tools=(look,),
            limits=Limits(turn_budget=Budget(tokens=250)),
        ),
        Agent(
            name="thrifty",
            instructions="Answer.",
            model=PricedModel(answer),
            tools=(look,),
            # One call costs $0.000027 (100 × 0.15 + 20 × 0.60 per million): two fit.
            limits=Limits(session_budget=Budget(cost_usd=0.000055)),
        ),
    ]
)
