"""jetloop: durable execution of AI-agent turns on NATS JetStream.

The public face: define agents and tools, run workers, drive sessions. Re-exports only;
user code never imports the internal packages.
"""

from agents import (
    Agent,
    App,
    Effect,
    Limits,
    Message,
    ModelAdapter,
    ModelError,
    ModelRequest,
    ModelResponse,
    RetryableToolError,
    ScriptedModel,
    Tool,
    ToolCallRequest,
    ToolContext,
    ToolError,
    ToolSpec,
    load_app,
    tool,
)
from consumers import TOOL_CALL_NOT_RUN_ERROR_PREFIX
from services.client import Client, TurnFailed, TurnHandle, TurnResult
from services.embedded import EmbeddedServer
from services.settings import Settings, SettingsError, load_settings
from services.worker import Worker

__all__ = [
    "TOOL_CALL_NOT_RUN_ERROR_PREFIX",
    "Agent",
    "App",
    "Client",
    "Effect",
    "EmbeddedServer",
    "Limits",
    "Message",
    "ModelAdapter",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "RetryableToolError",
    "ScriptedModel",
    "Settings",
    "SettingsError",
    "Tool",
    "ToolCallRequest",
    "ToolContext",
    "ToolError",
    "ToolSpec",
    "TurnFailed",
    "TurnHandle",
    "TurnResult",
    "Worker",
    "load_app",
    "load_settings",
    "tool",
]
