"""A pydantic-ai agent, run durably: ``durable(agent, effects={...})`` is a jetloop ``Agent``.

The user's ``pydantic_ai.Agent`` stays as it is. jetloop's engine keeps the loop
(jetloop/agents/frameworks/__init__.py):

- **Each model request is a RunModel step.** ``PydanticAIModel.complete`` turns jetloop's
  conversation into pydantic-ai ``ModelMessage``s and lets pydantic-ai make the one request
  itself, through its public ``Agent.iter``: the graph adds the agent's instructions, system
  prompts, tool definitions, output tools and model settings and calls the agent's
  ``Model.request``; we stop at the response. Calls to the agent's tools in it become
  jetloop tool calls; a response with none is handed back to pydantic-ai, which validates it
  into the output type (and, if validation fails, asks the model again inside the same step).
- **Each function tool is a jetloop ``Tool``** (a CallTool / CallSingleAttemptTool step) with
  the effect class the user declares for it; a tool not declared is a ``NON_IDEMPOTENT_WRITE``.
  It runs through pydantic-ai's public ``ToolManager`` (argument validation, ``RunContext``
  with the wrapper's ``deps``), so ``ModelRetry`` and bad arguments reach the model as a failed
  call it can correct.
- **MCP servers**: an ``MCPToolset`` among the agent's toolsets (over stdio, or a streamable
  HTTP URL) is served by jetloop's own MCP client (``jetloop.agents.mcp``): its tools are
  listed at every model step and offered to the model as pydantic-ai offers them, and each
  call is a tool step with the effect the server's annotations give (``effects=`` overrides,
  by tool name), the idempotency key in the request's ``_meta``. pydantic-ai does not connect
  to it. An ``MCPToolset`` wrapped in another toolset (prefixed, filtered) is not recognised:
  it is one of the other toolsets below.
- **Approvals**: ``requires_approval=True`` (or a predicate in ``approvals=``) is a jetloop
  approval (AwaitToolApproval); the approved call runs with ``RunContext.tool_call_approved``.
- **What cannot be deferred** runs inside RunModel and repeats when RunModel runs again
  (at-least-once): native tools the provider executes during the request (web search, code
  execution, the provider-side MCP tool), output functions and output validators, dynamic
  instructions and system prompts, history processors and capability hooks around the request.

pydantic-ai is an optional extra (``jetloop[pydantic-ai]``): import this module only where it
is installed; nothing in the core imports it.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import pydantic_core
from pydantic import (
    BaseModel,
    ConfigDict,
    PydanticSchemaGenerationError,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_ai import (
    AbstractToolset,
    ApprovalRequired,
    CallDeferred,
    CallToolsNode,
    CombinedToolset,
    ExternalToolset,
    FunctionToolset,
    ModelRetry,
    NativeOutput,
    PromptedOutput,
    RunContext,
    TextOutput,
    ToolFailed,
    ToolOutput,
    ToolReturn,
)
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import messages as pm
from pydantic_ai import models as pmodels
from pydantic_ai.capabilities import Hooks
from pydantic_ai.exceptions import (
    ModelAPIError,
    ModelHTTPError,
    UnexpectedModelBehavior,
    UserError,
)
from pydantic_ai.tool_manager import ToolManager
from pydantic_ai.tools import ToolDefinition, ToolDenied
from pydantic_ai.usage import RunUsage
from pydantic_graph import End

from jetloop.agents.adapters.history import Context, Exchange, UserText, conversation
from jetloop.agents.agent import Agent, Limits, Trigger
from jetloop.agents.mcp import MCPServer
from jetloop.agents.model import Message, ModelRequest, ModelResponse, ToolCallRequest, rough_tokens
from jetloop.agents.tools import Effect, Tool, ToolContext
from jetloop.schemas.errors import ModelError, ProviderRejected, ProviderRetryable, ToolError

__all__ = ["DurablePydanticAgent", "PydanticAIModel", "durable", "tool_context"]

ArgsPredicate = Callable[[dict[str, Any]], bool]

_CALL: contextvars.ContextVar[ToolContext] = contextvars.ContextVar("jetloop_pydantic_ai_call")

# Statuses worth another attempt of the model step, as the HTTP adapters classify them.
_RETRYABLE_STATUS = frozenset({408, 409, 429})


def tool_context() -> ToolContext:
    """The jetloop call a pydantic-ai tool runs for: its ``idempotency_key`` (the same on every
    attempt: hand it to the vendor), ``attempt``, ``call_id``, ``namespace`` (ids are unique
    only within one: key what a tool keeps by it), ``cancelled``.

    Raises ``LookupError`` outside a tool run by ``durable``.
    """
    return _CALL.get()


@dataclass(frozen=True)
class DurablePydanticAgent(Agent):
    """A jetloop ``Agent`` made from a pydantic-ai agent: serve it in an ``App`` as any other.

    ``output(text)`` reads a turn's answer back as the pydantic-ai agent's output type: a
    structured output is the answer text as JSON, validated again into that type.
    """

    pydantic_agent: Any = None
    output_adapter: TypeAdapter[Any] | None = field(default=None, repr=False)

    def output(self, text: str | None) -> Any:
        """The turn's final answer as the agent's output type (``str`` agents: the text)."""
        if text is None:
            raise ValueError("the turn has no answer text")
        if self.output_adapter is None:
            return text
        return self.output_adapter.validate_json(text)


def durable(
    agent: PydanticAgent[Any, Any],
    *,
    name: str | None = None,
    effects: Mapping[str, Effect] | None = None,
    approvals: Mapping[str, ArgsPredicate] | None = None,
    deps: Any = None,
    limits: Limits | None = None,
    triggers: Sequence[Trigger] = (),
    max_attempts: int = 3,
) -> DurablePydanticAgent:
    """Wrap a pydantic-ai ``Agent`` (unchanged) as a durable jetloop agent.

    ``effects`` declares each tool's effect class by name (``Effect.READ`` only where you say
    so: a tool not named is a ``NON_IDEMPOTENT_WRITE``, made at most once). Tools of other
    toolsets than function toolsets (an MCP server, a dynamic toolset) are deferred too when
    named here. ``approvals`` maps a tool name to a predicate over its arguments (a dict)
    that says when a call needs a person's approval; ``requires_approval=True`` tools always
    do. ``deps`` is the ``RunContext.deps`` of every model request and tool call.
    """
    effects = dict(effects or {})
    approvals = dict(approvals or {})
    agent_name = name or agent.name
    if not agent_name:
        raise ValueError("durable(agent): give name=... (the pydantic-ai agent has no name)")
    found = _function_tools(agent)
    mcp = _mcp_toolsets(agent)
    other_toolsets = any(
        not isinstance(ts, FunctionToolset) and ts not in mcp for ts in agent.toolsets
    )
    unknown = sorted((set(effects) | set(approvals)) - set(found))
    if unknown and not other_toolsets and not mcp:
        raise ValueError(f"durable({agent_name}): no tool named {', '.join(unknown)}")
    servers = tuple(
        _mcp_server(agent_name, i, ts, effects, approvals, max_attempts) for i, ts in enumerate(mcp)
    )
    runner = _ToolRunner(agent, deps)
    tools: list[Tool] = []
    for tool_name in [*found, *(unknown if other_toolsets else [])]:
        pai_tool = found.get(tool_name)
        tools.append(
            _jetloop_tool(
                tool_name,
                pai_tool,
                effects.get(tool_name, Effect.NON_IDEMPOTENT_WRITE),
                approvals.get(tool_name),
                runner,
                max_attempts,
            )
        )
    return DurablePydanticAgent(
        name=agent_name,
        instructions=f"(the instructions of the pydantic-ai agent {agent_name})",
        model=PydanticAIModel(agent, deps=deps, mcp_servers=servers),
        tools=tuple(tools),
        limits=limits or Limits(),
        triggers=tuple(triggers),
        mcp_servers=servers,
        pydantic_agent=agent,
        output_adapter=_output_adapter(agent.output_type),
    )


# --- MCP servers ----------------------------------------------------------------------------


def _mcp_toolsets(agent: PydanticAgent[Any, Any]) -> list[AbstractToolset[Any]]:
    """The agent's ``MCPToolset``s (none when pydantic-ai's MCP support is not installed).

    Looked up among the modules already imported, not imported here: an ``MCPToolset`` can
    exist only once its module ``pydantic_ai.mcp`` is, and importing it (with fastmcp and the
    MCP SDK) costs a worker whose agents have none about 1.7 s at every start."""
    module = sys.modules.get("pydantic_ai.mcp")
    toolset_class = getattr(module, "MCPToolset", None)
    if toolset_class is None:
        return []
    return [ts for ts in agent.toolsets if isinstance(ts, toolset_class)]


def _mcp_server(
    agent_name: str,
    index: int,
    toolset: Any,
    effects: Mapping[str, Effect],
    approvals: Mapping[str, ArgsPredicate],
    max_attempts: int,
) -> MCPServer:
    """jetloop's MCP client for the server an ``MCPToolset`` names (its command or URL)."""
    transport = toolset.client.transport
    name = toolset.id or f"mcp{index}"
    options: dict[str, Any] = {
        "effects": effects,
        "approval": {n: _args_predicate(p) for n, p in approvals.items()},
        "max_attempts": max_attempts,
    }
    url = getattr(transport, "url", None)
    command = getattr(transport, "command", None)
    if isinstance(url, str) and type(transport).__name__ == "StreamableHttpTransport":
        return MCPServer.http(name, url, headers=dict(transport.headers or {}), **options)
    if isinstance(command, str):
        return MCPServer.stdio(
            name,
            command,
            list(transport.args or []),
            env=transport.env,
            cwd=str(transport.cwd) if transport.cwd else None,
            **options,
        )
    raise ValueError(
        f"durable({agent_name}): the MCP toolset {name!r} talks over "
        f"{type(transport).__name__}; jetloop reaches MCP servers over stdio (a command) or "
        "streamable HTTP (a URL)"
    )


