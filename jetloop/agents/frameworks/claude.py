"""Claude Agent SDK agents, run durably: a turn is a chain of *segments*, one per RunModel step.

A segment is one run of the SDK's ``query`` (its bundled Claude Code CLI) inside one RunModel
step. Everything the CLI does in that run happens inside the step and repeats when the step
runs again (at-least-once): its model calls, its built-in tools (Bash, Write, Edit, Read,
Task, …) and any custom tool named ``inline``. A custom tool (an in-process SDK MCP tool,
``@tool`` + ``create_sdk_mcp_server``) is *deferred*: when the model asks for it, a
PreToolUse hook answers ``"defer"``, the CLI stops before running it, and the step returns
those calls as its tool calls. The engine then makes each one as a CallTool step by the
effect class the user declared (undeclared → a non-idempotent write: at most once,
``outcome_unknown`` when a crash leaves it in doubt), and the next RunModel step starts the
next segment with the results.

The conversation handed to a segment is rebuilt from jetloop's history, the only durable
record, never from the CLI's transcript (a file on the worker's disk that another worker
does not have): the history is rendered as Anthropic messages (``jetloop.agents.adapters.history``,
as the Anthropic adapter renders it, with each custom tool under its MCP name), written as a
CLI transcript through an in-memory ``SessionStore``, and resumed from it. The segment's
prompt is the turn's last user text or, after deferred calls, a short note that their
results are in. A finished segment leaves its final text and its deferred calls in the
history; the CLI's own tool exchanges inside it are not replayed to later segments (their
effects are on disk).

Usage::

    agent = durable_claude("shop", options, tools={"shop": [charge, lookup]},
                           effects={"charge": Effect.NON_IDEMPOTENT_WRITE,
                                    "lookup": Effect.READ})

A custom tool can read its call's identity (the idempotency key to hand a vendor, the
attempt, the namespace to key what it keeps by) with ``call_context()`` while the engine
makes it.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import sys
import tempfile
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from jetloop.agents.adapters.anthropic import AnthropicAdapter
from jetloop.agents.adapters.history import NOTE_PREFIX, Item, UserText, conversation
from jetloop.agents.agent import Agent, Limits
from jetloop.agents.jsonargs import JsonArgs, json_args_model
from jetloop.agents.model import Message, ModelRequest, ModelResponse, ToolCallRequest, rough_tokens
from jetloop.agents.tools import ApprovalPolicy, Effect, Tool, ToolContext
from jetloop.schemas.errors import ProviderRejected, ProviderRetryable, ToolError

try:
    import claude_agent_sdk
    from claude_agent_sdk import (
        AssistantMessage,
        ClaudeAgentOptions,
        HookMatcher,
        ResultMessage,
        SdkMcpTool,
        TextBlock,
        ToolUseBlock,
        query,
    )
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError(
        "jetloop.agents.frameworks.claude needs the Claude Agent SDK: pip install 'jetloop[claude]'"
    ) from exc

__all__ = ["ClaudeSegments", "call_context", "durable_claude"]

CONTINUE = NOTE_PREFIX + "The results of the tool calls above are in. Continue the task."
# Segment session ids are derived from the step's identity: the same step, the same id.
SEGMENT_NAMESPACE = uuid.UUID("6f1c3f0e-7a57-4c1a-9d35-0b7e2f4a9c11")

_call: contextvars.ContextVar[ToolContext] = contextvars.ContextVar("jetloop_claude_call")


def call_context() -> ToolContext:
    """The jetloop call a deferred custom tool is being made for (its idempotency key, its
    attempt, its namespace); only while the engine makes it as a CallTool step."""
    try:
        return _call.get()
    except LookupError:
        raise RuntimeError(
            "call_context() is only available inside a custom tool that jetloop makes"
        ) from None


# Linux: the CLI is started through this launcher, which asks the kernel to SIGKILL it when
# the worker dies (PR_SET_PDEATHSIG, kept across exec). Without it a CLI whose worker was
# SIGKILLed runs on as an orphan, finishing the lost segment (its tools, its model calls)
# beside the segment the next worker runs again.
LAUNCHER = """#!{python}
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(os.environ.get("JETLOOP_CLAUDE_PARENT", os.getppid())):
    sys.exit("the worker that started the Claude Code CLI is gone")
os.execv({cli!r}, [{cli!r}, *sys.argv[1:]])
"""


def _launcher(cli: str) -> str:
    """A launcher of ``cli`` that dies with its parent: one file per interpreter and CLI, in
    a directory of this user's that no one else can write (a guessable name in the shared
    temporary directory could be put there first by someone else, and then run). Written
    atomically: workers on one host may race to write it."""
    code = LAUNCHER.format(python=sys.executable, cli=cli)
    directory = Path(tempfile.gettempdir()) / f"jetloop-claude-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    st = directory.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{directory} is not this user's own directory: remove it")
    path = directory / f"launcher-{hashlib.sha256(code.encode()).hexdigest()[:16]}.py"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=path.name)
        with os.fdopen(fd, "w") as f:
            f.write(code)
        os.chmod(tmp, 0o700)
        os.replace(tmp, path)
    return str(path)


def _cli(options: ClaudeAgentOptions) -> str | None:
    """The CLI the SDK would start: the user's ``cli_path`` or the bundled one."""
    if options.cli_path is not None:
        return str(options.cli_path)
    bundled = Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"
    return str(bundled) if bundled.exists() else None


