"""Agents and the app a worker loads: ``jetloop worker --app module:attr``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from jetloop.agents.model import ModelAdapter
from jetloop.agents.tools import Tool
from jetloop.schemas import validate_name


@dataclass(frozen=True)
class Limits:
    """An agent's bounds: model steps per turn, attempts of a model step within a window,
    and the context budget past which the history is compacted (None: never)."""

    max_model_steps: int = 16
    model_attempts: int = 3
    model_attempt_window_seconds: float = 1800.0
    # CompactContext: when the model's input passes this estimate, the history before the
    # current turn is summarised once (None: never).
    context_budget_tokens: int | None = None


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
    """An agent: its name (a subject token), instructions, model adapter, tools, limits and
    cron triggers. Serve it with a worker through an ``App``."""

    name: str
    instructions: str
    model: ModelAdapter
    tools: tuple[Tool, ...] = ()
    limits: Limits = field(default_factory=Limits)
    triggers: tuple[Trigger, ...] = ()

    def __post_init__(self) -> None:
        validate_name("agent name", self.name)
        seen: set[str] = set()
        for t in self.tools:
            if t.name in seen:
                raise ValueError(f"agent {self.name}: two tools are named {t.name!r}")
            seen.add(t.name)

    def tool(self, name: str) -> Tool | None:
        for t in self.tools:
            if t.name == name:
                return t
        return None


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


def load_app(spec: str) -> App:
    """Load ``module:attr``; the attribute is an ``App``, an ``Agent`` or a factory of one."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--app {spec!r}: expected module:attr")
    # As uvicorn does: a module in the working directory is importable without PYTHONPATH.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"--app {spec!r}: module {module_name} has no {attr!r}") from None
    if callable(obj) and not isinstance(obj, App | Agent):
        obj = obj()
    if isinstance(obj, Agent):
        return App([obj])
    if isinstance(obj, App):
        return obj
    raise ValueError(f"--app {spec!r}: expected an App or an Agent, got {type(obj).__name__}")
