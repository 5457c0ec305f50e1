"""jetloop: durable execution of AI-agent turns on NATS JetStream.

The public face: define agents and tools, run workers, drive sessions. Re-exports only;
user code never imports the internal packages. ``docs/api.md`` lists every name with what
it is for; each has its own docstring.

Errors (catch ``JetloopError`` for all of them)::

    JetloopError
    ├── SealError               state could not be checked
    │   ├── SealKeyMissing      no JETLOOP_SEAL_KEY, and reading unverified was not chosen
    │   └── RecordNotTrusted    a record's seal does not verify (.key, .reason)
    ├── UnknownId (LookupError) no such thing
    │   ├── UnknownAgent        no worker has ever served this agent
    │   ├── UnknownSession      no such session
    │   └── UnknownTurn         no such turn in the session
    ├── ControlError            a decision refused (.status as in HTTP, .title, .detail)
    ├── TurnFailed              the turn ended failed or cancelled (.turn)
    ├── NotAuthorized           the NATS server refused the credentials (a nats error too)
    └── SettingsError           a setting has a wrong value
"""

from jetloop.agents import (
    Agent,
    App,
    Effect,
    Limits,
    MalformedToolCall,
    Message,
    ModelAdapter,
    ModelError,
    ModelRequest,
    ModelResponse,
    ProviderError,
    ProviderRejected,
    ProviderRetryable,
    RetryableToolError,
    ScriptedModel,
    TaskDone,
    TaskFailed,
    TaskPending,
    Tool,
    ToolCallRequest,
    ToolContext,
    ToolError,
    ToolSpec,
    Trigger,
    adapter_from_spec,
    ask_user,
    delegate,
    load_app,
    task_tool,
    tool,
    wait,
)
from jetloop.agents.tools import Found, NotFound
from jetloop.consumers import TOOL_CALL_NOT_RUN_ERROR_PREFIX
from jetloop.consumers.control import ControlError
from jetloop.consumers.snapshot import CallView, SessionSnapshot
from jetloop.consumers.turns import TurnDetail, TurnPage, TurnSummary
from jetloop.schemas import Event, EventType, TurnRecord, TurnStatus
from jetloop.schemas.errors import (
    JetloopError,
    RecordNotTrusted,
    SealError,
    SealKeyMissing,
    TurnFailed,
    UnknownAgent,
    UnknownId,
    UnknownSession,
    UnknownTurn,
)
from jetloop.services.client import Client, TurnHandle, TurnResult
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.settings import Settings, SettingsError, load_settings
from jetloop.services.worker import Worker
from jetloop.streams.connection import NotAuthorized

__all__ = [
    "TOOL_CALL_NOT_RUN_ERROR_PREFIX",
    "Agent",
    "App",
    "CallView",
    "Client",
    "ControlError",
    "Effect",
    "EmbeddedServer",
    "Event",
    "EventType",
    "Found",
    "JetloopError",
    "Limits",
    "MalformedToolCall",
    "Message",
    "ModelAdapter",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "NotAuthorized",
    "NotFound",
    "ProviderError",
    "ProviderRejected",
    "ProviderRetryable",
    "RecordNotTrusted",
    "RetryableToolError",
    "ScriptedModel",
    "SealError",
    "SealKeyMissing",
    "SessionSnapshot",
    "Settings",
    "SettingsError",
    "TaskDone",
    "TaskFailed",
    "TaskPending",
    "Tool",
    "ToolCallRequest",
    "ToolContext",
    "ToolError",
    "ToolSpec",
    "Trigger",
    "TurnDetail",
    "TurnFailed",
    "TurnHandle",
    "TurnPage",
    "TurnRecord",
    "TurnResult",
    "TurnStatus",
    "TurnSummary",
    "UnknownAgent",
    "UnknownId",
    "UnknownSession",
    "UnknownTurn",
    "Worker",
    "adapter_from_spec",
    "ask_user",
    "delegate",
    "load_app",
    "load_settings",
    "task_tool",
    "tool",
    "wait",
]
