"""The model adapter seam: what a provider adapter implements, and the scripted model.

The engine hands an adapter the agent's instructions, the conversation (one history schema)
and the tools; the adapter answers with text and the tool calls it wants. Provider adapters
(OpenAI, Anthropic, …) implement the same ``ModelAdapter`` protocol.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from jetloop.schemas import HistoryEntry


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model is told about it: name, description, JSON Schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Message:
    """One conversation entry, with large payloads already resolved."""

    role: str  # "user" | "assistant" | "tool"
    text: str | None = None
    calls: list[ToolCallRequest] = field(default_factory=list)
    call_id: str | None = None
    tool: str | None = None
    status: str | None = None
    result: Any = None

    @classmethod
    def from_entry(cls, e: HistoryEntry, text: str | None, result: Any) -> Message:
        return cls(
            role=e.role.value,
            text=text,
            calls=[
                ToolCallRequest(name=c.tool, arguments=c.args, provider_id=c.provider_id)
                for c in e.calls
            ],
            call_id=e.call_id,
            tool=e.tool,
            status=e.status.value if e.status else None,
            result=result,
        )


@dataclass(frozen=True)
class ToolCallRequest:
    """A call the model asks for: the tool's name, its arguments, and the provider's own id
    for the call (kept for the provider only)."""

    name: str
    arguments: dict[str, Any]
    provider_id: str | None = None


@dataclass(frozen=True)
class ModelRequest:
    """What a model adapter is asked: the conversation so far, and which step asks.

    ``session_id``, ``turn_id`` and ``model_step`` say which turn's step this is (the ids of
    docs/protocol.md), so an adapter can tag its provider request or its logs with them.
    ``model_step`` counts from 0; ``attempt`` counts from 1 and is more than 1 when the step
    is tried again (after a crash or a retryable provider error). ``purpose`` is
    ``"answer"`` for a turn's model step and ``"summary"`` for the one summary call that
    compacts a long history; a summary call is made for the step it precedes (its
    ``model_step``).
    """

    agent: str
    instructions: str
    messages: list[Message]
    tools: list[ToolSpec]
    attempt: int
    purpose: str = "answer"
    session_id: str = ""
    turn_id: str = ""
    model_step: int = 0


@dataclass(frozen=True)
class ModelResponse:
    """A model's answer: text, the calls it asks for (none: the turn's final answer), token
    usage (``input_tokens``, cached ones included; ``output_tokens``;
    ``cached_input_tokens``) and the model that answered when the adapter's own ``model``
    name does not say it (the usage ledger prices the call by it)."""

    text: str = ""
    tool_calls: list[ToolCallRequest] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    model: str | None = None


class ModelAdapter(Protocol):
    """What a provider adapter implements. It may also define
    ``estimate_tokens(messages) -> int`` (the engine falls back to ``rough_tokens``)."""

    async def complete(self, request: ModelRequest) -> ModelResponse: ...


def rough_tokens(messages: list[Message]) -> int:
    """About four characters a token: good enough to decide when to compact."""
    total = 0
    for m in messages:
        total += len(m.text or "") + 16
        if m.result is not None:
            total += len(m.result) if isinstance(m.result, str) else len(json.dumps(m.result))
        for c in m.calls:
            total += len(c.name) + len(json.dumps(c.arguments))
    return total // 4


ScriptFn = Callable[[ModelRequest], ModelResponse | Awaitable[ModelResponse]]


class ScriptedModel:
    """A deterministic model from a plain function: for demos and tests, no network.

    Its calls count in the usage ledger as model ``model`` (``"scripted"``; a subclass or
    the ``model`` argument names another, a priced one to try budgets) with the tokens the
    script's response reports, else an estimate (about four characters a token), so the
    ledger and budgets have something to count; a scripted model has no price."""

    model = "scripted"

    def __init__(self, script: ScriptFn, model: str | None = None) -> None:
        self.script = script
        if model is not None:
            self.model = model

    def estimate_tokens(self, messages: list[Message]) -> int:
        return rough_tokens(messages)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        out = self.script(request)
        if not isinstance(out, ModelResponse):
            out = await out
        if out.usage:
            return out
        read = rough_tokens(request.messages) + len(request.instructions) // 4
        wrote = len(out.text) // 4 + sum(
            8 + len(json.dumps(c.arguments)) // 4 for c in out.tool_calls
        )
        return dataclasses.replace(out, usage={"input_tokens": read, "output_tokens": wrote})
