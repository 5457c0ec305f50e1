"""Tools: async functions with a pydantic argument model, an effect class and a policy.

The effect class decides what a crash may repeat (docs/crash-resume.md, "Settlement of a call in
doubt"): a ``READ`` is made again, an ``IDEMPOTENT_WRITE`` is made again with the same idempotency
key, a ``NON_IDEMPOTENT_WRITE`` runs at most once and is settled ``outcome_unknown`` when a crash
leaves it in doubt.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from pydantic import BaseModel


class Effect(StrEnum):
    """What a tool does to the world, which decides what a crash may repeat: a ``READ`` is
    made again, an ``IDEMPOTENT_WRITE`` again with the same idempotency key, a
    ``NON_IDEMPOTENT_WRITE`` at most once (settled ``outcome_unknown`` when in doubt)."""

    READ = "read"
    IDEMPOTENT_WRITE = "idempotent_write"
    NON_IDEMPOTENT_WRITE = "non_idempotent_write"

    @property
    def is_write(self) -> bool:
        return self is not Effect.READ


class ToolKind(StrEnum):
    CALL = "call"  # an ordinary tool: one call, one result
    TASK = "task"  # start → handle, then polls until done (PollToolTask)
    QUESTION = "question"  # the built-in ask_user: waits for a person's answer
    TIMER = "timer"  # the built-in wait: a durable timer (message schedule)
    DELEGATE = "delegate"  # the built-in delegate: a child session of another agent


class ToolContext(Protocol):
    """What a tool gets besides its arguments: which call it is, and the hooks of its run.

    The ids are those of the wire protocol (docs/protocol.md): a tool that records or logs
    what it did can name the session, the turn and the call it did it for. They are unique
    only within a namespace (two tenants may use the same session and request ids, and so
    have the same turn and call ids): a tool that keeps records keys them by
    ``(namespace, ...)``.
    """

    @property
    def namespace(self) -> str:
        """The namespace the call's session lives in (``default`` unless the deployment
        names others: docs/design.md, Namespaces)."""
        ...

    @property
    def session_id(self) -> str:
        """The session the call belongs to."""
        ...

    @property
    def turn_id(self) -> str:
        """The turn the call belongs to (``t`` + 20 hex characters)."""
        ...

    @property
    def model_step(self) -> int:
        """The model step (from 0) whose answer asked for this call."""
        ...

    @property
    def call_id(self) -> str:
        """``<turn id>-<model step>-<index>``: unique within the session, the same on every
        attempt; ``index`` is the call's place (from 0) in its model step's answer. The
        call's state key is ``call.<session>.<turn>.<model step>.<index>``."""
        ...

    @property
    def idempotency_key(self) -> str:
        """Identical on every attempt of this call: hand it to the vendor. Distinct across
        namespaces (it is derived from the namespace too, outside ``default``)."""
        ...

    @property
    def attempt(self) -> int:
        """This call's attempt, from 1: more than 1 after a crash or a retry."""
        ...

    async def heartbeat(self) -> None:
        """Keep the lease while a long tool runs (also done automatically)."""
        ...

    @property
    def cancelled(self) -> bool:
        """True once the turn was cancelled: stop early if you can."""
        ...


ToolFn = Callable[[Any, ToolContext], Awaitable[Any]]
ApprovalPolicy = bool | Callable[[Any], bool]


@dataclass(frozen=True)
class Found:
    """A reader found the write applied: this is its result."""

    result: Any


@dataclass(frozen=True)
class NotFound:
    """A reader found no trace of the write: it did not apply, so it may be made."""


ReadBack = Found | NotFound
ReaderFn = Callable[[Any, ToolContext], Awaitable[ReadBack]]


@dataclass(frozen=True)
class TaskPending:
    """The task is still running: poll again later."""


@dataclass(frozen=True)
class TaskDone:
    """The task finished: ``result`` is the call's result."""

    result: Any


@dataclass(frozen=True)
class TaskFailed:
    """The task failed: the call fails with ``error`` (the model sees it)."""

    error: str


PollResult = TaskPending | TaskDone | TaskFailed
StartFn = Callable[[Any, ToolContext], Awaitable[Any]]
PollFn = Callable[[Any, ToolContext], Awaitable[PollResult]]
CancelFn = Callable[[Any, ToolContext], Awaitable[None]]


