"""Defining agents and tools: what user code writes, and what a worker loads."""

from jetloop.agents.adapters import (
    MalformedToolCall,
    adapter_from_spec,
)
from jetloop.agents.agent import Agent, App, Budget, Limits, Trigger, load_app
from jetloop.agents.mcp import MCPServer
from jetloop.agents.model import (
    Message,
    ModelAdapter,
    ModelRequest,
    ModelResponse,
    ScriptedModel,
    ToolCallRequest,
    ToolSpec,
    rough_tokens,
)
from jetloop.agents.tools import (
    Effect,
    Found,
    NotFound,
    TaskDone,
    TaskFailed,
    TaskPending,
    Tool,
    ToolContext,
    ToolKind,
    ask_user,
    delegate,
    task_tool,
    tool,
    wait,
)

__all__ = [
    "Agent",
    "App",
    "Budget",
    "Effect",
    "Found",
    "Limits",
    "MCPServer",
    "MalformedToolCall",
    "Message",
    "ModelAdapter",
    "ModelRequest",
    "ModelResponse",
    "NotFound",
    "ScriptedModel",
    "TaskDone",
    "TaskFailed",
    "TaskPending",
    "Tool",
    "ToolCallRequest",
    "ToolContext",
    "ToolKind",
    "ToolSpec",
    "Trigger",
    "adapter_from_spec",
    "ask_user",
    "delegate",
    "load_app",
    "rough_tokens",
    "task_tool",
    "tool",
    "wait",
]
