"""OpenAI Agents SDK agents, run durably: ``durable(sdk_agent, effects={...})``.

The wrapper turns an SDK ``Agent`` (and every agent it can hand off to) into one jetloop
``jetloop.agents.Agent``. The engine keeps the loop the SDK's ``Runner`` would have run:

- each model request is a RunModel step: ``SdkModel`` turns jetloop's conversation into the
  SDK's input items (Responses format) and calls the SDK ``Model.get_response`` of the agent
  that is active, with that agent's instructions, tools, handoffs and output type;
- each function tool is a CallTool step with the effect class the user declares for it
  (undeclared: ``NON_IDEMPOTENT_WRITE``, a write that runs at most once);
- each handoff is a CallTool step (``READ`` unless declared) whose result names the agent it
  hands off to; the active agent is derived from the conversation (the last handoff that
  succeeded), so a redelivered model step derives the same agent again;
- a tool with ``needs_approval`` waits for a person's decision (AwaitToolApproval);
- an agent's MCP servers (``MCPServerStdio``, ``MCPServerStreamableHttp``) are served by
  jetloop's own MCP client (``jetloop.agents.mcp``), not the SDK's: their tools are listed at
  every model step and offered to the active agent's model as the SDK offers them; each call
  is a tool step with the effect the server's annotations give (``effects=`` overrides, by
  tool name), its idempotency key in the request's ``_meta``; ``require_approval`` and a
  ``tool_filter`` of ``allowed_tool_names`` are kept;
- hosted tools (``WebSearchTool``, ``FileSearchTool``, ``CodeInterpreterTool``,
  ``ImageGenerationTool``, ``HostedMCPTool``, ``ToolSearchTool``) run at the provider, inside
  the model call: inside RunModel, so they run again when RunModel runs again.

The SDK is an optional extra (``jetloop[openai-agents]``; its import name is ``agents``):
import this module only where it is installed; nothing in the core imports it. User code
writes plain SDK code (``from agents import Agent, function_tool``) and only adds
``durable(...)`` and the effects.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agents import Agent as SdkAgent
from agents import (
    AgentOutputSchemaBase,
    CodeInterpreterTool,
    FileSearchTool,
    FunctionTool,
    Handoff,
    HostedMCPTool,
    ImageGenerationTool,
    Model,
    ModelProvider,
    ModelTracing,
    MultiProvider,
    RunContextWrapper,
    ToolSearchTool,
    TResponseInputItem,
    WebSearchTool,
    handoff,
)
from agents import Tool as SdkTool
from agents.run_internal import turn_preparation
from agents.tool_context import ToolContext as SdkToolContext
from openai.types.responses.response_prompt_param import ResponsePromptParam
from pydantic import BaseModel, ConfigDict

from jetloop.agents.adapters.base import MalformedToolCall, tool_call, usage
from jetloop.agents.adapters.history import Context, Item, UserText, conversation
from jetloop.agents.agent import Agent, Limits
from jetloop.agents.mcp import MCPServer
from jetloop.agents.model import Message, ModelRequest, ModelResponse, ToolCallRequest, rough_tokens
from jetloop.agents.tools import Effect, Tool, ToolContext
from jetloop.schemas.errors import ProviderRejected, ProviderRetryable

# Tools the provider runs inside the model call: they cannot be deferred to a CallTool step.
HOSTED_TOOLS = (
    WebSearchTool,
    FileSearchTool,
    CodeInterpreterTool,
    ImageGenerationTool,
    HostedMCPTool,
    ToolSearchTool,
)

RETRYABLE_STATUS = frozenset({408, 409, 429})


# --- the wrapper -----------------------------------------------------------------------------


def durable(
    agent: SdkAgent[Any],
    *,
    name: str | None = None,
    effects: Mapping[str, Effect] | None = None,
    model_provider: ModelProvider | None = None,
    context: Any = None,
    limits: Limits | None = None,
    sticky_handoffs: bool = True,
) -> Agent:
    """A jetloop agent that runs the SDK ``agent`` (and the agents it hands off to) durably.

    ``effects`` declares each function tool's effect class by name (and a handoff's, whose
    default is ``READ``); a function tool it does not name is a ``NON_IDEMPOTENT_WRITE``.
    ``model_provider`` resolves an agent whose ``model`` is a name (default: the SDK's
    ``MultiProvider``). ``context`` is the run context the SDK hands to dynamic instructions,
    ``is_enabled`` and approval policies. With ``sticky_handoffs`` (the default, as the SDK's
    ``result.last_agent``) the agent a handoff chose answers the next turns too; without, each
    turn starts at ``agent``.
    """
    graph = Graph.of(agent)
    declared = dict(effects or {})
    tools: list[Tool] = []
    for t in graph.function_tools.values():
        effect = Effect(declared.pop(t.name, Effect.NON_IDEMPOTENT_WRITE))
        tools.append(function_tool(t, effect, context))
    for tool_name, h in graph.handoffs.items():
        tools.append(handoff_tool(h, Effect(declared.pop(tool_name, Effect.READ)), context))
    if declared and not graph.mcp_servers:
        raise ValueError(
            f"effects name tools no agent has: {sorted(declared)} "
            f"(tools: {sorted(graph.function_tools)}, handoffs: {sorted(graph.handoffs)})"
        )
    # What is left names MCP servers' tools (only listed at run time): it overrides their
    # annotations.
    servers = {key: mcp_server(s, declared) for key, s in graph.mcp_servers.items()}
    instructions = agent.instructions if isinstance(agent.instructions, str) else ""
    return Agent(
        name=name or slug(agent.name),
        instructions=instructions,
        model=SdkModel(graph, model_provider, context, sticky_handoffs, servers),
        tools=tuple(tools),
        limits=limits or Limits(),
        mcp_servers=tuple(servers.values()),
    )


def mcp_server(server: Any, effects: Mapping[str, Effect]) -> MCPServer:
    """jetloop's MCP client for the server an SDK MCP server object names."""
    params = getattr(server, "params", None)
    name = str(getattr(server, "name", "") or "mcp")
    options: dict[str, Any] = {"effects": effects}
    policy = getattr(server, "_needs_approval_policy", False)
    options["approval"] = dict(policy) if isinstance(policy, Mapping) else bool(policy)
    allowed = _allowed_tools(name, getattr(server, "tool_filter", None))
    if allowed is not None:
        options["include"] = allowed
    if isinstance(params, Mapping) and isinstance(params.get("url"), str):
        headers = dict(params.get("headers") or {})
        return MCPServer.http(name, params["url"], headers=headers, **options)
    command = getattr(params, "command", None)
    if isinstance(command, str):
        cwd = getattr(params, "cwd", None)
        return MCPServer.stdio(
            name,
            command,
            list(getattr(params, "args", None) or []),
            env=getattr(params, "env", None),
            cwd=str(cwd) if cwd else None,
            **options,
        )
    raise TypeError(
        f"MCP server {name!r} ({type(server).__name__}): jetloop reaches MCP servers over "
        "stdio (MCPServerStdio) or streamable HTTP (MCPServerStreamableHttp)"
    )