def _args_predicate(pred: ArgsPredicate) -> Callable[[Any], bool]:
    def needs(args: BaseModel) -> bool:
        return bool(pred(args.model_dump()))

    return needs


# --- tools ----------------------------------------------------------------------------------


def _function_tools(agent: PydanticAgent[Any, Any]) -> dict[str, Any]:
    """The ``pydantic_ai.Tool``s of the agent's function toolsets (its own ``@agent.tool``s
    and any ``FunctionToolset`` passed in), by name: the tools known when the app loads."""
    out: dict[str, Any] = {}
    for ts in agent.toolsets:
        if isinstance(ts, FunctionToolset):
            out.update(ts.tools)
    return out


def _jetloop_tool(
    name: str,
    pai_tool: Any,
    effect: Effect,
    approval: ArgsPredicate | None,
    runner: _ToolRunner,
    max_attempts: int,
) -> Tool:
    requires = bool(getattr(pai_tool, "requires_approval", False))
    args_model = _args_model(name, pai_tool)

    def needs_approval(args: BaseModel) -> bool:
        return requires or (approval is not None and bool(approval(args.model_dump())))

    async def call(args: BaseModel, ctx: ToolContext) -> Any:
        # The engine runs a call that needs approval only once it is approved.
        return await runner.call(name, args.model_dump(), ctx, approved=needs_approval(args))

    return Tool(
        name=name,
        description=(getattr(pai_tool, "description", None) or "").strip(),
        args_model=args_model,
        fn=call,
        effect=effect,
        max_attempts=max_attempts,
        approval=needs_approval if (requires or approval is not None) else False,
    )


