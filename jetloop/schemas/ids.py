"""Identity: every key is derived from what identifies a thing, never from a clock.

docs/design.md, rule 5. A session id and an agent name become subject tokens and KV key
parts, so they are restricted to characters valid in both.
"""

from __future__ import annotations

import hashlib
import re

from jetloop.schemas.errors import InvalidName

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# The namespace of a deployment that names none (docs/design.md, Namespaces).
DEFAULT_NAMESPACE = "default"


def validate_name(kind: str, value: str) -> str:
    # fullmatch: with match, `$` also matches before a trailing newline ("abc\n" passed, and
    # made a subject NATS refuses).
    if not NAME_RE.fullmatch(value):
        raise InvalidName(
            f"{kind} {value!r} is not valid: use 1-64 characters from A-Z a-z 0-9 _ -"
        )
    return value


def _digest(*parts: str, size: int = 10) -> str:
    h = hashlib.blake2b(digest_size=size)
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def turn_id_for(session_id: str, request_id: str) -> str:
    """The turn a request starts: the same request id always names the same turn."""
    return "t" + _digest(session_id, request_id)


def scoped_msg_id(session_id: str, request_id: str) -> str:
    """The ``Nats-Msg-Id`` of a turn request: ``JL_TURNS`` dedupes ids across all its
    subjects, so the request id is scoped by its session (a session id has no dot)."""
    return f"{session_id}.{request_id}"


def call_key(session_id: str, turn_id: str, model_step: int, index: int) -> str:
    """The KV key part and step key of one call: session, turn, model step, position."""
    return f"{session_id}.{turn_id}.{model_step}.{index}"


def call_key_parts(key: str) -> tuple[str, str, int, int]:
    """Session, turn, model step and position of a call key (``call_key``'s inverse)."""
    sid, tid, n, i = key.split(".")
    return sid, tid, int(n), int(i)


def call_id(turn_id: str, model_step: int, index: int) -> str:
    """The call's id the model is given: ``<turn>-<model step>-<index>`` (docs/protocol.md)."""
    return f"{turn_id}-{model_step}-{index}"


def idempotency_key(
    session_id: str,
    turn_id: str,
    model_step: int,
    index: int,
    namespace: str = DEFAULT_NAMESPACE,
) -> str:
    """The key handed to a tool: identical on every attempt of the checkpointed call.

    A turn id is derived from the session id and the request id alone, and two namespaces
    may use the same ones; so the key of a call in any namespace but ``default`` is derived
    from the namespace too, or a vendor that dedupes by key would take one tenant's write
    for another's. The default namespace's keys are those jetloop always made."""
    key = call_key(session_id, turn_id, model_step, index)
    if namespace == DEFAULT_NAMESPACE:
        return "jl-" + _digest(key, size=16)
    return "jl-" + _digest("namespace", namespace, key, size=16)


def approval_id_for(call_key_: str) -> str:
    """One approval per call, however often the call is routed (coalescing)."""
    return "a" + _digest("approval", call_key_)


def question_id_for(call_key_: str) -> str:
    return "q" + _digest("question", call_key_)


TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parse_traceparent(value: str | None) -> tuple[int, int] | None:
    """(trace id, parent span id) of a W3C ``traceparent``; None when absent or malformed
    (an all-zero id is invalid too)."""
    m = TRACEPARENT.match((value or "").strip().lower())
    if m is None:
        return None
    trace_id, span_id = int(m.group(1), 16), int(m.group(2), 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id
