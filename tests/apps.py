"""Agents for the tests: a model scripted by the user's message, and vendor-backed tools.

The user text is JSON: ``{"steps": [[{"tool": ..., "args": {...}}, ...], ...], "answer": s}``.
Model step k asks for the calls of ``steps[k]`` (all in parallel); after the last step it
answers ``answer`` followed by a JSON summary of the tool results it saw. Every model call
is logged at the vendor as op ``model_call`` so tests can count what a crash re-asked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from jetloop.agents import (
    Agent,
    App,
    Effect,
    Found,
    Limits,
    ModelRequest,
    ModelResponse,
    NotFound,
    ScriptedModel,
    TaskDone,
    TaskPending,
    ToolCallRequest,
    ToolContext,
    ask_user,
    delegate,
    served_elsewhere,
    task_tool,
    tool,
    wait,
)
from jetloop.demo.agent import current_turn
from jetloop.demo.vendor import Vendor
from jetloop.schemas.errors import ModelError, RetryableToolError, ToolError


def vendor() -> Vendor:
    return Vendor(Path(os.environ["JETLOOP_VENDOR_DB"]))


class Named(BaseModel):
    name: str


class Sized(BaseModel):
    size: int


class Slow(BaseModel):
    name: str
    seconds: float


async def latch(op: str, ctx: ToolContext) -> None:
    """With ``TEST_LATCH`` set (a file path), a request is opened at the vendor (logged as op
    ``<op>.open``) and held open until that file exists: a test fails the servers while the
    call is at the vendor, then lets it through, so the commit goes out during the outage."""
    path = os.environ.get("TEST_LATCH")
    if not path:
        return
    await vendor().note(f"{op}.open", ctx.idempotency_key, {"attempt": ctx.attempt})
    # Polls a file the test process creates (as jetloop/consumers/faults.py does): a stat,
    # no I/O wait.
    while not Path(path).exists():  # noqa: ASYNC110, ASYNC240
        await asyncio.sleep(0.02)


@tool(effect=Effect.IDEMPOTENT_WRITE)
async def write(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """An idempotent write: the vendor dedupes on the key."""
    await latch("write", ctx)
    return await vendor().write("write", ctx.idempotency_key, {"name": args.name})


@tool(effect=Effect.NON_IDEMPOTENT_WRITE)
async def once(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A single-attempt write at a vendor that does not dedupe."""
    await latch("once", ctx)
    return await vendor().write("once", ctx.idempotency_key, {"name": args.name}, dedupe=False)


