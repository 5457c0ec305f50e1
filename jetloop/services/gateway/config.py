"""What the HTTP gateway is configured with: tokens, their scopes and namespaces, webhook
triggers, limits.

Plain pydantic models, so the gateway can be built from ``Settings`` (``JETLOOP_GATEWAY_*``
variables, JSON for the structured ones) or directly in tests. Secrets never show in a
``repr`` or a log line.

    JETLOOP_GATEWAY_TOKENS='{"<32+ random characters>": {"name": "alice", "scopes": ["read"]},
                            "<another>": {"name": "bob", "scopes": ["read", "write"],
                                          "namespaces": ["a", "b"]},
                            "<a third>": ["read"]}'
    JETLOOP_GATEWAY_HOOKS='{"github": {"agent": "demo", "session": "gh-{payload.repository.name}",
                           "secret": "…", "scheme": "github", "namespace": "a"}}'

A token acts only in its namespaces (``default`` when it names none; a request without a
token, too): each is a NATS account of its own (``jetloop.services.namespaces``), and the
gateway reaches it through a connection of that account alone.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    model_validator,
)

from jetloop.services import namespaces
from jetloop.streams.seal import Sealer

Scope = Literal["read", "write", "approve"]
SCOPES: tuple[Scope, ...] = ("read", "write", "approve")


def _namespace(name: str) -> str:
    try:
        return namespaces.check_name(name)
    except namespaces.NamespaceError as exc:
        raise ValueError(str(exc)) from None


Namespace = Annotated[str, AfterValidator(_namespace)]


def _some(names: frozenset[str]) -> frozenset[str]:
    if not names:
        raise ValueError("a token acts in one namespace at least")
    return names


class TokenGrant(BaseModel):
    """What one bearer token may do, the name recorded as ``by`` for its decisions, and the
    namespaces it may act in."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field("api", min_length=1, max_length=100)
    scopes: frozenset[Scope] = frozenset()
    namespaces: Annotated[frozenset[Namespace], AfterValidator(_some)] = frozenset(
        {namespaces.DEFAULT}
    )

    @property
    def home(self) -> str:
        """The namespace a request names none acts in: ``default`` when the token holds it,
        else the first of its namespaces by name."""
        return namespaces.DEFAULT if namespaces.DEFAULT in self.namespaces else min(self.namespaces)

    def ordered(self) -> list[str]:
        """The token's namespaces, its home first, then the others by name."""
        return [self.home, *sorted(self.namespaces - {self.home})]


def fingerprint(secret: str) -> str:
    """What names a secret in a message: the start of its SHA-256, never its text."""
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()[:8]


# A token is a password anyone who reaches the gateway may guess: short ones are refused at
# start. 16 characters is the floor; 32 random ones (about 190 bits) are what to use.
MIN_TOKEN_LENGTH = 16
MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def _short_grants(v: Any) -> Any:
    """``{"token": ["read"]}`` is short for ``{"token": {"scopes": ["read"]}}``."""
    if isinstance(v, dict):
        return {k: {"scopes": g} if isinstance(g, list | tuple | set) else g for k, g in v.items()}
    return v


def _long_enough(tokens: dict[str, TokenGrant]) -> dict[str, TokenGrant]:
    # Raised on the whole table, not on its key: an error on the key would repeat the token.
    for token in tokens:
        if len(token) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"the token {fingerprint(token)} has {len(token)} characters; a token needs at "
                f"least {MIN_TOKEN_LENGTH} (make one with: {MAKE_TOKEN})"
            )
    return tokens


# Bearer tokens and their grants, as ``JETLOOP_GATEWAY_TOKENS`` and the gateway's config both
# read them: the shorthand expanded, short tokens refused.
Tokens = Annotated[
    dict[str, TokenGrant], BeforeValidator(_short_grants), AfterValidator(_long_enough)
]


