"""What ``import jetloop`` offers, imported: the face module (``jetloop``) loads this on the
first name asked of it, so that the CLI, which imports ``jetloop.services.cli`` and so the
package, does not pay for every part of the engine before it reads its arguments
(``jetloop --version``). Users import ``jetloop``, never this module."""

# ruff: noqa: F401  (imported to be offered: ``jetloop.__all__`` lists them)
# mypy: implicit-reexport

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
from jetloop.sessions.decisions import ControlError
from jetloop.sessions.snapshot import CallView, SessionSnapshot
from jetloop.sessions.turns import TurnDetail, TurnPage, TurnSummary
from jetloop.streams.connection import NotAuthorized