def _args_model(name: str, pai_tool: Any) -> type[BaseModel]:
    """The arguments as jetloop sees them: the model's JSON object, checked by pydantic-ai's
    own validator of the tool, so a bad call is refused when planned (the model is told)."""
    schema = getattr(pai_tool, "function_schema", None)
    validator = getattr(schema, "validator", None)

    class Args(BaseModel):
        model_config = ConfigDict(extra="allow")

        @model_validator(mode="before")
        @classmethod
        def check(cls, data: Any) -> Any:
            if validator is not None:
                try:
                    validator.validate_python(data)
                except ValidationError as exc:
                    first = exc.errors()[0]
                    where = ".".join(str(p) for p in first["loc"])
                    raise ValueError(
                        f"{where}: {first['msg']}" if where else first["msg"]
                    ) from None
            return data

    Args.__name__ = Args.__qualname__ = f"{name}_args"
    return Args


class _ToolRunner:
    """Runs one of the agent's tools through pydantic-ai's ``ToolManager``, as its own graph
    would: arguments validated, ``RunContext`` built from the jetloop call and ``deps``."""

    def __init__(self, agent: PydanticAgent[Any, Any], deps: Any) -> None:
        self.agent = agent
        self.deps = deps
        self._model: pmodels.Model | None = None

    def model(self) -> pmodels.Model:
        if self._model is None:
            raw = self.agent.model
            if raw is None:
                raise UserError("the pydantic-ai agent has no model")
            self._model = raw if isinstance(raw, pmodels.Model) else pmodels.infer_model(raw)
        return self._model

    async def call(self, name: str, args: dict[str, Any], ctx: ToolContext, approved: bool) -> Any:
        run_ctx = RunContext[Any](
            deps=self.deps,
            model=self.model(),
            usage=RunUsage(),
            agent=self.agent,
            tool_call_id=ctx.call_id,
            tool_name=name,
            retry=ctx.attempt - 1,
            run_step=ctx.model_step + 1,
            tool_call_approved=approved,
            run_id=ctx.turn_id,
            conversation_id=ctx.session_id,
        )
        # The agent's MCP toolsets are not among them: jetloop makes those calls itself.
        mcp = _mcp_toolsets(self.agent)
        toolset = CombinedToolset([ts for ts in self.agent.toolsets if ts not in mcp])
        token = _CALL.set(ctx)
        try:
            async with toolset:
                manager = await ToolManager(
                    toolset=toolset, root_capability=self.agent.root_capability
                ).for_run_step(run_ctx)
                part = pm.ToolCallPart(name, args, tool_call_id=ctx.call_id)
                out = await manager.handle_call(
                    part, approved=approved, wrap_validation_errors=False
                )
        except (ModelRetry, ToolFailed) as exc:
            # What pydantic-ai would send back to the model as a retry: a failed call it sees.
            raise ToolError(str(exc) or type(exc).__name__) from exc
        except ValidationError as exc:
            raise ToolError(f"invalid arguments for {name}: {exc.errors()[0]['msg']}") from exc
        except ApprovalRequired as exc:
            raise ToolError(
                f"{name} asked for approval while running; declare it with "
                f"durable(..., approvals={{{name!r}: ...}}) so jetloop asks before the call"
            ) from exc
        except CallDeferred as exc:
            raise ToolError(f"{name} is an external (deferred) tool: not supported") from exc
        finally:
            _CALL.reset(token)
        if isinstance(out, ToolDenied):
            raise ToolError(out.message)
        if isinstance(out, ToolReturn):
            out = out.return_value
        return pydantic_core.to_jsonable_python(out)