@tool(effect=Effect.NON_IDEMPOTENT_WRITE)
async def once_held(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A single-attempt write held after the vendor made it: with ``TEST_HELD_LATCH`` set (a
    file path) the tool returns only once that file exists, so a test can fail the machine
    while the write is made and its outcome not yet committed (tests/test_power_loss.py)."""
    done = await vendor().write("once_held", ctx.idempotency_key, {"name": args.name}, dedupe=False)
    path = os.environ.get("TEST_HELD_LATCH")
    # Polls a file the test process creates, as ``latch`` does.
    while path and not Path(path).exists():  # noqa: ASYNC110, ASYNC240
        await asyncio.sleep(0.02)
    return done


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


@tool(effect=Effect.IDEMPOTENT_WRITE)
async def slow_reply(args: Slow, ctx: ToolContext) -> dict[str, Any]:
    """An idempotent write the vendor applies at once, whose reply then takes a while."""
    done = await vendor().write("slow_reply", ctx.idempotency_key, {"name": args.name})
    await asyncio.sleep(args.seconds)
    return done


class Task(BaseModel):
    name: str
    polls: int = 2


async def read_once(args: Named, ctx: ToolContext) -> Found | NotFound:
    """The reader of once_read: did the vendor apply this key?"""
    counts = await vendor().request_counts("once_read")
    if counts.get(ctx.idempotency_key):
        return Found({"name": args.name, "read_back": True})
    return NotFound()


@tool(effect=Effect.NON_IDEMPOTENT_WRITE, reader=read_once)
async def once_read(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A single-attempt write whose outcome can be read back by its key."""
    return await vendor().write("once_read", ctx.idempotency_key, {"name": args.name}, dedupe=False)


@tool(effect=Effect.IDEMPOTENT_WRITE)
async def flaky(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """Fails on its first two attempts (a transient error), then writes."""
    if ctx.attempt < 3:
        raise RetryableToolError(f"transient failure on attempt {ctx.attempt}")
    return await vendor().write("flaky", ctx.idempotency_key, {"name": args.name})


class Bag(BaseModel):
    data: Any = None


@tool(effect=Effect.READ)
async def meddler(args: Bag, ctx: ToolContext) -> dict[str, Any]:
    """Changes its arguments in place and fails the first time; says what it was given."""
    given = json.loads(json.dumps(args.data))
    if isinstance(args.data, dict):
        args.data["meddled"] = ctx.attempt
    if ctx.attempt < 2:
        raise RetryableToolError("fails once, after changing its arguments")
    return {"given": given}


@tool(effect=Effect.READ)
async def broken_read(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A read that always fails."""
    await vendor().note("broken_read", ctx.idempotency_key, {"attempt": ctx.attempt})
    raise RuntimeError("the vendor is down")


@tool(effect=Effect.IDEMPOTENT_WRITE)
async def broken_write(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A write that always fails."""
    await vendor().note("broken_write", ctx.idempotency_key, {"attempt": ctx.attempt})
    raise RuntimeError("the vendor is down")


@tool(effect=Effect.READ)
async def refuse(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """Fails in a way the model should see at once."""
    raise ToolError(f"no such thing as {args.name}")


@tool(effect=Effect.IDEMPOTENT_WRITE, approval=True)
async def guarded(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A write that always needs a person's approval."""
    return await vendor().write("guarded", ctx.idempotency_key, {"name": args.name})


@tool(effect=Effect.NON_IDEMPOTENT_WRITE, approval=lambda a: a.name.startswith("big"))
async def pay(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A payment: approval needed for big ones."""
    return await vendor().write("pay", ctx.idempotency_key, {"name": args.name}, dedupe=False)


@tool(effect=Effect.IDEMPOTENT_WRITE)
async def patient(args: Slow, ctx: ToolContext) -> dict[str, Any]:
    """Works for a while, stopping early when the turn is cancelled."""
    for _ in range(int(args.seconds * 20)):
        if ctx.cancelled:
            await vendor().note("patient_cancelled", ctx.idempotency_key, {"name": args.name})
            return {"stopped": True}
        await asyncio.sleep(0.05)
    return await vendor().write("patient", ctx.idempotency_key, {"name": args.name})


async def export_start(args: Task, ctx: ToolContext) -> dict[str, Any]:
    """Start an export job (the vendor dedupes on the key: one job per call)."""
    job = await vendor().write(
        "task_start", ctx.idempotency_key, {"name": args.name, "polls": args.polls}
    )
    return {"job": ctx.idempotency_key, "polls": job["polls"]}


async def export_poll(handle: dict[str, Any], ctx: ToolContext) -> TaskPending | TaskDone:
    await vendor().note("task_poll", handle["job"], {})
    seen = (await vendor().request_counts("task_poll")).get(handle["job"], 0)
    if seen >= handle["polls"]:
        return TaskDone({"job": handle["job"], "rows": 42})
    return TaskPending()


async def export_cancel(handle: dict[str, Any], ctx: ToolContext) -> None:
    await vendor().note("task_cancel", handle["job"], {})


export = task_tool(
    name="export",
    start=export_start,
    poll=export_poll,
    cancel=export_cancel,
    poll_interval=0.3,
)


async def script(req: ModelRequest) -> ModelResponse:
    if req.purpose == "summary":
        await vendor().note("summary_call", None, {"messages": len(req.messages)})
        if os.environ.get("TEST_BROKEN_SUMMARY") or any(
            "broken summary" in (m.text or "") for m in req.messages
        ):
            raise ModelError("the summary model is down")
        return ModelResponse(text=f"SUMMARY of {len(req.messages)} messages")
    turn = current_turn(req.messages)
    spec = json.loads(turn[0].text or "{}")
    k = sum(1 for m in turn if m.role == "assistant")
    await vendor().note(
        "model_call",
        None,
        {"turn": hashlib.sha1((turn[0].text or "").encode()).hexdigest()[:12], "step": k},
    )
    if spec.get("identify"):
        who = {"session_id": req.session_id, "turn_id": req.turn_id, "model_step": req.model_step}
        await vendor().note("model_identity", None, {**who, "step": k})
    if spec.get("fail_at_step") == k:
        raise ModelError(f"the model is down at step {k}")
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
    notes = [m.text for m in req.messages if m.role == "note"]
    summaries = [m.text for m in req.messages if m.role == "summary"]
    body = {"seen": seen, "notes": notes, "summaries": summaries, "messages": len(req.messages)}
    return ModelResponse(text=spec.get("answer", "done") + "\n" + json.dumps(body, sort_keys=True))


@tool(effect=Effect.IDEMPOTENT_WRITE, dedupe_window_seconds=1.0)
async def windowed(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A keyed write whose vendor remembers keys for one second only."""
    return await vendor().write("windowed", ctx.idempotency_key, {"name": args.name})


@tool(effect=Effect.READ)
async def whoami(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """The call's identity as its tool sees it."""
    return {
        "session_id": ctx.session_id,
        "turn_id": ctx.turn_id,
        "model_step": ctx.model_step,
        "call_id": ctx.call_id,
        "attempt": ctx.attempt,
    }


TOOLS = (
    meddler,
    whoami,
    write,
    once,
    once_held,
    read,
    big,
    slow,
    slow_reply,
    once_read,
    flaky,
    broken_read,
    broken_write,
    refuse,
    guarded,
    pay,
    windowed,
    patient,
    export,
    ask_user,
    wait,
    delegate,
)


def _tester(instructions: str = "Follow the script.", tools: tuple[Any, ...] = TOOLS) -> Agent:
    return Agent(
        name="tester",
        instructions=instructions,
        model=ScriptedModel(script),
        tools=tools,
        limits=Limits(max_model_steps=8),
    )


def _compactor(instructions: str = "Follow the script; summarise when asked.") -> Agent:
    return Agent(
        name="compactor",
        instructions=instructions,
        model=ScriptedModel(script),
        tools=TOOLS,
        limits=Limits(max_model_steps=8, context_budget_tokens=150),
    )


tester = _tester()
compactor = _compactor()
app = App([tester, compactor])

# The same agent after a deploy that removed the `write` tool (gates on resume).
reduced_app = App([_tester(tools=tuple(t for t in TOOLS if t.name != "write"))])


class Titled(BaseModel):
    title: str


@tool(effect=Effect.IDEMPOTENT_WRITE, name="write")
async def write_v2(args: Titled, ctx: ToolContext) -> dict[str, Any]:
    """v2 of ``write``: its arguments changed shape (``title``, not ``name``)."""
    return await vendor().write("write", ctx.idempotency_key, {"name": args.title})


@tool(effect=Effect.IDEMPOTENT_WRITE, name="export")
async def export_v2(args: Task, ctx: ToolContext) -> dict[str, Any]:
    """v2 of ``export``: a plain call now, no longer a task with polls."""
    return await vendor().write("export_call", ctx.idempotency_key, {"name": args.name})


# The same agents after a deploy that changed their instructions (the kill trials' `deploy`
# mode rolls their workers from one to the other and back).
app_v2 = App([_tester("Follow the script; v2."), _compactor("Follow the script; summarise; v2.")])

# A deploy of app v2 under turns in flight (docs/design.md, "Deploying new agent code"):
# `guarded` and `export` removed; `write` takes other arguments; `export` a plain call.
removed_app = App(
    [
        _tester(
            "Follow the script, v2.", tuple(t for t in TOOLS if t.name not in ("guarded", "export"))
        )
    ]
)
changed_app = App(
    [
        _tester(
            "Follow the script, v2.",
            tuple({"write": write_v2, "export": export_v2}.get(t.name, t) for t in TOOLS),
        )
    ]
)


@tool(effect=Effect.IDEMPOTENT_WRITE)
async def tenant_write(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A keyed write to a vendor every namespace shares (it dedupes on the key), with the
    namespace the tool was told it runs in."""
    return await vendor().write(
        "tenant_write", ctx.idempotency_key, {"name": args.name, "namespace": ctx.namespace}
    )


# An app a namespace is served by instead of the default one (JETLOOP_NAMESPACE_APPS): the
# tester's script, as an agent named `tenant`.
tenant_app = App(
    [
        Agent(
            name="tenant",
            instructions="Follow the script.",
            model=ScriptedModel(script),
            tools=(tenant_write,),
        )
    ]
)


# Tools served by a pool of their own (docs/agents.md, "Tools served by other workers"): the
# `sider` agent's front workers declare `side_once` and `side_guarded` without making them;
# the workers of pool `side` (``side_tools_app``) make them.
@tool(effect=Effect.NON_IDEMPOTENT_WRITE, name="side_once", pool="side")
async def side_once(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A single-attempt write made by the `side` pool's workers."""
    await latch("side_once", ctx)
    return await vendor().write(
        "side_once", ctx.idempotency_key, {"name": args.name, "pid": os.getpid()}, dedupe=False
    )


@tool(effect=Effect.IDEMPOTENT_WRITE, name="side_guarded", pool="side", approval=True)
async def side_guarded(args: Named, ctx: ToolContext) -> dict[str, Any]:
    """A write a person approves first, made by the `side` pool's workers."""
    return await vendor().write("side_guarded", ctx.idempotency_key, {"pid": os.getpid()})


def _sider(tools: tuple[Any, ...]) -> Agent:
    return Agent(
        name="sider", instructions="Follow the script.", model=ScriptedModel(script), tools=tools
    )


side_front_app = App(
    [
        _sider(
            (
                read,
                served_elsewhere(
                    name="side_once",
                    pool="side",
                    effect=Effect.NON_IDEMPOTENT_WRITE,
                    args_model=Named,
                ),
                served_elsewhere(
                    name="side_guarded",
                    pool="side",
                    effect=Effect.IDEMPOTENT_WRITE,
                    schema={"type": "object", "properties": {"name": {"type": "string"}}},
                ),
            )
        )
    ]
)
side_tools_app = App([_sider((read, side_once, side_guarded))])


# Tools made by the Node.js worker (workers/node, example/tools.js), pool `node`: the `sider`
# agent's front workers declare them and make only the Python read (tests/test_node_worker.py).
node_front_app = App(
    [
        _sider(
            (
                read,
                served_elsewhere(
                    name="node_lookup", pool="node", effect=Effect.READ, args_model=Named
                ),
                served_elsewhere(
                    name="node_keyed",
                    pool="node",
                    effect=Effect.IDEMPOTENT_WRITE,
                    args_model=Named,
                ),
                served_elsewhere(
                    name="node_append",
                    pool="node",
                    effect=Effect.NON_IDEMPOTENT_WRITE,
                    schema={
                        "type": "object",
                        "properties": {"name": {"type": "string"}},
                        "required": ["name"],
                    },
                ),
                # Approved by a person first: the Node worker's policy (example/tools.js).
                served_elsewhere(
                    name="node_guarded",
                    pool="node",
                    effect=Effect.IDEMPOTENT_WRITE,
                    args_model=Named,
                ),
                # A single-attempt write the Node worker reads back after a lost attempt.
                served_elsewhere(
                    name="node_checked",
                    pool="node",
                    effect=Effect.NON_IDEMPOTENT_WRITE,
                    args_model=Named,
                ),
                # A read whose result is `size` bytes.
                served_elsewhere(
                    name="node_big",
                    pool="node",
                    effect=Effect.READ,
                    schema={
                        "type": "object",
                        "properties": {"size": {"type": "integer"}},
                        "required": ["size"],
                    },
                ),
                # Works for `seconds`, stopping early once the turn is cancelled.
                served_elsewhere(
                    name="node_patient",
                    pool="node",
                    effect=Effect.IDEMPOTENT_WRITE,
                    args_model=Slow,
                ),
            )
        )
    ]
)

# The same declarations with `node_append` mislabelled: its vendor appends whatever the key,
# so made again after a crash it writes twice (a crash test must fail it).
node_mislabelled_app = App(
    [
        _sider(
            tuple(
                dataclasses.replace(t, effect=Effect.IDEMPOTENT_WRITE)
                if t.name == "node_append"
                else t
                for t in node_front_app.agents["sider"].tools
            )
        )
    ]
)
