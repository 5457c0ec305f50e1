"""Tools: async functions with a pydantic argument model, an effect class and a policy.

The effect class decides what a crash may repeat (ARCHITECTURE.md, settlement table):
a ``READ`` is made again, an ``IDEMPOTENT_WRITE`` is made again with the same idempotency
key, a ``NON_IDEMPOTENT_WRITE`` runs at most once and is settled ``outcome_unknown`` when a
crash leaves it in doubt.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from pydantic import BaseModel


class Effect(StrEnum):
    READ = "read"
    IDEMPOTENT_WRITE = "idempotent_write"
    NON_IDEMPOTENT_WRITE = "non_idempotent_write"

    @property
    def is_write(self) -> bool:
        return self is not Effect.READ


class ToolContext(Protocol):
    """What a tool gets besides its arguments."""

    @property
    def call_id(self) -> str: ...

    @property
    def idempotency_key(self) -> str:
        """Identical on every attempt of this call: hand it to the vendor."""
        ...

    @property
    def attempt(self) -> int: ...

    async def heartbeat(self) -> None:
        """Keep the lease while a long tool runs (also done automatically)."""
        ...


ToolFn = Callable[[Any, ToolContext], Awaitable[Any]]


class ToolError(Exception):
    """A tool's failure the model should see as a failed call (not retried)."""


class RetryableToolError(Exception):
    """A transient failure: the call is tried again, within its attempts."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    args_model: type[BaseModel]
    fn: ToolFn
    effect: Effect
    max_attempts: int = 3
    attempt_window_seconds: float = 1800.0
    # Approval policies (AwaitToolApproval) are not built yet; declaring one is refused at
    # load time rather than silently ignored.
    approval: bool = False

    def json_schema(self) -> dict[str, Any]:
        return self.args_model.model_json_schema()


def tool(
    *,
    effect: Effect,
    name: str | None = None,
    description: str | None = None,
    max_attempts: int = 3,
    attempt_window_seconds: float = 1800.0,
    args_model: type[BaseModel] | None = None,
) -> Callable[[ToolFn], Tool]:
    """Declare a tool: ``async def fn(args: ArgsModel, ctx: ToolContext) -> result``.

    The argument model is read from the first parameter's annotation.
    """

    def wrap(fn: ToolFn) -> Tool:
        params = list(inspect.signature(fn).parameters.values())
        if len(params) != 2:
            raise TypeError(f"tool {fn.__name__}: expected (args, ctx), got {len(params)} params")
        model = args_model or params[0].annotation
        if isinstance(model, str):
            try:
                model = eval(model, fn.__globals__)  # a postponed annotation, as typing does
            except NameError:
                raise TypeError(
                    f"tool {fn.__name__}: cannot resolve the annotation {model!r}; define the "
                    "model at module level or pass tool(args_model=...)"
                ) from None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"tool {fn.__name__}: first parameter must be a pydantic model")
        return Tool(
            name=name or fn.__name__,
            description=description or (inspect.getdoc(fn) or "").strip(),
            args_model=model,
            fn=fn,
            effect=effect,
            max_attempts=max_attempts,
            attempt_window_seconds=attempt_window_seconds,
        )

    return wrap


@dataclass
class ToolSet:
    tools: dict[str, Tool] = field(default_factory=dict)

    def add(self, t: Tool) -> None:
        if t.name in self.tools:
            raise ValueError(f"two tools are named {t.name!r}")
        self.tools[t.name] = t