class HookTrigger(BaseModel):
    """An inbound webhook that starts a turn.

    ``session`` and ``text`` are templates: ``{trigger}``, ``{id}`` (the webhook id),
    ``{event}`` (GitHub's event name, else ``webhook``) and ``{payload.a.b}`` (a field of
    the JSON body). Without ``text`` the message is a JSON document with all of them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    session: str = Field(min_length=1, max_length=200)
    secret: SecretStr
    scheme: Literal["standard", "github"] = "standard"
    text: str | None = None
    # The namespace its turns run in.
    namespace: Namespace = namespaces.DEFAULT

    @model_validator(mode="after")
    def _secret_fits_scheme(self) -> HookTrigger:
        """A Standard Webhooks secret is ``whsec_<base64>``: wrong ones fail at start."""
        if self.scheme == "standard":
            raw = self.secret.get_secret_value().removeprefix("whsec_")
            try:
                key = base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("a standard webhook secret is whsec_<base64>") from None
            if not key:
                raise ValueError("the webhook secret is empty")
        elif not self.secret.get_secret_value():
            raise ValueError("the webhook secret is empty")
        return self


class GatewayConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    # Keyed by the token itself; hidden from repr so a logged config leaks nothing.
    tokens: Tokens = Field(default_factory=dict, repr=False)
    # Scopes of a request without a token (e.g. all three for `jetloop up` on loopback).
    anonymous_scopes: frozenset[Scope] = frozenset()
    hooks: dict[str, HookTrigger] = Field(default_factory=dict, repr=False)
    max_body_bytes: int = Field(1024 * 1024, ge=1024)
    readmodel_db: Path | None = None
    wait_max_seconds: float = Field(60.0, gt=0)
    sse_keepalive_seconds: float = Field(15.0, gt=0)
    nats_retry_seconds: float = Field(5.0, gt=0)
    hook_tolerance_seconds: float = Field(300.0, gt=0)
    # Anonymous scopes on an address other than loopback: refused unless this says so.
    allow_anonymous_remote: bool = False
    # Slow and many clients (jetloop.services.gateway.guard).
    header_timeout_seconds: float = Field(10.0, gt=0)
    body_timeout_seconds: float = Field(30.0, gt=0)
    max_connections: int = Field(1000, ge=1)
    # Token guessing (jetloop.services.gateway.http.AuthFailures): an address that sent this
    # many unknown tokens is answered 429 until the window that began with its first ends.
    max_auth_failures: int = Field(20, ge=1)
    auth_failure_window_seconds: float = Field(60.0, gt=0)
    # Seals the turn and call records the gateway writes (cancel, reconcile) like a
    # worker's: an unsealed one would fail its turn as not trusted.
    sealer: Sealer | None = Field(None, repr=False, exclude=True)
    # Without a sealer: serve state read unchecked (JETLOOP_READ_UNVERIFIED), or refuse
    # every read of it (503, naming JETLOOP_SEAL_KEY).
    read_unverified: bool = False

    @classmethod
    def from_settings(cls, settings: object) -> GatewayConfig:
        """Read ``gateway_<field>`` attributes (and ``readmodel_db``, and the sealer) of a
        settings object; fields it does not have keep their defaults."""
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            attr = name if name == "readmodel_db" else f"gateway_{name}"
            if getattr(settings, attr, None) is not None:
                values[name] = getattr(settings, attr)
        if getattr(settings, "read_unverified", None) is not None:
            values["read_unverified"] = settings.read_unverified  # type: ignore[attr-defined]
        sealer = getattr(settings, "sealer", None)
        if callable(sealer):
            values["sealer"] = sealer()
        store = getattr(settings, "store_dir", None)
        if "readmodel_db" not in values and store is not None:
            values["readmodel_db"] = Path(store) / "readmodel.sqlite"
        return cls.model_validate(values)


ALLOW_ANONYMOUS_REMOTE = "JETLOOP_GATEWAY_ALLOW_ANONYMOUS_REMOTE=true / --allow-anonymous-remote"


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host``: ``localhost`` or a loopback address.
    Any other name, and ``""`` / ``0.0.0.0`` / ``::`` (every interface), is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_error(config: GatewayConfig, host: str) -> str | None:
    """Why the gateway must not serve ``host`` with this configuration, or None.

    Requests without a token get ``anonymous_scopes``; on a loopback address only people at
    this machine can send them. Anywhere else, anyone who reaches the port would have those
    scopes: that takes ``allow_anonymous_remote``, said in so many words."""
    if not config.anonymous_scopes or is_loopback(host) or config.allow_anonymous_remote:
        return None
    return (
        f"the gateway would give anyone who reaches {host or 'every address'} the scopes "
        f"{sorted(config.anonymous_scopes)} without a token: set JETLOOP_GATEWAY_TOKENS, or "
        f"JETLOOP_GATEWAY_HOST=127.0.0.1, or {ALLOW_ANONYMOUS_REMOTE} if that is what you mean"
    )