# The pool of workers that make a tool's calls (``jl.step.<pool>.<agent>.…``): ``tool`` unless
# the tool says otherwise. Another name is a pool of its own, for a tool that other workers
# serve: a Node.js worker, or Python workers kept apart (docs/agents.md, "Tools served by
# other workers"). The session and model pools are the engine's.
DEFAULT_TOOL_POOL = "tool"
RESERVED_POOLS = frozenset({"session", "model"})
_POOL_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def check_pool(pool: str, what: str) -> str:
    """``pool`` if it can name a pool of tool workers (a subject token and part of a durable's
    name), else a ``ValueError`` that names ``what`` asked for it."""
    if not _POOL_NAME.fullmatch(pool):
        raise ValueError(
            f"{what}: pool {pool!r} is not a pool name (lower-case letters, digits, '_' "
            "and '-', starting with a letter, at most 32 characters)"
        )
    if pool in RESERVED_POOLS:
        raise ValueError(f"{what}: pool {pool!r} is the engine's own; name another")
    return pool


@functools.cache
def _schema_of(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema()


@dataclass(frozen=True)
class Tool:
    """A tool an agent may call, as ``tool`` / ``task_tool`` declare it: its function, effect
    class, attempts, approval policy and, for a task, its poll and cancel."""

    name: str
    description: str
    args_model: type[BaseModel]
    fn: ToolFn
    effect: Effect
    max_attempts: int = 3
    attempt_window_seconds: float = 1800.0
    # True, False, or a predicate over the validated arguments (AwaitToolApproval).
    approval: ApprovalPolicy = False
    # For a NON_IDEMPOTENT_WRITE: reads back, by the idempotency key, whether a call that
    # was in doubt applied (settlement "single-attempt write with a reader").
    reader: ReaderFn | None = None
    kind: ToolKind = ToolKind.CALL
    poll: PollFn | None = None
    cancel: CancelFn | None = None
    poll_interval: float = 1.0
    timeout_seconds: float | None = None
    # An IDEMPOTENT_WRITE whose vendor dedupes a key only for this long: a resume within
    # the window sends again with the same key, past it the call is settled like any write.
    dedupe_window_seconds: float | None = None
    # The arguments' JSON schema as the tool's owner gave it (an MCP server's tool), when it
    # is not derived from ``args_model``; and where the effect class was read from, when it
    # was not declared in code (an MCP server's annotations), for the snapshot and console.
    schema: dict[str, Any] | None = None
    effect_from: str | None = None
    # The workers that make this tool's calls: ``tool`` (every worker of the tool pool),
    # or a pool of its own (``check_pool``); its calls are then sent one message each, on
    # ``jl.step.<pool>.<agent>.…``.
    pool: str = DEFAULT_TOOL_POOL
    # Declared here, made elsewhere (``served_elsewhere``): this process has no function
    # for it and never serves its pool.
    elsewhere: bool = False

    def __post_init__(self) -> None:
        if self.pool != DEFAULT_TOOL_POOL:
            check_pool(self.pool, f"tool {self.name}")
            if self.kind is not ToolKind.CALL:
                raise ValueError(
                    f"tool {self.name}: only a plain call may have a pool of its own "
                    f"(this one is a {self.kind.value})"
                )

    def json_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema, computed once per argument model (read-only)."""
        if self.schema is not None:
            return self.schema
        return _schema_of(self.args_model)

    def needs_approval(self, args: BaseModel) -> bool:
        if callable(self.approval):
            return bool(self.approval(args))
        return bool(self.approval)


def tool(
    *,
    effect: Effect,
    name: str | None = None,
    description: str | None = None,
    max_attempts: int = 3,
    attempt_window_seconds: float = 1800.0,
    args_model: type[BaseModel] | None = None,
    approval: ApprovalPolicy = False,
    reader: ReaderFn | None = None,
    dedupe_window_seconds: float | None = None,
    pool: str = DEFAULT_TOOL_POOL,
) -> Callable[[ToolFn], Tool]:
    """Declare a tool: ``async def fn(args: ArgsModel, ctx: ToolContext) -> result``.

    The argument model is read from the first parameter's annotation. ``pool``: the workers
    that make its calls, when not every worker of the tool pool (``served_elsewhere``).
    """

    def wrap(fn: ToolFn) -> Tool:
        model = _args_model_of(fn, args_model)
        return Tool(
            name=name or fn.__name__,
            description=description or (inspect.getdoc(fn) or "").strip(),
            args_model=model,
            fn=fn,
            effect=effect,
            max_attempts=max_attempts,
            attempt_window_seconds=attempt_window_seconds,
            approval=approval,
            reader=reader,
            dedupe_window_seconds=dedupe_window_seconds,
            pool=pool,
        )

    return wrap


class AnyArgs(BaseModel, extra="allow"):
    """The arguments of a tool declared by its JSON schema only: taken as the model gave
    them (the worker that serves the tool checks them)."""


async def _served_elsewhere(args: Any, ctx: ToolContext) -> Any:
    raise RuntimeError("a tool served elsewhere is made by the workers of its pool")


def served_elsewhere(
    *,
    name: str,
    pool: str,
    effect: Effect,
    description: str = "",
    args_model: type[BaseModel] | None = None,
    schema: dict[str, Any] | None = None,
) -> Tool:
    """A tool whose calls other workers make: those that serve ``pool`` (a Node.js worker,
    or Python workers started with ``--pools <pool>``). This process offers it to the model,
    checks its arguments (``args_model``, else only that they are an object matching
    ``schema`` as the model was told), plans its calls with ``effect`` and sends each on
    ``jl.step.<pool>.<agent>.…``; it never makes one. Whether a person approves a call first
    is the policy of the worker that makes it (its own declaration of the tool), and so are
    its attempts."""
    if args_model is None and schema is None:
        raise ValueError(f"tool {name}: give its arguments as args_model or a JSON schema")
    if pool == DEFAULT_TOOL_POOL:
        raise ValueError(
            f"tool {name}: served elsewhere needs a pool of its own: the {pool!r} pool is "
            "every worker's that serves the agent, this one's too"
        )
    return Tool(
        name=name,
        description=description,
        args_model=args_model or AnyArgs,
        fn=_served_elsewhere,
        effect=effect,
        schema=schema if args_model is None else None,
        pool=check_pool(pool, f"tool {name}"),
        elsewhere=True,
    )


def _args_model_of(fn: Callable[..., Any], explicit: type[BaseModel] | None) -> type[BaseModel]:
    params = list(inspect.signature(fn).parameters.values())
    if len(params) != 2:
        raise TypeError(f"tool {fn.__name__}: expected (args, ctx), got {len(params)} params")
    model = explicit or params[0].annotation
    if isinstance(model, str):
        try:
            model = eval(model, fn.__globals__)  # a postponed annotation, as typing does
        except NameError:
            raise TypeError(
                f"tool {fn.__name__}: cannot resolve the annotation {model!r}; define the "
                "model at module level or pass args_model=..."
            ) from None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"tool {fn.__name__}: first parameter must be a pydantic model")
    return model


def task_tool(
    *,
    name: str,
    start: StartFn,
    poll: PollFn,
    cancel: CancelFn | None = None,
    effect: Effect = Effect.IDEMPOTENT_WRITE,
    description: str = "",
    args_model: type[BaseModel] | None = None,
    poll_interval: float = 1.0,
    max_attempts: int = 3,
    approval: ApprovalPolicy = False,
) -> Tool:
    """A long-running task: ``start(args, ctx) -> handle`` (recorded exactly once, so a crash
    never starts a second task), then ``poll(handle, ctx)`` every ``poll_interval`` seconds
    until it returns ``TaskDone`` or ``TaskFailed``; ``cancel(handle, ctx)`` when the turn is
    cancelled. The start is made as its ``effect`` says (give the vendor ctx.idempotency_key).
    """
    return Tool(
        name=name,
        description=description or (inspect.getdoc(start) or "").strip(),
        args_model=_args_model_of(start, args_model),
        fn=start,
        effect=effect,
        max_attempts=max_attempts,
        approval=approval,
        kind=ToolKind.TASK,
        poll=poll,
        cancel=cancel,
        poll_interval=poll_interval,
    )


class AskUserArgs(BaseModel):
    question: str


class WaitArgs(BaseModel):
    seconds: float


async def _never(args: Any, ctx: ToolContext) -> Any:
    raise RuntimeError("built-in tools are run by the engine, not called")


ask_user = Tool(
    name="ask_user",
    description="Ask the user a question and wait for the answer.",
    args_model=AskUserArgs,
    fn=_never,
    effect=Effect.READ,
    kind=ToolKind.QUESTION,
)


class DelegateArgs(BaseModel):
    agent: str
    task: str


delegate = Tool(
    name="delegate",
    description="Hand a task to another agent and wait for its answer.",
    args_model=DelegateArgs,
    fn=_never,
    effect=Effect.IDEMPOTENT_WRITE,
    kind=ToolKind.DELEGATE,
)

wait = Tool(
    name="wait",
    description="Wait the given number of seconds (a durable timer) before going on.",
    args_model=WaitArgs,
    fn=_never,
    effect=Effect.READ,
    kind=ToolKind.TIMER,
)
