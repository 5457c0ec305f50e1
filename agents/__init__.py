"""Defining agents and tools: what user code writes, and what a worker loads."""

from agents.agent import Agent, App, Limits, load_app
from agents.model import (
    Message,
    ModelAdapter,
    ModelError,
    ModelRequest,
    ModelResponse,
    ScriptedModel,
    ToolCallRequest,
    ToolSpec,
)
from agents.tools import (
    Effect,
    RetryableToolError,
    Tool,
    ToolContext,
    ToolError,
    tool,
)

__all__ = [
    "Agent",
    "App",
    "Effect",
    "Limits",
    "Message",
    "ModelAdapter",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "RetryableToolError",
    "ScriptedModel",
    "Tool",
    "ToolCallRequest",
    "ToolContext",
    "ToolError",
    "ToolSpec",
    "load_app",
    "tool",
]
