"""Agents and the app a worker loads: ``jetloop worker --app module:attr``."""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from jetloop.agents.mcp import MCPServer
from jetloop.agents.model import ModelAdapter
from jetloop.agents.tools import DEFAULT_TOOL_POOL, Tool
from jetloop.schemas import validate_name
from jetloop.schemas.errors import AppLoadError

log = structlog.get_logger("jetloop.agents")


@dataclass(frozen=True)
class Budget:
    """A cap on what model calls may use: tokens (input + output) and/or US dollars (priced
    by the worker's price table, ``jetloop.agents.prices``). None: no cap of that kind."""

    tokens: int | None = None
    cost_usd: float | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None and self.tokens <= 0:
            raise ValueError(f"a budget's tokens must be positive, not {self.tokens}")
        if self.cost_usd is not None and self.cost_usd <= 0:
            raise ValueError(f"a budget's cost_usd must be positive, not {self.cost_usd}")


@dataclass(frozen=True)
class Limits:
    """An agent's bounds: model steps per turn, attempts of a model step within a window,
    the context budget past which the history is compacted (None: never), and what the
    model calls of a turn and of a session may use."""

    max_model_steps: int = 16
    model_attempts: int = 3
    model_attempt_window_seconds: float = 1800.0
    # CompactContext: when the model's input passes this estimate, the history before the
    # current turn is summarised once (None: never).
    context_budget_tokens: int | None = None
    # Caps on the model calls of one turn, and of all the turns of one session (every
    # attempt counts, those a crash made repeat too): a turn whose next model call would
    # pass one fails with a reason that starts "budget:" (None: no cap).
    turn_budget: Budget | None = None
    session_budget: Budget | None = None


@dataclass(frozen=True)
class Trigger:
    """A cron trigger: a NATS message schedule that starts a turn of its agent.

    ``schedule`` is a 6-field cron expression (with seconds) or ``@every 5m``; each fire
    publishes ``text`` to ``session`` (default ``cron-<name>``) with a request id made of the
    trigger and its fire time, so a fire delivered twice runs once.
    """

    name: str
    schedule: str
    text: str
    session: str | None = None

    def __post_init__(self) -> None:
        validate_name("trigger name", self.name)
        if self.session is not None:
            validate_name("session id", self.session)

    @property
    def session_id(self) -> str:
        return self.session or f"cron-{self.name}"


@dataclass(frozen=True)
class Agent:
    """An agent: its name (a subject token), instructions, model adapter, tools, limits,
    cron triggers and the MCP servers whose tools it offers too (``jetloop.agents.mcp``).
    Serve it with a worker through an ``App``."""

    name: str
    instructions: str
    model: ModelAdapter
    tools: tuple[Tool, ...] = ()
    limits: Limits = field(default_factory=Limits)
    triggers: tuple[Trigger, ...] = ()
    mcp_servers: tuple[MCPServer, ...] = ()

    def __post_init__(self) -> None:
        validate_name("agent name", self.name)
        seen: set[str] = set()
        for t in self.tools:
            if t.name in seen:
                raise ValueError(f"agent {self.name}: two tools are named {t.name!r}")
            seen.add(t.name)
        servers: set[str] = set()
        for s in self.mcp_servers:
            if s.name in servers:
                raise ValueError(f"agent {self.name}: two MCP servers are named {s.name!r}")
            servers.add(s.name)

    def tool(self, name: str) -> Tool | None:
        """The tool of this name: the agent's own, else the first MCP server's that listed it
        (as this worker last read the lists)."""
        for t in self.tools:
            if t.name == name:
                return t
        for s in self.mcp_servers:
            found = s.known(name)
            if found is not None:
                return found
        return None

    async def list_tools(self) -> tuple[Tool, ...]:
        """The tools the model is offered now: the agent's own, then each MCP server's as it
        lists them now (a tool named as one before it is left out, with a warning). Raises
        ``MCPUnreachable`` for a server this worker could never list."""
        if not self.mcp_servers:
            return self.tools
        offered = list(self.tools)
        names = {t.name for t in offered}
        for s in self.mcp_servers:
            for t in await s.list_tools():
                if t.name in names:
                    log.warning("mcp.tool_shadowed", server=s.name, tool=t.name)
                    continue
                names.add(t.name)
                offered.append(t)
        return tuple(offered)

    async def find_tool(self, name: str) -> Tool | None:
        """``tool(name)`` as it stands now: the MCP servers are listed again first (a server
        may have removed or changed the tool since the model was offered it), unless it is
        one of the agent's own."""
        if not self.mcp_servers or any(t.name == name for t in self.tools):
            return self.tool(name)
        for s in self.mcp_servers:
            await s.list_tools()
        return self.tool(name)