def _allowed_tools(server: str, tool_filter: Any) -> list[str] | None:
    if tool_filter is None:
        return None
    if isinstance(tool_filter, Mapping) and set(tool_filter) <= {"allowed_tool_names"}:
        return list(tool_filter.get("allowed_tool_names") or [])
    raise TypeError(
        f"MCP server {server!r}: only a tool_filter of allowed_tool_names is kept by jetloop "
        "(a blocked list or a callable filter is not)"
    )


async def _made_by_the_engine(ctx: Any, raw: str) -> Any:
    raise RuntimeError("an MCP tool's call is a jetloop tool step, never the SDK's to make")


def slug(text: str) -> str:
    """An SDK agent's name as a jetloop name (``Billing agent`` → ``billing-agent``)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-").lower()[:64] or "agent"


@dataclass
class Graph:
    """The SDK agents reachable by handoffs from the first one, their function tools, their
    handoffs (by tool name) and hosted tools, checked once when the agent is wrapped."""

    start: SdkAgent[Any]
    agents: dict[str, SdkAgent[Any]] = field(default_factory=dict)
    function_tools: dict[str, FunctionTool] = field(default_factory=dict)
    handoffs: dict[str, Handoff[Any, Any]] = field(default_factory=dict)
    # The agent each handoff tool hands off to.
    targets: dict[str, str] = field(default_factory=dict)
    # The SDK MCP server objects of every agent (by identity), and each agent's.
    mcp_servers: dict[int, Any] = field(default_factory=dict)
    mcp_of: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, start: Any) -> Graph:
        if not isinstance(start, SdkAgent):
            raise TypeError(f"expected an OpenAI Agents SDK Agent, got {type(start).__name__}")
        graph = cls(start)
        todo = [start]
        while todo:
            a = todo.pop()
            if a.name in graph.agents:
                if graph.agents[a.name] is not a:
                    raise ValueError(f"two different agents are named {a.name!r}")
                continue
            graph.agents[a.name] = a
            for server in getattr(a, "mcp_servers", None) or []:
                graph.mcp_servers[id(server)] = server
                graph.mcp_of.setdefault(a.name, []).append(id(server))
            for t in a.tools:
                graph._add_tool(a, t)
            for h in handoffs_of(a):
                target = h._agent_ref() if h._agent_ref is not None else None
                if not isinstance(target, SdkAgent):
                    raise TypeError(f"agent {a.name!r}: handoff {h.tool_name} has no agent")
                known = graph.targets.get(h.tool_name)
                if known is not None and known != target.name:
                    raise ValueError(f"handoff tool {h.tool_name!r} leads to two agents")
                if h.tool_name in graph.function_tools:
                    raise ValueError(f"{h.tool_name!r} is both a function tool and a handoff")
                graph.handoffs.setdefault(h.tool_name, h)
                graph.targets[h.tool_name] = target.name
                todo.append(target)
        return graph

    def _add_tool(self, owner: SdkAgent[Any], t: Any) -> None:
        if isinstance(t, FunctionTool):
            known = self.function_tools.get(t.name)
            if known is not None and known is not t:
                raise ValueError(f"two different function tools are named {t.name!r}")
            self.function_tools[t.name] = t
        elif not isinstance(t, HOSTED_TOOLS):
            raise TypeError(
                f"agent {owner.name!r}: {type(t).__name__} runs in the SDK's own loop, which "
                "jetloop replaces; wrap it as a function tool"
            )

    def active(self, messages: Sequence[Message], sticky: bool) -> SdkAgent[Any]:
        """The agent that answers next: the target of the last handoff that succeeded (in the
        whole conversation, or in the current turn without ``sticky``), else the first."""
        scope = messages
        if not sticky:
            starts = [i for i, m in enumerate(messages) if m.role == "user"]
            scope = messages[starts[-1] :] if starts else messages
        current = self.start
        for m in scope:
            if m.role != "tool" or m.tool not in self.handoffs or (m.status or "ok") != "ok":
                continue
            target = m.result.get("assistant") if isinstance(m.result, dict) else None
            if isinstance(target, str) and target in self.agents:
                current = self.agents[target]
        return current


def handoffs_of(agent: SdkAgent[Any]) -> list[Handoff[Any, Any]]:
    """An agent's handoffs as SDK ``Handoff`` objects (an agent listed directly gets the SDK's
    default handoff to it)."""
    return [h if isinstance(h, Handoff) else handoff(h) for h in agent.handoffs]


# --- tools -----------------------------------------------------------------------------------


class SdkArguments(BaseModel):
    """A function tool's arguments as the model wrote them: the SDK validates them itself."""

    model_config = ConfigDict(extra="allow")