def mcp_name(server: str, tool: str) -> str:
    """The name the CLI gives a tool of an SDK MCP server (what the model calls)."""
    return f"mcp__{server}__{tool}"


@dataclass(frozen=True)
class _Transcript:
    """A ``SessionStore`` that holds one transcript, built from jetloop's history, for one
    resume; what the CLI mirrors back is dropped (the history is the record)."""

    entries: list[dict[str, Any]]

    async def load(self, key: Any) -> list[dict[str, Any]] | None:
        return self.entries

    async def append(self, key: Any, entries: list[Any]) -> None:
        return None


def transcript(session_id: str, cwd: str, messages: Sequence[dict[str, Any]]) -> list[Any]:
    """Anthropic messages as CLI transcript lines: a chain of user/assistant entries."""
    out: list[Any] = []
    parent: str | None = None
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    for i, m in enumerate(messages):
        entry_id = str(uuid.uuid5(uuid.UUID(session_id), str(i)))
        out.append(
            {
                "type": m["role"],
                "message": m,
                "uuid": entry_id,
                "parentUuid": parent,
                "sessionId": session_id,
                "timestamp": stamp,
                "isSidechain": False,
                "cwd": cwd,
                "userType": "external",
            }
        )
        parent = entry_id
    return out


class ClaudeSegments:
    """The ``ModelAdapter`` of a Claude agent: each ``complete`` runs one segment."""

    supports_streaming = False

    def __init__(
        self,
        options: ClaudeAgentOptions,
        deferred: Mapping[str, str],
        *,
        die_with_worker: bool = sys.platform == "linux",
    ) -> None:
        # deferred: the model's (MCP) name of each deferred tool → its jetloop tool name.
        self.options = options
        self.die_with_worker = die_with_worker
        self.deferred = dict(deferred)
        self.wire_names = {v: k for k, v in self.deferred.items()}
        self._render = AnthropicAdapter("claude-agent-sdk")

    def estimate_tokens(self, messages: list[Message]) -> int:
        return rough_tokens(messages)

    def segment(self, request: ModelRequest) -> tuple[list[dict[str, Any]], str]:
        """The conversation to resume and the segment's prompt."""
        items: list[Item] = conversation(request.messages, summary=request.purpose == "summary")
        prompt = CONTINUE
        if items and isinstance(items[-1], UserText):
            prompt = items[-1].text or "(empty message)"
            items = items[:-1]
        messages: list[dict[str, Any]] = self._render.render(request, items)["messages"]
        for m in messages:
            for block in m["content"]:
                if block.get("type") == "tool_use":
                    block["name"] = self.wire_names.get(block["name"], block["name"])
        return messages, prompt

    async def complete(self, request: ModelRequest) -> ModelResponse:
        messages, prompt = self.segment(request)
        options = self._options(request, messages)
        turns: dict[str, list[Any]] = {}
        result: ResultMessage | None = None
        async for m in query(prompt=prompt, options=options):
            if isinstance(m, AssistantMessage) and m.parent_tool_use_id is None:
                # The CLI streams one message per content block, under one message id.
                turns.setdefault(m.message_id or str(len(turns)), []).extend(m.content)
            elif isinstance(m, ResultMessage):
                result = m
        if result is None:
            raise ProviderRetryable("claude", "the Claude Code CLI ended without a result")
        if result.is_error and result.deferred_tool_use is None:
            raise _failure(result)
        last = list(turns.values())[-1] if turns else []
        text = "".join(b.text for b in last if isinstance(b, TextBlock))
        calls = [
            ToolCallRequest(self.deferred[b.name], dict(b.input), provider_id=b.id)
            for b in last
            if isinstance(b, ToolUseBlock) and b.name in self.deferred
        ]
        asked = result.deferred_tool_use
        if not calls and asked is not None and asked.name in self.deferred:
            # A subagent (Task) asked for it: made as if the agent had, its result is the
            # agent's to read.
            calls = [ToolCallRequest(self.deferred[asked.name], asked.input, asked.id)]
        if not calls:
            text = result.result if result.result is not None else text
        return ModelResponse(
            text=text, tool_calls=calls, usage=_usage(result.usage), model=self.options.model
        )

    def _options(self, request: ModelRequest, messages: list[dict[str, Any]]) -> Any:
        hooks = {k: list(v) for k, v in (self.options.hooks or {}).items()}
        hooks.setdefault("PreToolUse", []).insert(0, HookMatcher(hooks=[self._defer]))
        changes: dict[str, Any] = {"hooks": hooks}
        cli = _cli(self.options) if self.die_with_worker else None
        if cli is not None:
            changes["cli_path"] = _launcher(cli)
            env = {**self.options.env, "JETLOOP_CLAUDE_PARENT": str(os.getpid())}
            changes["env"] = env
        if request.instructions and not self.options.system_prompt:
            changes["system_prompt"] = request.instructions
        if messages:
            step = f"{request.session_id}/{request.turn_id}/{request.model_step}"
            sid = str(uuid.uuid5(SEGMENT_NAMESPACE, step))
            cwd = str(self.options.cwd) if self.options.cwd is not None else "."
            entries = transcript(sid, cwd, messages)
            changes.update(session_store=_Transcript(entries), resume=sid)
        return replace(self.options, **changes)

    async def _defer(self, data: Any, tool_use_id: str | None, context: Any) -> Any:
        """PreToolUse: a deferred tool is not run by the CLI; the segment stops there."""
        if data.get("tool_name") in self.deferred:
            return {
                "hookSpecificOutput": {
                    "hookEventName": "PreToolUse",
                    "permissionDecision": "defer",
                    "permissionDecisionReason": "made by jetloop as its own step",
                }
            }
        return {}