# --- the model step -------------------------------------------------------------------------


class PydanticAIModel:
    """The jetloop model adapter of a pydantic-ai agent: one model request per RunModel step."""

    def __init__(
        self,
        agent: PydanticAgent[Any, Any],
        *,
        deps: Any,
        mcp_servers: Sequence[MCPServer] = (),
    ) -> None:
        self.agent = agent
        self.deps = deps
        self.mcp_servers = tuple(mcp_servers)

    def _toolsets(self, request: ModelRequest) -> list[AbstractToolset[Any]]:
        """The agent's toolsets for one model request, its MCP toolsets replaced by the tools
        jetloop listed for this step (offered as external tools: the engine makes the calls)."""
        own = getattr(self.agent, "_function_toolset", None)
        mcp = _mcp_toolsets(self.agent)
        kept = [ts for ts in self.agent.toolsets if ts is not own and ts not in mcp]
        listed = [
            ToolDefinition(
                name=t.name, description=t.description, parameters_json_schema=t.parameters
            )
            for t in request.tools
            if any(s.known(t.name) is not None for s in self.mcp_servers)
        ]
        return [*kept, ExternalToolset(listed)] if listed else kept

    def model_name(self) -> str | None:
        """The agent's model's name, as the usage ledger prices it (None: it has none)."""
        raw = self.agent.model
        if isinstance(raw, str):
            return raw.rpartition(":")[2]
        name = getattr(raw, "model_name", None)
        return name if isinstance(name, str) else None

    def estimate_tokens(self, messages: list[Message]) -> int:
        return rough_tokens(messages)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        try:
            if request.purpose == "summary":
                return await self._summary(request)
            return await self._answer(request)
        except ModelHTTPError as exc:
            status = exc.status_code
            if status in _RETRYABLE_STATUS or status >= 500:
                raise ProviderRetryable(
                    exc.model_name, exc.message, retry_after=exc.retry_after, status=status
                ) from exc
            raise ProviderRejected(exc.model_name, exc.message, status=status) from exc
        except ModelAPIError as exc:
            raise ProviderRetryable(exc.model_name, exc.message) from exc
        except UserError as exc:
            raise ProviderRejected("pydantic-ai", str(exc)) from exc
        except UnexpectedModelBehavior as exc:
            raise ModelError(str(exc)) from exc

    async def _answer(self, request: ModelRequest) -> ModelResponse:
        history = to_model_messages(conversation(request.messages))
        # pydantic-ai sends system prompts only in a conversation's first request, which the
        # graph never builds here (the history is never empty): put them there ourselves.
        _open_with(history, await self.agent.system_prompt_parts(deps=self.deps))
        output_tools: set[str] = set()

        async def note_output_tools(
            ctx: RunContext[Any], request_context: pmodels.ModelRequestContext
        ) -> pmodels.ModelRequestContext:
            output_tools.update(
                t.name for t in request_context.model_request_parameters.output_tools
            )
            return request_context

        overridden = (
            self.agent.override(toolsets=self._toolsets(request))
            if self.mcp_servers
            else contextlib.nullcontext()
        )
        with overridden:
            return await self._run(history, request, output_tools, note_output_tools)

    async def _run(
        self,
        history: list[pm.ModelMessage],
        request: ModelRequest,
        output_tools: set[str],
        note_output_tools: Any,
    ) -> ModelResponse:
        async with self.agent.iter(
            None,
            message_history=history,
            deps=self.deps,
            conversation_id=request.session_id,
            capabilities=[Hooks(before_model_request=note_output_tools)],
        ) as run:
            node: Any = run.next_node
            while not isinstance(node, End):
                if isinstance(node, CallToolsNode):
                    answer = node.model_response
                    calls = [c for c in answer.tool_calls if c.tool_name not in output_tools]
                    if calls:
                        # Every call but the output tool's is the engine's to make, each as a
                        # step of its own (one of no tool the engine knows is recorded as a
                        # call to an unknown tool, which the model sees); an output tool call
                        # beside them is dropped: the model answers again after the results.
                        return ModelResponse(
                            text=answer.text or "",
                            tool_calls=[
                                ToolCallRequest(c.tool_name, c.args_as_dict(), c.tool_call_id)
                                for c in calls
                            ],
                            usage=_usage(run.usage),
                            model=answer.model_name or self.model_name(),
                        )
                # No call for the engine: pydantic-ai validates the output (and asks the model
                # again, within this step, if it does not validate).
                node = await run.next(node)
            output = node.data.output
            usage = _usage(run.usage)
        text = output if isinstance(output, str) else pydantic_core.to_json(output).decode()
        return ModelResponse(text=text, usage=usage, model=self.model_name())

    async def _summary(self, request: ModelRequest) -> ModelResponse:
        """The compaction call: the agent's model, no tools, the engine's instructions."""
        from pydantic_ai.direct import model_request

        history = to_model_messages(
            conversation(request.messages, tools_enabled=False, summary=True)
        )
        _open_with(history, [pm.SystemPromptPart(request.instructions)])
        model = self.agent.model
        if model is None:
            raise UserError("the pydantic-ai agent has no model")
        answer = await model_request(model, history)
        usage = {
            "input_tokens": answer.usage.input_tokens,
            "output_tokens": answer.usage.output_tokens,
        }
        return ModelResponse(
            text=answer.text or "", usage=usage, model=answer.model_name or self.model_name()
        )


