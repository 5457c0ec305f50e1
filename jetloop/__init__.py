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
    ├── WrongNamespace          a credential of one namespace used to act in another (also
    │                           a ValueError)
    ├── SettingsError           a setting has a wrong value
    ├── NamespaceError          a namespace name that cannot be, or no such namespace
    ├── AppLoadError            an app (module:attr) that does not load, and where it failed
    ├── UpError                 `jetloop up` cannot run (one line naming the setting)
    ├── DecodeError             a message body that cannot be read
    ├── InvalidName             a session id or name no subject or key can hold
    ├── ModelError              a model call failed: the step is tried again
    │   └── ProviderError       a provider's HTTP API failed (.provider, .status, .message)
    │       ├── ProviderRetryable   try again later (.retry_after)
    │       └── ProviderRejected    refused as it stands: another attempt cannot help
    ├── ToolError               a tool failed: the model sees a failed call
    └── RetryableToolError      a tool failed for now: the call is tried again

All are defined in ``jetloop.schemas.errors``, whose docstring says more of each.
"""

# ruff: noqa: F405  (the names of __all__ come from jetloop._face)
import typing as _typing

if _typing.TYPE_CHECKING:
    from jetloop._face import *  # noqa: F403  (for the type checker: imported when first asked)

__all__ = [
    "TOOL_CALL_NOT_RUN_ERROR_PREFIX",
    "Agent",
    "App",
    "AppLoadError",
    "Budget",
    "CallView",
    "Client",
    "ControlError",
    "DecodeError",
    "Effect",
    "EmbeddedServer",
    "Event",
    "EventType",
    "Found",
    "InvalidName",
    "JetloopError",
    "Limits",
    "MCPServer",
    "MalformedToolCall",
    "Message",
    "ModelAdapter",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "NamespaceError",
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
    "UpError",
    "Worker",
    "WrongNamespace",
    "adapter_from_spec",
    "ask_user",
    "delegate",
    "load_app",
    "load_settings",
    "served_elsewhere",
    "task_tool",
    "tool",
    "wait",
]


if not _typing.TYPE_CHECKING:  # the type checker reads the names from jetloop._face

    def __getattr__(name: str) -> object:
        """A name of ``__all__``, from ``jetloop._face`` (imported on the first one asked)."""
        if name not in __all__:
            raise AttributeError(f"module 'jetloop' has no attribute {name!r}")
        from jetloop import _face

        value = getattr(_face, name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