def _failure(result: ResultMessage) -> Exception:
    status = result.api_error_status
    detail = "; ".join(result.errors or []) or result.result or result.subtype
    if status is not None and 400 <= status < 500 and status not in (408, 409, 429):
        return ProviderRejected("claude", detail, status=status)
    return ProviderRetryable("claude", detail, status=status)


def _usage(raw: Mapping[str, Any] | None) -> dict[str, int]:
    raw = raw or {}
    return {
        "input_tokens": int(raw.get("input_tokens") or 0),
        "output_tokens": int(raw.get("output_tokens") or 0),
    }


def _input_schema(sdk_tool: SdkMcpTool[Any]) -> dict[str, Any] | None:
    """The JSON Schema the SDK sends for the tool (built as the SDK builds it)."""
    build = getattr(claude_agent_sdk, "_build_input_schema", None)
    return build(sdk_tool) if callable(build) else None


def _args_model(sdk_tool: SdkMcpTool[Any]) -> type[JsonArgs]:
    return json_args_model(sdk_tool.name, _input_schema(sdk_tool))


def _jetloop_tool(
    sdk_tool: SdkMcpTool[Any], effect: Effect, approval: ApprovalPolicy, max_attempts: int
) -> Tool:
    handler = sdk_tool.handler

    async def make(args: BaseModel, ctx: ToolContext) -> Any:
        token = _call.set(ctx)
        try:
            out = await handler(args.model_dump())
        finally:
            _call.reset(token)
        content = out.get("content", [])
        text = "\n".join(c.get("text", "") for c in content if c.get("type") == "text")
        if out.get("is_error") or out.get("isError"):
            raise ToolError(text or f"{sdk_tool.name} failed")
        return text if all(c.get("type") == "text" for c in content) else content

    return Tool(
        name=sdk_tool.name,
        description=sdk_tool.description,
        args_model=_args_model(sdk_tool),
        fn=make,
        effect=effect,
        approval=approval,
        max_attempts=1 if effect is Effect.NON_IDEMPOTENT_WRITE else max_attempts,
    )


def durable_claude(
    name: str,
    options: ClaudeAgentOptions,
    *,
    tools: Mapping[str, Sequence[SdkMcpTool[Any]]] | None = None,
    effects: Mapping[str, Effect] | None = None,
    inline: Collection[str] = (),
    approval: Mapping[str, ApprovalPolicy] | None = None,
    instructions: str = "",
    limits: Limits | None = None,
    max_attempts: int = 3,
) -> Agent:
    """A jetloop ``Agent`` that runs ``options`` (the SDK agent, unchanged) in segments.

    ``tools`` maps each SDK MCP server of ``options.mcp_servers`` to the ``@tool``
    definitions it was built from; each becomes a jetloop tool made as its own step, with
    the effect ``effects`` declares for it (by tool name; undeclared → a non-idempotent
    write) and an optional approval policy. A tool named in ``inline`` is instead run by the
    CLI inside the segment (at-least-once, whatever its effect).
    """
    effects = dict(effects or {})
    approval = dict(approval or {})
    servers = options.mcp_servers if isinstance(options.mcp_servers, dict) else {}
    deferred: dict[str, str] = {}
    jl_tools: list[Tool] = []
    for server, defs in (tools or {}).items():
        if server not in servers:
            raise ValueError(f"{name}: tools of {server!r}, which is not in options.mcp_servers")
        for d in defs:
            if d.name in inline:
                continue
            effect = effects.get(d.name, Effect.NON_IDEMPOTENT_WRITE)
            jl_tools.append(_jetloop_tool(d, effect, approval.get(d.name, False), max_attempts))
            deferred[mcp_name(server, d.name)] = d.name
    unknown = set(effects) - {t.name for t in jl_tools} - set(inline)
    if unknown:
        raise ValueError(f"{name}: effects for unknown tools {sorted(unknown)}")
    return Agent(
        name=name,
        instructions=instructions,
        model=ClaudeSegments(options, deferred),
        tools=tuple(jl_tools),
        limits=limits or Limits(),
    )