def to_model_messages(items: Sequence[UserText | Context | Exchange]) -> list[pm.ModelMessage]:
    """jetloop's conversation (already paired and named by jetloop.agents.adapters.history) as
    pydantic-ai messages: user text and engine notes are request parts, an assistant message a
    ``ModelResponse`` and its results ``ToolReturnPart``s of the next request."""
    out: list[pm.ModelMessage] = []
    pending: list[pm.ModelRequestPart] = []

    def flush() -> None:
        if pending:
            out.append(pm.ModelRequest(parts=list(pending)))
            pending.clear()

    for item in items:
        if isinstance(item, UserText | Context):
            pending.append(pm.UserPromptPart(item.text))
            continue
        flush()
        parts: list[pm.ModelResponsePart] = [pm.TextPart(item.text)] if item.text else []
        parts += [pm.ToolCallPart(c.name, c.arguments, tool_call_id=c.id) for c in item.calls]
        out.append(pm.ModelResponse(parts=parts))
        pending += [
            pm.ToolReturnPart(r.name, r.content, tool_call_id=r.call_id) for r in item.results
        ]
    flush()
    return out


def _open_with(history: list[pm.ModelMessage], parts: Sequence[pm.ModelRequestPart]) -> None:
    """Put ``parts`` (system prompts) at the start of the conversation's first request."""
    if not parts:
        return
    if history and isinstance(history[0], pm.ModelRequest):
        history[0] = pm.ModelRequest(parts=[*parts, *history[0].parts])
    else:
        history.insert(0, pm.ModelRequest(parts=list(parts)))