def arguments_model(tool_name: str, schema: dict[str, Any]) -> type[SdkArguments]:
    """An argument model whose JSON schema is the SDK tool's own."""
    fixed = dict(schema)

    class Arguments(SdkArguments):
        @classmethod
        def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return fixed

    Arguments.__name__ = Arguments.__qualname__ = f"{tool_name}_arguments"
    return Arguments


def function_tool(t: FunctionTool, effect: Effect, context: Any) -> Tool:
    """An SDK ``FunctionTool`` as a jetloop tool: the SDK's own invoker runs inside CallTool,
    with a ``ToolContext`` whose ``context`` is jetloop's (``ctx.context.idempotency_key``,
    ``ctx.context.namespace``)."""

    async def run(args: BaseModel, ctx: ToolContext) -> Any:
        raw = json.dumps(args.model_dump(mode="json"))
        call = SdkToolContext(
            context=ctx, tool_name=t.name, tool_call_id=ctx.call_id, tool_arguments=raw
        )
        return jsonable(await t.on_invoke_tool(call, raw))

    return Tool(
        name=t.name,
        description=t.description or "",
        args_model=arguments_model(t.name, t.params_json_schema),
        fn=run,
        effect=effect,
        approval=approval_policy(t.needs_approval, context),
    )


def handoff_tool(h: Handoff[Any, Any], effect: Effect, context: Any) -> Tool:
    """A handoff as a jetloop tool: the SDK's ``on_invoke_handoff`` (and the user's
    ``on_handoff``) runs inside CallTool; its result names the agent that answers next."""

    async def run(args: BaseModel, ctx: ToolContext) -> Any:
        raw = json.dumps(args.model_dump(mode="json"))
        target = await h.on_invoke_handoff(RunContextWrapper(context=context), raw)
        return {"assistant": target.name}

    return Tool(
        name=h.tool_name,
        description=h.tool_description or "",
        args_model=arguments_model(h.tool_name, h.input_json_schema),
        fn=run,
        effect=effect,
    )


