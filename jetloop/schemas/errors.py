"""Every error a program using jetloop meets, in one tree (re-exported by ``jetloop``).

They live in the lowest package so that every layer can raise them: the seal check and the
connection in ``streams``, the model adapters and tools in ``agents``, the decisions in
``sessions``, the settings and the client in ``services``. Catch ``JetloopError`` for all
of them::

    JetloopError
    ├── SealError               state could not be checked
    │   ├── SealKeyMissing      no JETLOOP_SEAL_KEY, and reading unverified was not chosen
    │   └── RecordNotTrusted    a record's seal does not verify (.key, .reason)
    ├── UnknownId (LookupError) no such thing
    │   ├── UnknownAgent        no worker has ever served this agent (also a ValueError)
    │   ├── UnknownSession      no such session (.session_id)
    │   └── UnknownTurn         no such turn in the session (.session_id, .turn_id)
    ├── ControlError            a decision refused (.status as in HTTP, .title, .detail)
    ├── TurnFailed              the turn ended failed or cancelled (.turn)
    ├── NotAuthorized           the NATS server refused the credentials (a nats error too)
    ├── WrongNamespace          a credential of one namespace used to act in another (also
    │                           a ValueError)
    ├── SettingsError           a setting has a wrong value (also a ValueError)
    ├── NamespaceError          a namespace name that cannot be, or no such namespace (also
    │                           a ValueError)
    ├── AppLoadError            an app (module:attr) that does not load: where it failed
    │                           (also a ValueError)
    ├── UpError                 `jetloop up` cannot run: one line naming the setting or part
    ├── DecodeError             a message body that cannot be read: not msgpack, an unknown
    │                           schema version, or invalid (also a ValueError)
    ├── InvalidName             a session id or name no subject or key can hold (also a
    │                           ValueError)
    ├── ModelError              a model call failed: the step is tried again within its attempts
    │   └── ProviderError       a provider's HTTP API failed (.provider, .status, .message,
    │       │                   .error_type, .request_id)
    │       ├── ProviderRetryable  try again later (.retry_after): 429, 408, 409, 5xx,
    │       │                      timeouts, lost connections, a cut or failed stream
    │       └── ProviderRejected   refused as it stands (other 4xx): another attempt with
    │                              the same input cannot help
    ├── ToolError               a tool failed: the model sees a failed call, not retried
    └── RetryableToolError      a tool failed for now: the call is tried again

The last two branches are raised by model adapters and tools (jetloop's own and a user's)
to tell the engine how a step went; the engine turns them into the turn's events, so a
program driving sessions sees them as a failed call or a failed turn (``TurnFailed``).
A provider error carries what the provider said, never the API key: adapters scrub it from
the provider's message before the error is built, so ``str``, ``repr`` and logs are safe.

Not here, because no program using jetloop sees them: the outcomes a step handler raises
for the dispatcher to decide a message's fate (``jetloop.consumers.errors``: ``RetryLater``,
``TakenOver``, ``DeadLetter``), and the errors one module raises and its caller handles
(a CAS ``Conflict``, for one). Three layers raise a public error under a name of their
own, a subclass of it: ``jetloop.streams.seal.SealBroken`` (a ``RecordNotTrusted``),
``jetloop.streams.clock.ClockOff`` (a ``SealError``) and ``jetloop.schemas.codec.NewerWriter``
(a ``DecodeError``: a body a newer jetloop wrote). Errors of NATS itself
(``nats.errors.*``) pass through: an outage longer than the client rides out is one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nats.errors import Error as NatsError

if TYPE_CHECKING:
    from jetloop.schemas.records import TurnRecord


class JetloopError(Exception):
    """The base of every error jetloop raises on purpose, and of those a model adapter or a
    tool raises to tell the engine how a step went."""


class SealError(JetloopError):
    """State read from ``jl_state`` could not be checked, so it is not handed out."""


class SealKeyMissing(SealError):
    """The client has no seal key to verify records with, and was not told to read them
    unverified: set ``JETLOOP_SEAL_KEY`` to the workers' key, or pass ``verify=False``."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"cannot verify {what}: JETLOOP_SEAL_KEY is not set (set it to the workers' seal "
            "key, or pass verify=False to read state without checking it)"
        )
        self.what = what


class RecordNotTrusted(SealError):
    """A record's seal is missing or does not verify under any trusted key: it was written
    without the key (or under another one: is ``JETLOOP_SEAL_KEY`` the workers' key?),
    edited, copied to another key, or put back from an older state."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"the record {key} is not trusted: {reason}")
        self.key = key
        self.reason = reason


class UnknownId(JetloopError, LookupError):
    """Nothing has this name or id."""


class UnknownAgent(UnknownId, ValueError):
    """No worker has ever served this agent: a request for it would wait for nobody."""

    def __init__(self, agent: str) -> None:
        super().__init__(
            f"no worker serves agent {agent!r} and none ever has: start one that does "
            "(jetloop worker --app module:attr), or check the name"
        )
        self.agent = agent


class UnknownSession(UnknownId):
    """The session has no state: no message was ever accepted for it."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"no such session: {session_id}")
        self.session_id = session_id


