"""Inbound webhooks: verify a delivery's signature, then name the turn it starts.

Two schemes, both checked on the raw body bytes with ``hmac.compare_digest``:

- Standard Webhooks (https://www.standardwebhooks.com): headers ``webhook-id``,
  ``webhook-timestamp`` (Unix seconds) and ``webhook-signature`` (space-separated
  ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``); the secret is ``whsec_<base64>``.
  A timestamp more than the tolerance (5 minutes) in the past or the future is refused,
  so a captured delivery cannot be replayed later.
- GitHub: ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of body>`` with the secret as
  bytes; the event is ``X-GitHub-Event``. GitHub signs neither a timestamp nor its delivery
  id (``X-GitHub-Delivery``): whoever captured one delivery could send it again with any
  id, at any time. So the id of a GitHub delivery is taken from what is signed, the body:
  ``sha256-<first 32 hex digits of its SHA-256>``. ``X-GitHub-Delivery`` is still required
  (GitHub always sends it) and is logged, but decides nothing.

The delivery id becomes the turn's request id (``<trigger>:<id>``), and the ``{id}`` of the
templates: a replay names the same turn id, which the session's state already holds, so no
second turn runs, and the answer says ``duplicate: true`` (told from the turn record;
before the first is accepted, from the turn stream's ``Nats-Msg-Id`` dedupe). For GitHub the
"window" is therefore as long as the session keeps that turn: the same body never starts two
turns. GitHub's bodies carry ids and timestamps of their own, so two real events do not share
one; a redelivery from GitHub's settings page sends the same body and is the same turn.
Nothing is remembered here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jetloop.services.gateway.config import HookTrigger

PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_.-]+)\}")
NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_-]+")
MAX_ID = 200


class HookRefused(Exception):
    """A delivery that is not accepted; ``status`` and ``title`` go into the problem."""

    def __init__(self, status: int, title: str, detail: str = "") -> None:
        super().__init__(f"{title}: {detail}" if detail else title)
        self.status = status
        self.title = title
        self.detail = detail


@dataclass(frozen=True)
class Delivery:
    """A verified delivery: its id (deduplication; signed), its event name, and the id the
    sender gave when that is not what dedupes (GitHub's ``X-GitHub-Delivery``, unsigned)."""

    id: str
    event: str
    sender_id: str = ""


def verify(
    trigger: HookTrigger,
    headers: Mapping[str, str],
    body: bytes,
    now: float,
    tolerance: float = 300.0,
) -> Delivery:
    """The verified delivery, or ``HookRefused`` (401 for anything about the signature)."""
    secret = trigger.secret.get_secret_value()
    if trigger.scheme == "github":
        return _verify_github(secret, headers, body)
    return _verify_standard(secret, headers, body, now, tolerance)


def _verify_standard(
    secret: str, headers: Mapping[str, str], body: bytes, now: float, tolerance: float
) -> Delivery:
    wid = headers.get("webhook-id", "")
    ts = headers.get("webhook-timestamp", "")
    sigs = headers.get("webhook-signature", "")
    if not (wid and ts and sigs):
        raise HookRefused(
            401,
            "missing webhook signature headers",
            "webhook-id, webhook-timestamp and webhook-signature are required",
        )
    if len(wid) > MAX_ID:
        raise HookRefused(400, "webhook id too long", f"at most {MAX_ID} characters")
    try:
        stamp = int(ts)
    except ValueError:
        raise HookRefused(401, "invalid webhook timestamp", "not an integer") from None
    try:
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except (binascii.Error, ValueError):
        # A configuration mistake, not the sender's: still refuse, never accept unsigned.
        raise HookRefused(500, "webhook secret is not base64", "fix the trigger's secret") from None
    expected = hmac.new(key, f"{wid}.{ts}.".encode() + body, hashlib.sha256).digest()
    matched = False
    for part in sigs.split():
        version, _, sig = part.partition(",")
        if version != "v1":
            continue
        try:
            given = base64.b64decode(sig, validate=True)
        except (binascii.Error, ValueError):
            continue
        # Every candidate is compared (no early exit) in constant time.
        matched |= hmac.compare_digest(expected, given)
    if not matched:
        raise HookRefused(401, "invalid webhook signature", "no v1 signature matches the body")
    # Checked after the signature, so only the signer learns about its clock.
    if abs(now - stamp) > tolerance:
        raise HookRefused(
            401,
            "webhook timestamp outside tolerance",
            f"{int(now - stamp)} s from now; at most {int(tolerance)} s either way",
        )
    return Delivery(wid, "webhook")


def _verify_github(secret: str, headers: Mapping[str, str], body: bytes) -> Delivery:
    sig = headers.get("x-hub-signature-256", "")
    delivery = headers.get("x-github-delivery", "")
    if not sig.startswith("sha256="):
        raise HookRefused(401, "missing webhook signature", "X-Hub-Signature-256 is required")
    expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected.encode(), sig.encode()):
        raise HookRefused(401, "invalid webhook signature", "X-Hub-Signature-256 does not match")
    if not delivery:
        raise HookRefused(400, "missing delivery id", "X-GitHub-Delivery is required")
    if len(delivery) > MAX_ID:
        raise HookRefused(400, "delivery id too long", f"at most {MAX_ID} characters")
    # The id is the signed body's digest: a new X-GitHub-Delivery makes no new delivery.
    signed_id = "sha256-" + hashlib.sha256(body).hexdigest()[:32]
    event = headers.get("x-github-event", "webhook") or "webhook"
    return Delivery(signed_id, event, sender_id=delivery)


def payload_of(body: bytes) -> Any:
    """The JSON body, or its text when it is not JSON."""
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")


def _lookup(payload: Any, path: str) -> str:
    value = payload
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return ""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return "" if value is None else str(value)


def render(template: str, name: str, delivery: Delivery, payload: Any) -> str:
    """Fill ``{trigger}``, ``{id}``, ``{event}`` and ``{payload.<path>}`` (unknown: empty)."""

    def one(m: re.Match[str]) -> str:
        key = m.group(1)
        if key == "trigger":
            return name
        if key == "id":
            return delivery.id
        if key == "event":
            return delivery.event
        if key.startswith("payload."):
            return _lookup(payload, key.removeprefix("payload."))
        return ""

    return PLACEHOLDER.sub(one, template)


def session_for(trigger: HookTrigger, name: str, delivery: Delivery, payload: Any) -> str:
    """The session id: the rendered template made a valid name (or ``HookRefused`` 422)."""
    raw = render(trigger.session, name, delivery, payload)
    sid = NOT_IN_NAME.sub("-", raw).strip("-")[:64]
    if not sid:
        raise HookRefused(
            422, "no session for this delivery", f"the template {trigger.session!r} gave {raw!r}"
        )
    return sid


def text_for(trigger: HookTrigger, name: str, delivery: Delivery, payload: Any) -> str:
    if trigger.text is not None:
        return render(trigger.text, name, delivery, payload)
    return json.dumps(
        {"trigger": name, "event": delivery.event, "webhook_id": delivery.id, "payload": payload},
        sort_keys=True,
    )


def request_id_for(name: str, delivery: Delivery) -> str:
    return f"{name}:{delivery.id}"