class App:
    """The agents one worker serves."""

    def __init__(self, agents: Iterable[Agent] = ()) -> None:
        self.agents: dict[str, Agent] = {}
        for a in agents:
            self.add(a)

    def add(self, agent: Agent) -> None:
        if agent.name in self.agents:
            raise ValueError(f"two agents are named {agent.name!r}")
        self.agents[agent.name] = agent

    def agent(self, name: str) -> Agent | None:
        return self.agents.get(name)

    def tool_pools(self, agent: str | None = None, made_here: bool = False) -> tuple[str, ...]:
        """The pools of their own that the tools of ``agent`` (else every agent) name
        (``Tool.pool``); ``made_here``: only of tools this app makes, not those it declares
        as served elsewhere."""
        found = {
            t.pool
            for a in self.agents.values()
            if agent is None or a.name == agent
            for t in a.tools
            if t.pool != DEFAULT_TOOL_POOL and not (made_here and t.elsewhere)
        }
        return tuple(sorted(found))


def load_app(spec: str) -> App:
    """Load ``module:attr``; the attribute is an ``App``, an ``Agent`` or a factory of one.
    :class:`AppLoadError` in one line when it does not load: a module that is not there is
    told apart from an error raised inside the user's module (given with its file and line)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise AppLoadError(f"--app {spec!r}: expected module:attr")
    # As uvicorn does: a module in the working directory is importable without PYTHONPATH.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise AppLoadError(
                f"--app {spec!r}: no module named {missing!r} (looked in {os.getcwd()} and "
                "on sys.path: run from the directory that holds it, or set PYTHONPATH)"
            ) from None
        raise AppLoadError(f"--app {spec!r}: {raised_at(exc)}") from None
    except Exception as exc:  # the user's module: anything may come out of its import
        raise AppLoadError(f"--app {spec!r}: {raised_at(exc)}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise AppLoadError(f"--app {spec!r}: module {module_name} has no {attr!r}") from None
    if callable(obj) and not isinstance(obj, App | Agent):
        try:
            obj = obj()
        except Exception as exc:
            raise AppLoadError(f"--app {spec!r}: {raised_at(exc)}") from None
    if isinstance(obj, Agent):
        return App([obj])
    if isinstance(obj, App):
        return obj
    raise AppLoadError(f"--app {spec!r}: expected an App or an Agent, got {type(obj).__name__}")


def raised_at(exc: BaseException) -> str:
    """An error with where the user's code raised it: ``file:line: Type: message``, at the
    innermost frame that is neither Python's, an installed package's nor jetloop's (else the
    innermost); a SyntaxError names its own place."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    theirs = [f for f in frames if not f.filename.startswith(_NOT_THE_USERS)]
    at = (theirs or frames)[-1:]
    if not at:
        return text
    return f"{at[0].filename}:{at[0].lineno}: {text}"


# Where code that is not the user's lives: Python's, installed packages', jetloop's own.
_NOT_THE_USERS = tuple(
    {
        sysconfig.get_path("stdlib"),
        sysconfig.get_path("purelib"),
        sysconfig.get_path("platlib"),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    }
)
