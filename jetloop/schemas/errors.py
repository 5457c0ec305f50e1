"""The exceptions a program using jetloop catches, in one tree (re-exported by ``jetloop``).

They live in the lowest package so that every layer's errors can derive from them: the
seal check in ``streams``, the control operations in ``consumers``, the client in
``services``. Catch ``JetloopError`` for all of them::

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
    └── SettingsError           a setting has a wrong value (also a ValueError)

``ControlError`` is defined in ``jetloop.sessions.decisions`` and ``SettingsError`` in
``jetloop.services.settings``; both derive from ``JetloopError``. Errors of NATS itself
(``nats.errors.*``) pass through: an outage longer than the client rides out is one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jetloop.schemas.records import TurnRecord


class JetloopError(Exception):
    """The base of every error jetloop raises on purpose."""


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