def approval_policy(needs: Any, context: Any) -> bool | Any:
    """``needs_approval`` as jetloop's approval policy (a bool, or a predicate over the
    arguments). The SDK's policy is async; jetloop's is decided synchronously, so the
    coroutine is run to its end here: a policy that really waits is taken as "needs approval"
    (the safe answer)."""
    if not callable(needs):
        return bool(needs)

    def policy(args: BaseModel) -> bool:
        out = needs(RunContextWrapper(context=context), args.model_dump(mode="json"), "")
        if not inspect.isawaitable(out):
            return bool(out)
        if not inspect.iscoroutine(out):
            return True
        try:
            out.send(None)
        except StopIteration as done:
            return bool(done.value)
        out.close()
        return True

    return policy


def jsonable(value: Any) -> Any:
    """A tool's output as a JSON value for the history (what is not JSON becomes its text)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


# --- the model -------------------------------------------------------------------------------


class SdkModel:
    """jetloop's ``ModelAdapter`` over the SDK's ``Model``: one ``get_response`` per RunModel
    step, for the agent the conversation says is active."""

    def __init__(
        self,
        graph: Graph,
        provider: ModelProvider | None,
        context: Any,
        sticky: bool,
        mcp_servers: Mapping[int, MCPServer] | None = None,
    ) -> None:
        self.graph = graph
        self.provider = provider
        self.context = context
        self.sticky = sticky
        self.mcp_servers = dict(mcp_servers or {})
        self._models: dict[str, Model] = {}

    def mcp_tools(self, agent: SdkAgent[Any], request: ModelRequest) -> list[SdkTool]:
        """The tools jetloop listed for this step from the agent's own MCP servers, as SDK
        function tools the model is offered (the engine makes their calls, not the SDK)."""
        servers = [self.mcp_servers[k] for k in self.graph.mcp_of.get(agent.name, [])]
        return [
            FunctionTool(
                name=t.name,
                description=t.description,
                params_json_schema=t.parameters,
                on_invoke_tool=_made_by_the_engine,
                strict_json_schema=False,
            )
            for t in request.tools
            if any(s.known(t.name) is not None for s in servers)
        ]

    def estimate_tokens(self, messages: list[Message]) -> int:
        return rough_tokens(messages)

    def model_of(self, agent: SdkAgent[Any]) -> Model:
        """The SDK ``Model`` an agent's requests go to (resolved once per agent)."""
        found = self._models.get(agent.name)
        if found is None:
            if isinstance(agent.model, Model):
                found = agent.model
            else:
                if self.provider is None:
                    self.provider = MultiProvider()
                found = self.provider.get_model(agent.model)
            self._models[agent.name] = found
        return found

    async def complete(self, request: ModelRequest) -> ModelResponse:
        system: str | None
        tools: list[SdkTool]
        handoffs: list[Handoff[Any, Any]]
        output: AgentOutputSchemaBase | None
        prompt: ResponsePromptParam | None
        if request.purpose == "summary":
            agent = self.graph.start
            items = conversation(request.messages, tools_enabled=False, summary=True)
            system, tools, handoffs, output, prompt = request.instructions, [], [], None, None
        else:
            agent = self.graph.active(request.messages, self.sticky)
            items = conversation(request.messages)
            run = RunContextWrapper(context=self.context)
            system = await agent.get_system_prompt(run)
            if agent.mcp_servers:
                # The SDK would connect to them: jetloop lists their tools instead.
                tools = await agent.clone(mcp_servers=[]).get_all_tools(run)
                tools += self.mcp_tools(agent, request)
            else:
                tools = await agent.get_all_tools(run)
            handoffs = await turn_preparation.get_handoffs(agent, run)
            output = turn_preparation.get_output_schema(agent)
            prompt = await agent.get_prompt(run)
        try:
            response = await self.model_of(agent).get_response(
                system,
                input_items(items),
                agent.model_settings,
                tools,
                output,
                handoffs,
                ModelTracing.DISABLED,
                previous_response_id=None,
                conversation_id=None,
                prompt=prompt,
            )
        except Exception as exc:
            mapped = provider_error(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        # What the model was offered this step (``is_enabled`` may hide a tool or handoff).
        allowed = {t.name for t in tools if isinstance(t, FunctionTool)}
        answer = self.answer(response, allowed | {h.tool_name for h in handoffs})
        # The model's name, as the usage ledger prices it: the agent's, or its Model's.
        name = agent.model if isinstance(agent.model, str) else getattr(agent.model, "model", None)
        return dataclasses.replace(answer, model=name if isinstance(name, str) else None)

    def answer(self, response: Any, allowed: set[str]) -> ModelResponse:
        """The SDK's output items as jetloop's answer: text, and the function calls (a call
        of a tool the active agent lacks, or a second handoff, is refused as the SDK does)."""
        text: list[str] = []
        calls: list[ToolCallRequest] = []
        handed_off = False
        for item in response.output:
            kind = getattr(item, "type", None)
            if kind == "message":
                for part in item.content:
                    if part.type == "output_text":
                        text.append(part.text)
                    elif part.type == "refusal":
                        text.append(part.refusal)
            elif kind == "function_call":
                call = tool_call(item.name, item.arguments, item.call_id)
                problem = None
                if item.name not in allowed:
                    problem = f"tool {item.name} is not available to this agent"
                elif item.name in self.graph.handoffs:
                    if handed_off:
                        problem = "Multiple handoffs detected, ignoring this one."
                    handed_off = True
                if problem is not None and not isinstance(call, MalformedToolCall):
                    call = MalformedToolCall(
                        item.name, {}, item.call_id, raw_arguments=item.arguments, problem=problem
                    )
                calls.append(call)
            # Other items (reasoning, a hosted tool's call) were made inside the model call.
        u = response.usage
        cached = getattr(getattr(u, "input_tokens_details", None), "cached_tokens", None)
        return ModelResponse(
            text="".join(text),
            tool_calls=calls,
            usage=usage(u.input_tokens, u.output_tokens, cached),
        )


def input_items(items: list[Item]) -> list[TResponseInputItem]:
    """jetloop's conversation as the SDK's input items (the Responses API format)."""
    out: list[TResponseInputItem] = []
    for item in items:
        if isinstance(item, UserText):
            out.append({"role": "user", "content": item.text})
        elif isinstance(item, Context):
            out.append({"role": "developer", "content": item.text})
        else:
            if item.text:
                out.append({"role": "assistant", "content": item.text})
            out += [
                {
                    "type": "function_call",
                    "call_id": c.id,
                    "name": c.name,
                    "arguments": c.arguments_json,
                }
                for c in item.calls
            ]
            out += [
                {"type": "function_call_output", "call_id": r.call_id, "output": r.content}
                for r in item.results
            ]
    return out


def provider_error(exc: Exception) -> Exception:
    """An ``openai`` client error as the engine's: retryable (rate limits, timeouts, lost
    connections, 5xx) or rejected (other 4xx). Anything else is left as it is (the engine
    retries the step within its attempts)."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        body = exc.body if isinstance(exc.body, dict) else {}
        error_type = body.get("type") or body.get("code")
        kind = (
            ProviderRetryable if status in RETRYABLE_STATUS or status >= 500 else ProviderRejected
        )
        return kind(
            "openai-agents",
            str(exc.message),
            status=status,
            error_type=error_type,
            request_id=exc.request_id,
        )
    if isinstance(exc, openai.APIConnectionError):
        return ProviderRetryable("openai-agents", str(exc))
    return exc