def _usage(usage: RunUsage) -> dict[str, int]:
    out = {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}
    if usage.cache_read_tokens:
        out["cached_input_tokens"] = usage.cache_read_tokens
    return out


# --- output ---------------------------------------------------------------------------------


def _output_adapter(spec: Any) -> TypeAdapter[Any] | None:
    """How to read a final answer back: ``None`` for text, else a ``TypeAdapter`` of the
    output type (marker classes and lists of outputs unwrapped, an output function read by
    its return annotation)."""
    types = _output_types(spec)
    if types == [str]:
        return None
    if not types:
        return TypeAdapter(Any)
    joined: Any = types[0] if len(types) == 1 else Union[tuple(types)]  # noqa: UP007
    try:
        return TypeAdapter(joined)
    except (TypeError, PydanticSchemaGenerationError):
        return TypeAdapter(Any)  # a type pydantic cannot validate: the JSON as parsed


def _output_types(spec: Any) -> list[Any]:
    if isinstance(spec, ToolOutput):
        return _output_types(spec.output)
    if isinstance(spec, NativeOutput | PromptedOutput):
        return _output_types(spec.outputs)
    if isinstance(spec, TextOutput):
        return _output_types(spec.output_function)
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return [t for s in spec for t in _output_types(s)]
    if inspect.isfunction(spec) or inspect.ismethod(spec):
        ret = inspect.signature(spec, eval_str=True).return_annotation
        return [] if ret is inspect.Signature.empty else [ret]
    return [spec]