class UnknownTurn(UnknownId):
    """The session has no turn with this id."""

    def __init__(self, session_id: str, turn_id: str) -> None:
        super().__init__(f"no such turn: {session_id}/{turn_id}")
        self.session_id = session_id
        self.turn_id = turn_id


class TurnFailed(JetloopError):
    """The turn ended failed or cancelled; ``turn`` (the turn record) has the status and the
    reason (``turn.status``, ``turn.error``)."""

    def __init__(self, turn: TurnRecord) -> None:
        super().__init__(f"turn {turn.turn_id} {turn.status.value}: {turn.error}")
        self.turn = turn


class ControlError(JetloopError):
    """A request that cannot be done; ``status`` follows HTTP (404, 409, 422, 503), ``title``
    says what in a few words, ``detail`` which thing."""

    def __init__(self, status: int, title: str, detail: str = "") -> None:
        super().__init__(f"{title}: {detail}" if detail else title)
        self.status = status
        self.title = title
        self.detail = detail


class NotAuthorized(JetloopError, NatsError):
    """The server refused the connection's user and password (or that it had none): a
    setting to fix, not an outage to wait out (also a ``nats.errors.Error``)."""

    def __str__(self) -> str:
        return (
            "wrong or missing credentials (set JETLOOP_NATS_USER and JETLOOP_NATS_PASSWORD, "
            "or run in the directory of `jetloop up`, which keeps them in its store: "
            "set JETLOOP_STORE_DIR too if `up` was given --store-dir)"
        )


class WrongNamespace(JetloopError, ValueError):
    """A credential of one namespace used to act in another: the server would show it only
    its own namespace, so the request is refused before it is made."""

    def __init__(self, user: str, has: str, wanted: str) -> None:
        super().__init__(user, has, wanted)
        self.user, self.has, self.wanted = user, has, wanted

    def __str__(self) -> str:
        return (
            f"the NATS user {self.user!r} belongs to namespace {self.has!r}, not "
            f"{self.wanted!r}: use a credential of {self.wanted!r} "
            f"(<store>/namespaces/{self.wanted}.json)"
        )


class SettingsError(JetloopError, ValueError):
    """A setting has a wrong value; the message names it."""


class NamespaceError(JetloopError, ValueError):
    """A namespace or identity name that cannot be, or one that does not exist: one line."""


class AppLoadError(JetloopError, ValueError):
    """An app spec (``module:attr``, ``--app``) that does not load: no such module or
    attribute, not an app, or an error raised while its module was imported (the message
    gives the file and line where it was raised)."""


class UpError(JetloopError):
    """``jetloop up`` cannot run: one line naming the setting or the component."""


class DecodeError(JetloopError, ValueError):
    """A body that is not msgpack, is of a schema version this code does not know, or does
    not validate against its model. No retry cures it: a message that raises it is
    dead-lettered with the reason."""


class InvalidName(JetloopError, ValueError):
    """A session id, agent name or other name that becomes a subject token and a key part is
    not one (1-64 characters from ``A-Z a-z 0-9 _ -``); the message names what it is."""


class ModelError(JetloopError):
    """The model call failed; the step is tried again within its attempts."""


class ProviderError(ModelError):
    """A model provider's HTTP API failed or refused a request."""

    def __init__(
        self,
        provider: str,
        message: str,
        *,
        status: int | None = None,
        error_type: str | None = None,
        request_id: str | None = None,
    ) -> None:
        where = f"{provider} HTTP {status}" if status is not None else provider
        super().__init__(f"{where}: {message}")
        self.provider = provider
        self.message = message
        self.status = status
        # The provider's own classification ("rate_limit_error", "context_length_exceeded", …):
        # lets the engine tell a too-long prompt (compact, then retry) from a bad request.
        self.error_type = error_type
        self.request_id = request_id

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(provider={self.provider!r}, status={self.status!r}, "
            f"error_type={self.error_type!r}, message={self.message!r})"
        )


class ProviderRetryable(ProviderError):
    """The call may succeed later: retry after ``retry_after`` seconds if the provider said."""

    def __init__(
        self,
        provider: str,
        message: str,
        *,
        retry_after: float | None = None,
        status: int | None = None,
        error_type: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(
            provider, message, status=status, error_type=error_type, request_id=request_id
        )
        self.retry_after = retry_after


class ProviderRejected(ProviderError):
    """The provider refused this request (bad input, auth, quota): fail the step at once."""


class ToolError(JetloopError):
    """A tool's failure the model should see as a failed call (not retried)."""


class RetryableToolError(JetloopError):
    """A transient failure: the call is tried again, within its attempts. ``not_sent``: the
    call never reached the tool's vendor (it could not be sent), so nothing of it ran."""

    def __init__(self, *args: object, not_sent: bool = False) -> None:
        super().__init__(*args)
        self.not_sent = not_sent
