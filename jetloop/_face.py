"""What ``import jetloop`` offers, imported: the face module (``jetloop``) loads this on the
first name asked of it, so that the CLI, which imports ``jetloop.services.cli`` and so the
package, does not pay for every part of the engine before it reads its arguments
(``jetloop --version``). Users import ``jetloop``, never this module."""

# ruff: noqa: F401  (imported to be offered: ``jetloop.__all__`` lists them)
# mypy: implicit-reexport

from jetloop.agents import (
    Agent,
    App,
    Budget,
    Effect,
    Limits,
    MalformedToolCall,
    Message,
    ModelAdapter,
    ModelRequest,
    ModelResponse,
    ScriptedModel,
    TaskDone,
    TaskFailed,
    TaskPending,
    Tool,
    ToolCallRequest,
    ToolContext,
    ToolSpec,
    Trigger,
    adapter_from_spec,
    ask_user,
    delegate,
    load_app,
    served_elsewhere,
    task_tool,
    tool,
    wait,
)
from jetloop.agents.mcp import MCPServer
from jetloop.agents.tools import Found, NotFound
from jetloop.consumers import TOOL_CALL_NOT_RUN_ERROR_PREFIX
from jetloop.schemas import Event, EventType, TurnRecord, TurnStatus
from jetloop.schemas.errors import (
    AppLoadError,
    ControlError,
    DecodeError,
    InvalidName,
    JetloopError,
    ModelError,
    NamespaceError,
    NotAuthorized,
    ProviderError,
    ProviderRejected,
    ProviderRetryable,
    RecordNotTrusted,
    RetryableToolError,
    SealError,
    SealKeyMissing,
    SettingsError,
    ToolError,
    TurnFailed,
    UnknownAgent,
    UnknownId,
    UnknownSession,
    UnknownTurn,
    UpError,
    WrongNamespace,
)
from jetloop.services.client import Client, TurnHandle, TurnResult
from jetloop.services.embedded import EmbeddedServer
from jetloop.services.settings import Settings, load_settings
from jetloop.services.worker import Worker
from jetloop.sessions.snapshot import CallView, SessionSnapshot
from jetloop.sessions.turns import TurnDetail, TurnPage, TurnSummary
