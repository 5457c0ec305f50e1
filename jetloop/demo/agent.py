"""The demo agent: a deterministic scripted model and ticketing tools, fully offline.

The model reads the user's message as clauses separated by ";", " and " or " and then ":

    create ticket <title>        → create_ticket   (idempotent write)
    look up <T-n> / get <T-n>    → get_ticket      (read)
    comment on <T-n>: <text>     → add_comment     (idempotent write)
    close <T-n>                  → close_ticket    (idempotent write, needs approval)
    list tickets                 → list_tickets    (read)
    ask <question>               → ask_user        (waits for your answer)
    wait <n> seconds             → wait            (a durable timer)

Clauses joined by ";" or " and " are calls of one model step, run in parallel; " and then "
starts the next step, made once the calls before are back (so "create ticket X and then list
tickets" lists the new ticket). When every step's results are back the model answers with a
summary. Anything else is answered directly.

Each namespace has a ticketing vendor of its own (``vendor(ctx.namespace)``): one `jetloop
up` serves every namespace with this app, and a tenant must never list, read or comment on
another's tickets.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from jetloop.agents import (
    Agent,
    App,
    Effect,
    Message,
    ModelAdapter,
    ModelRequest,
    ModelResponse,
    ScriptedModel,
    ToolCallRequest,
    ToolContext,
    adapter_from_spec,
    ask_user,
    tool,
    wait,
)
from jetloop.demo.vendor import Vendor, namespaced
from jetloop.schemas.errors import ToolError
from jetloop.schemas.ids import DEFAULT_NAMESPACE


def vendor(namespace: str = DEFAULT_NAMESPACE) -> Vendor:
    """The ticketing vendor of ``namespace``: its own database beside the default one's."""
    base = Path(os.environ.get("JETLOOP_VENDOR_DB", ".jetloop/vendor.sqlite"))
    return Vendor(namespaced(base, namespace))


class TicketRef(BaseModel):
    ticket: str


class NewTicket(BaseModel):
    title: str


class NewComment(BaseModel):
    ticket: str
    body: str


class NoArgs(BaseModel):
    pass


@tool(effect=Effect.READ)
async def get_ticket(args: TicketRef, ctx: ToolContext) -> dict[str, Any]:
    """Read one ticket with its comments."""
    found = await vendor(ctx.namespace).read_ticket(args.ticket)
    if found is None:
        raise ToolError(f"no ticket {args.ticket}")
    return found


@tool(effect=Effect.READ)
async def list_tickets(args: NoArgs, ctx: ToolContext) -> list[dict[str, Any]]:
    """List every ticket."""
    return await vendor(ctx.namespace).list_tickets()


@tool(effect=Effect.IDEMPOTENT_WRITE)
async def create_ticket(args: NewTicket, ctx: ToolContext) -> dict[str, Any]:
    """Open a ticket."""
    return await vendor(ctx.namespace).write(
        "create_ticket", ctx.idempotency_key, args.model_dump()
    )


@tool(effect=Effect.IDEMPOTENT_WRITE)
async def add_comment(args: NewComment, ctx: ToolContext) -> dict[str, Any]:
    """Comment on a ticket."""
    return await vendor(ctx.namespace).write("add_comment", ctx.idempotency_key, args.model_dump())


@tool(effect=Effect.IDEMPOTENT_WRITE, approval=True)
async def close_ticket(args: TicketRef, ctx: ToolContext) -> dict[str, Any]:
    """Close a ticket."""
    return await vendor(ctx.namespace).write("close_ticket", ctx.idempotency_key, args.model_dump())


PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^(?:create|open) (?:a )?ticket:?\s+(?P<title>.+)$", re.I), "create_ticket"),
    (re.compile(r"^(?:look ?up|get|show)\s+(?:ticket\s+)?(?P<ticket>T-\d+)$", re.I), "get_ticket"),
    (re.compile(r"^comment on (?P<ticket>T-\d+):\s*(?P<body>.+)$", re.I), "add_comment"),
    (re.compile(r"^close\s+(?:ticket\s+)?(?P<ticket>T-\d+)$", re.I), "close_ticket"),
    (re.compile(r"^list(?: the)? tickets$", re.I), "list_tickets"),
    (re.compile(r"^ask (?:me )?(?P<question>.+)$", re.I), "ask_user"),
    (re.compile(r"^wait (?P<seconds>\d+(?:\.\d+)?) ?s(?:ec(?:ond)?s?)?$", re.I), "wait"),
]


def steps(text: str) -> list[list[ToolCallRequest]]:
    """The calls of each model step: the parts of ``text`` between " and then ", each part's
    clauses made at once (``plan``); parts that ask for nothing are left out."""
    return [calls for part in re.split(r"\band then\b", text) if (calls := plan(part))]


def plan(text: str) -> list[ToolCallRequest]:
    calls = []
    for clause in re.split(r";|\band\b", text):
        clause = clause.strip().rstrip(".")
        for pattern, name in PATTERNS:
            m = pattern.match(clause)
            if m:
                calls.append(ToolCallRequest(name=name, arguments=m.groupdict()))
                break
    return calls


def current_turn(messages: list[Message]) -> list[Message]:
    """The messages since the last user message (that message included)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user":
            return messages[i:]
    return []


def script(req: ModelRequest) -> ModelResponse:
    turn = current_turn(req.messages)
    if not turn:
        return ModelResponse(text="Hello! Ask me to create, look up, comment on or close tickets.")
    results = [m for m in turn if m.role == "tool"]
    planned = steps(turn[0].text or "")
    made = sum(1 for m in turn if m.role == "assistant" and m.calls)
    if made < len(planned):
        calls = planned[made]
        return ModelResponse(text=f"Working on {len(calls)} request(s).", tool_calls=calls)
    if not results:
        return ModelResponse(
            text=f"You said: {turn[0].text}. Try: 'create ticket printer on fire; list tickets'."
        )
    lines = []
    for r in results:
        if r.status == "ok":
            lines.append(f"- {r.tool}: {json.dumps(r.result, sort_keys=True)}")
        else:
            lines.append(f"- {r.tool} {r.status}: {r.text}")
    return ModelResponse(text="Done.\n" + "\n".join(lines))


def demo_model() -> ModelAdapter:
    """The scripted model, or a real provider when JETLOOP_MODEL names one."""
    from jetloop.services.settings import load_settings

    s = load_settings()
    if s.model is None:
        # Its calls counted in the usage ledger with estimated tokens (ScriptedModel), no price.
        return ScriptedModel(script, model="demo-scripted")
    return adapter_from_spec(s.model, api_key=s.model_api_key, base_url=s.model_base_url)


demo_agent = Agent(
    name="demo",
    instructions=(
        "You help people with their tickets: create, look up, comment on, close and list "
        "them with the tools you have. Ask the user when something is unclear."
    ),
    model=demo_model(),
    tools=(get_ticket, list_tickets, create_ticket, add_comment, close_ticket, ask_user, wait),
)

app = App([demo_agent])
