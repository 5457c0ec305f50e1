"""Settings from the environment (``JETLOOP_*``) and an optional ``jetloop.env`` file.

A wrong setting fails at start with its name (``SettingsError``), never later.

The seal key is found the same way by every process that writes state (worker, CLI,
gateway): ``JETLOOP_SEAL_KEY`` if set, else ``<store dir>/seal.key`` if it exists — the
key ``jetloop up`` makes (``make_seal_key``) — else none, and records are not sealed.
The NATS credentials are found the same way: ``JETLOOP_NATS_USER`` and
``JETLOOP_NATS_PASSWORD`` if set, else the ``worker`` user of ``<store dir>/nats-users.json``
(made by ``jetloop up``, see ``jetloop.services.natsauth``) if it exists, else none.
"""

from __future__ import annotations

import json
import re
import secrets
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from pydantic_settings import SettingsError as PydanticSettingsError

from jetloop.agents.prices import Price
from jetloop.schemas.errors import SettingsError
from jetloop.schemas.log import LogLayout
from jetloop.services import durability, listening, namespaces
from jetloop.services.gateway.config import HookTrigger, Scope, Tokens, fingerprint
from jetloop.services.namespaces import DEFAULT as DEFAULT_NAMESPACE
from jetloop.services.storefiles import write_once
from jetloop.streams.seal import DEFAULT_TOLERANCE, Sealer, key_bytes
from jetloop.streams.topology import TopologyConfig
from jetloop.streams.windows import EndpointLimits

SEAL_KEY_FILE = "seal.key"
# Measured (docs/performance.md, issue 15): fewer collections without a longer p99.
DEFAULT_GC_THRESHOLD = 5_000


class Settings(BaseSettings):
    """Every setting, read from ``JETLOOP_<NAME>`` environment variables (and
    ``jetloop.env``); docs/operating.md's settings table lists them."""

    model_config = SettingsConfigDict(
        env_prefix="JETLOOP_", env_file="jetloop.env", extra="ignore", frozen=True
    )

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL(s), comma-separated; unset: the server of the store "
        "directory's running `jetloop up` (<store dir>/up.json), else nats://127.0.0.1:4222",
    )
    store_dir: Path = Field(Path(".jetloop"), description="store directory of `jetloop up`")
    namespace: str = Field(
        DEFAULT_NAMESPACE,
        description="the namespace to act in (docs/design.md, Namespaces): without "
        "JETLOOP_NATS_USER, its workers' credential in the store directory is used",
    )
    nats_user: str | None = Field(
        None,
        description="NATS user to connect as; unset: the worker user of JETLOOP_NAMESPACE in "
        "<store dir> (nats-users.json, namespaces/) if it exists, else none",
    )
    nats_password: SecretStr | None = Field(
        None,
        # Validated when unset too: that is when the store directory's credentials are read.
        validate_default=True,
        description="password of JETLOOP_NATS_USER",
    )
    nats_watch_user: str = Field(
        "watch",  # WATCH_USER
        description="user of the NATS system account that may hear connections close "
        "($SYS.ACCOUNT.*.DISCONNECT): with it a dead worker's steps move on at once",
    )
    nats_watch_password: SecretStr | None = Field(
        None,
        validate_default=True,
        description="password of JETLOOP_NATS_WATCH_USER; unset: the watch user of "
        "<store dir>/nats-users.json if it exists, else none (dead workers are then found by "
        "their leases alone)",
    )
    embedded_port: int = Field(4222, ge=0, le=65535, description="client port of `jetloop up`")
    nats_sync: str = Field(
        durability.ALWAYS,
        description="when the nats-server that `jetloop up` starts (and the config `jetloop "
        "credentials` writes) puts an acknowledged write on disk: always (before "
        "acknowledging: survives an OS crash or a power cut) or an interval such as 2m "
        "(nats-server's own default: a power cut loses what was acknowledged since the "
        "last sync); docs/design.md, What an acknowledgement survives",
    )
    app: str = Field(
        "jetloop.demo.agent:app", description="the agents a worker serves (module:attr)"
    )
    namespace_apps: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="namespaces served by an app of their own instead of JETLOOP_APP "
        "(`jetloop up`, and a worker of that namespace): comma-separated "
        "<namespace>=<module:attr>, such as b=shop.agents:app,c=crm:app (`up "
        "--namespace-app`, repeatable); a namespace not named is served by JETLOOP_APP",
    )
    lease_seconds: float = Field(
        5.0, gt=0.5, le=300, description="ack-wait of step messages: the lease of an attempt"
    )
    replicas: int = Field(1, ge=1, le=5, description="replicas of streams and buckets (3 for R3)")
    blob_threshold: int = Field(
        64 * 1024, ge=1024, le=900 * 1024, description="payloads above this go to jl_blobs"
    )
    model_concurrency: int = Field(
        64,
        ge=1,
        description="model steps one worker runs at once (each mostly waits on its provider; "
        "JETLOOP_PROVIDER_LIMITS caps what an endpoint is sent)",
    )
    tool_concurrency: int = Field(
        16,
        ge=1,
        description=(
            "tool steps one worker runs at once (a model step's calls sent in one message "
            "count one each)"
        ),
    )
    session_concurrency: int = Field(32, ge=1, description="session steps run at once")
    turn_rate: float | None = Field(
        None,
        ge=0,
        description="turn requests a second one worker process takes in from JL_TURNS (for "
        "its namespace, across the agents it serves), with a burst of a tenth of a second's "
        "worth; the rest wait in the stream, in order, undelivered: a namespace's flood of "
        "turns does not take the CPU its neighbours' workers share; unset or 0: unlimited",
    )
    event_log: LogLayout | None = Field(
        None,
        description="the session log's layout, set for the whole deployment when a worker "
        "applies the topology (kept in JL_EVENTS's metadata; unset: as it is, folded for a new "
        "deployment): separate (an event and a history entry for a fact that is both) or folded "
        "(the entry carries the event: 9 fewer messages per 7-step turn, for readers that "
        "read both; docs/protocol.md)",
    )
    drain_seconds: float = Field(10.0, ge=0, description="graceful stop: time to finish steps")
    uvloop: bool = Field(
        True,
        description="run a worker and `jetloop up` on uvloop where it is installed (with "
        "jetloop on Linux); false: the standard asyncio loop",
    )
    gc_threshold: int = Field(
        DEFAULT_GC_THRESHOLD,
        ge=100,
        description="a worker's (and `jetloop up`'s) collector runs after this many young "
        "objects (generation 0; Python's default is 700); start-up objects are frozen",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="a worker serves /metrics here (the gateway always)"
    )
    gateway_host: str = Field("127.0.0.1", description="the gateway's address")
    gateway_port: int = Field(8080, ge=0, le=65535, description="the gateway's port")
    gateway_tokens: Tokens = Field(
        default_factory=dict,
        description='bearer tokens, JSON: {"<token>": {"name": "alice", "scopes": ["read"], '
        '"namespaces": ["a"]}}; a token has at least 16 characters and acts in the namespaces '
        "it lists (default: default)",
    )
    gateway_anonymous_scopes: frozenset[Scope] | None = Field(
        None, description="scopes of requests without a token (jetloop up: all, on loopback)"
    )
    gateway_hooks: dict[str, HookTrigger] = Field(
        default_factory=dict,
        description="inbound webhooks, JSON: "
        '{"<trigger>": {"agent", "session", "secret", "scheme"}}',
    )
    gateway_max_body_bytes: int = Field(1024 * 1024, ge=1024, description="request size limit")
    gateway_allow_anonymous_remote: bool = Field(
        False, description="serve anonymous scopes on an address other than loopback"
    )
    gateway_header_timeout_seconds: float = Field(
        10.0, gt=0, description="time to send a request's headers (and to stay idle between)"
    )
    gateway_body_timeout_seconds: float = Field(
        30.0, gt=0, description="time to send a request's body"
    )
    gateway_max_connections: int = Field(
        1000, ge=1, description="open connections at once (event streams count)"
    )
    gateway_max_auth_failures: int = Field(
        20,
        ge=1,
        description="unknown bearer tokens one client address may send in a window; then 429",
    )
    gateway_auth_failure_window_seconds: float = Field(
        60.0, gt=0, description="the window of JETLOOP_GATEWAY_MAX_AUTH_FAILURES"
    )
    readmodel_db: Path | None = Field(
        None, description="the projector's SQLite read model (default <store dir>/readmodel.sqlite)"
    )
    worker_id: str | None = Field(None, description="name of this worker in claims and logs")
    worker_processes: int = Field(
        1,
        ge=1,
        le=256,
        description="worker processes `jetloop worker` (--processes) and `jetloop up` (--workers) "
        "run; 1: the worker runs in the process itself",
    )
    log_format: Literal["json", "console"] = Field("json", description="log lines format")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info")
    seal_key: SecretStr | None = Field(
        None,
        # Validated when unset too: that is when the store directory's key is read.
        validate_default=True,
        description="HMAC key sealing state records (hex or text); "
        "unset: <store dir>/seal.key if it exists, else not sealed",
    )
    seal_old_keys: str = Field(
        "", description="comma-separated keys that still verify (rotation), never seal"
    )
    read_unverified: bool = Field(
        False,
        description="without a seal key, read jl_state without verifying it (the client, the "
        "CLI, the gateway); otherwise such a read is refused with an error naming "
        "JETLOOP_SEAL_KEY",
    )
    seal_tolerance_seconds: float = Field(
        DEFAULT_TOLERANCE,
        gt=0,
        description="how far a seal's time may be from the time the server stored the record "
        "(write latency plus clock difference); an older state put back is rejected beyond it",
    )
    clock_check_seconds: float = Field(
        15.0,
        gt=0,
        description="how often a worker measures its clock against the NATS server's; off by "
        "more than half the seal tolerance, it seals nothing and serves no steps and no "
        "control requests until the clock is back",
    )
    max_losses: int = Field(
        2, ge=0, description="a turn lost (taken over) by more workers than this fails"
    )
    newer_writer_seconds: float = Field(
        3600.0,
        gt=0,
        description="how long a step written by a newer jetloop (a schema version or step "
        "kind this worker does not know) is handed back for a worker that reads it, before it "
        "is dead-lettered: the window of a rolling upgrade",
    )
    model: str | None = Field(
        None,
        description="the demo agent's model: openai:<m>, openai-responses:<m>, anthropic:<m>, "
        "openai-compatible:<m>@<base url>; unset: the offline scripted model",
    )
    prices: dict[str, Price] = Field(
        default_factory=dict,
        description="model prices in US dollars per million tokens, over the built-in table: "
        'JSON, {"<model>": {"input": 2.5, "output": 10, "cached_input": 1.25}}',
    )
    provider_limits: dict[str, EndpointLimits] = Field(
        default_factory=dict,
        description="calls in flight, requests and tokens per minute each model endpoint may be "
        'sent by every worker together: JSON, {"openai:gpt-4o-mini": {"concurrent": 8, '
        '"requests_per_minute": 500, '
        '"tokens_per_minute": 200000, "reserve_tokens": 4096}} (a key is provider:model or a '
        "model name)",
    )
    model_api_key: SecretStr | None = Field(None, description="the model provider's API key")
    model_base_url: str | None = Field(None, description="the provider's base URL")
    vendor_db: Path = Field(
        Path(".jetloop/vendor.sqlite"), description="the demo ticketing vendor's database"
    )

    @model_validator(mode="before")
    @classmethod
    def _running_up(cls, data: Any) -> Any:
        """No NATS URL given: the server of the store directory's running ``up``, wherever
        it listens (``jetloop.services.listening``), else the default."""
        if not isinstance(data, dict) or data.get("nats_url"):
            return data
        store = data.get("store_dir") or cls.model_fields["store_dir"].default
        try:
            found = listening.running(Path(store))
        except (TypeError, ValueError):
            return data  # a store directory that is no path: its own validator says so
        return {**data, "nats_url": found.nats_url} if found is not None else data

    @field_validator("nats_url")
    @classmethod
    def _urls(cls, v: str) -> str:
        for u in v.split(","):
            if not u.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"{u.strip()!r} is not a nats:// URL")
        return v

    @field_validator("nats_sync")
    @classmethod
    def _sync(cls, v: str) -> str:
        return durability.check(v)

    @field_validator("seal_key", mode="after")
    @classmethod
    def _stored_key(cls, v: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if v is not None and v.get_secret_value().strip():
            return v
        store = info.data.get("store_dir")  # absent when the store directory is invalid
        return read_seal_key(store) if store is not None else None

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        return namespaces.check_name(v)

    @field_validator("namespace_apps", mode="before")
    @classmethod
    def _namespace_apps(cls, v: Any) -> Any:
        return parse_namespace_apps(v) if isinstance(v, str) else v

    @field_validator("namespace_apps", mode="after")
    @classmethod
    def _namespace_apps_named(cls, v: dict[str, str]) -> dict[str, str]:
        for namespace, spec in v.items():
            namespaces.check_name(namespace)
            module, _, attr = spec.partition(":")
            if not module.strip() or not attr.strip():
                raise ValueError(f"{namespace}={spec!r}: expected <namespace>=<module:attr>")
        return v

    def app_of(self, namespace: str) -> str:
        """The app (module:attr) that serves ``namespace``: its own, else JETLOOP_APP."""
        return self.namespace_apps.get(namespace, self.app)

    @field_validator("nats_password", mode="after")
    @classmethod
    def _stored_password(cls, v: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if v is not None:
            return v
        if info.data.get("nats_user"):
            raise ValueError("required when JETLOOP_NATS_USER is set")
        store = info.data.get("store_dir")
        namespace = info.data.get("namespace", DEFAULT_NAMESPACE)
        if store is None:
            return None
        if namespace == DEFAULT_NAMESPACE:
            return read_local_password(store)
        cred = namespaces.read_credential(store, namespace, namespaces.WORKER)
        if cred is None and (store / NATS_USERS_FILE).exists():
            raise ValueError(
                f"JETLOOP_NAMESPACE {namespace!r}: no such namespace in {store} "
                f"(`jetloop namespace create {namespace}`)"
            )
        return SecretStr(cred.password) if cred is not None else None

    @field_validator("nats_watch_password", mode="after")
    @classmethod
    def _stored_watch_password(cls, v: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if v is not None:
            return v
        store = info.data.get("store_dir")
        return read_watch_password(store) if store is not None else None

    @property
    def nats_watch_urls(self) -> list[str] | None:
        """The server URLs as the system account's watch user, or None without its password."""
        if self.nats_watch_password is None:
            return None
        user = urllib.parse.quote(self.nats_watch_user, safe="")
        password = urllib.parse.quote(self.nats_watch_password.get_secret_value(), safe="")
        out = []
        for u in (u.strip() for u in self.nats_url.split(",") if u.strip()):
            scheme, sep, rest = u.partition("://")
            rest = rest.rpartition("@")[2]  # another user's credentials are not the watch's
            out.append(f"{scheme}{sep}{user}:{password}@{rest}")
        return out

    @property
    def nats_urls(self) -> list[str]:
        """The server URLs, with the user and password in each that has none (nats-py reads
        them there); ``nats_url`` stays without them, for logs."""
        return self.with_credentials([u.strip() for u in self.nats_url.split(",") if u.strip()])

    def for_namespace(self, namespace: str) -> Settings:
        """These settings acting in ``namespace`` as its workers, with the store directory's
        credential of them (the local processes of ``jetloop up`` serve every namespace)."""
        if namespace == self.namespace:
            return self
        cred = namespaces.read_credential(self.store_dir, namespace, namespaces.WORKER)
        if cred is None:
            raise namespaces.NamespaceError(f"no namespace {namespace!r} in {self.store_dir}")
        return self.model_copy(
            update={
                "namespace": namespace,
                "nats_user": cred.user,
                "nats_password": SecretStr(cred.password),
            }
        )

    @property
    def local_user(self) -> str:
        """The user of the store's credentials: the workers' of ``namespace``."""
        return namespaces.user_name(self.namespace, namespaces.WORKER)

    def with_credentials(self, urls: list[str]) -> list[str]:
        """``urls`` with these settings' user and password in each that has none (unchanged
        without a password: ``JETLOOP_NATS_PASSWORD``, or the store directory's)."""
        if self.nats_password is None:
            return urls
        user = urllib.parse.quote(self.nats_user or self.local_user, safe="")
        password = urllib.parse.quote(self.nats_password.get_secret_value(), safe="")
        out = []
        for u in urls:
            scheme, sep, rest = u.partition("://")
            out.append(u if "@" in rest else f"{scheme}{sep}{user}:{password}@{rest}")
        return out

    def as_env(self, **overrides: object) -> dict[str, str]:
        """The ``JETLOOP_*`` variables that give a child process these settings: every plain
        setting given (by the environment, a file, an option or a copy), with ``overrides``
        (field names) on top; ``None`` leaves a variable out. Settings left at their default
        are left out too, so what the parent changed in its own environment after reading them
        (``jetloop up`` sets ``JETLOOP_VENDOR_DB``) still reaches the child; structured ones
        (the gateway's tokens and hooks) are no worker's business and come from the
        environment alone."""
        values: dict[str, object] = {
            name: getattr(self, name) for name in self.model_fields_set
        } | overrides
        env: dict[str, str] = {}
        for name, value in values.items():
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            if isinstance(value, bool):
                env[f"JETLOOP_{name.upper()}"] = "true" if value else "false"
            elif isinstance(value, str | int | float | Path):
                env[f"JETLOOP_{name.upper()}"] = str(value)
        return env

    def sealer(self) -> Sealer | None:
        if self.seal_key is None:
            return None
        keys = [key_bytes(self.seal_key.get_secret_value())]
        keys += [key_bytes(k) for k in self.seal_old_keys.split(",") if k.strip()]
        return Sealer(keys, tolerance=self.seal_tolerance_seconds)

    def topology(self) -> TopologyConfig:
        return TopologyConfig(
            replicas=self.replicas,
            lease_seconds=self.lease_seconds,
            event_log=self.event_log,
        )


def parse_namespace_apps(text: str) -> dict[str, str]:
    """``b=module:attr,c=module:attr`` as a map; a part without ``=`` or named twice is an
    error (a ``ValueError`` the setting's name is put on)."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        namespace, eq, spec = (x.strip() for x in part.partition("="))
        if not eq or not namespace or not spec:
            raise ValueError(f"{part!r}: expected <namespace>=<module:attr>")
        if namespace in out:
            raise ValueError(f"namespace {namespace!r} is given two apps")
        out[namespace] = spec
    return out


def read_seal_key(store_dir: Path) -> SecretStr | None:
    """The key kept in the store directory, or None when there is none."""
    path = store_dir / SEAL_KEY_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc.strerror or exc}") from None
    if not text:
        raise ValueError(f"{path} is empty: delete it (`jetloop up` makes a new one) or fill it")
    return SecretStr(text)


def make_seal_key(store_dir: Path) -> str:
    """The embedded default's checkpoint key: made once, kept in the store directory (0600)."""
    path = store_dir / SEAL_KEY_FILE
    write_once(path, secrets.token_hex(32))
    return path.read_text().strip()


NATS_USERS_FILE = "nats-users.json"
# The user every local process connects as when the store directory's credentials are used.
LOCAL_USER = "worker"
# The system account's user that hears connections close (jetloop.services.natsauth).
WATCH_USER = "watch"


def read_watch_password(store_dir: Path) -> SecretStr | None:
    """The ``watch`` password of ``<store dir>/nats-users.json``, or None when there is none
    (no file, or one from before that user existed)."""
    try:
        users = json.loads((store_dir / NATS_USERS_FILE).read_text())
    except (OSError, ValueError):
        return None  # read_local_password, validated first, names what is wrong
    password = users.get(WATCH_USER) if isinstance(users, dict) else None
    return SecretStr(password) if isinstance(password, str) and password else None


def read_local_password(store_dir: Path) -> SecretStr | None:
    """The ``worker`` password of ``<store dir>/nats-users.json``, or None when there is none."""
    path = store_dir / NATS_USERS_FILE
    try:
        users = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc.strerror or exc}") from None
    except ValueError:
        raise ValueError(f"{path} is not JSON: delete it (`jetloop up` makes a new one)") from None
    password = users.get(LOCAL_USER) if isinstance(users, dict) else None
    if not isinstance(password, str) or not password:
        raise ValueError(f"{path} has no {LOCAL_USER!r} password: delete it or fill it")
    return SecretStr(password)


# Settings whose values are secrets: an error names them and never shows what was given.
SECRET_SETTINGS = frozenset(
    {"seal_key", "seal_old_keys", "model_api_key", "nats_password", "nats_watch_password"}
)
# Fields, at any depth, that hold a secret (a webhook's).
SECRET_FIELDS = frozenset({"secret"})
# Settings keyed by a secret: the key of JETLOOP_GATEWAY_TOKENS is the token itself.
KEYED_BY_SECRET = frozenset({"tokens", "gateway_tokens"})


def describe_errors(exc: ValidationError, prefix: str = "JETLOOP_") -> str:
    """One line naming each wrong setting and, when it is no secret, the value given.

    The name is the variable's (``JETLOOP_GATEWAY_HOOKS``) and then the path inside its JSON;
    a token in the path shows as its fingerprint, and what was given is shown only when it
    is a plain value that is neither a secret nor holds one."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        head, rest = (loc[0], loc[1:]) if loc else ("", [])
        name = prefix + head.upper()
        if head in KEYED_BY_SECRET and rest:
            name += f" (the token {fingerprint(rest[0])})"
            rest = rest[1:]
        if rest:
            name += " " + ".".join(rest)
        line = f"setting {name}: {err['msg']}"
        given = err.get("input")
        secret = head in SECRET_SETTINGS or any(p in SECRET_FIELDS for p in loc)
        if not secret and isinstance(given, str | int | float | bool) and len(str(given)) < 200:
            line += f" (got {given!r})"
        lines.append(line)
    return "; ".join(lines)


def load_settings(**overrides: object) -> Settings:
    """The settings from the environment, with ``overrides`` (field names) on top; a wrong
    value raises ``SettingsError`` naming its environment variable."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise SettingsError(describe_errors(exc)) from None
    except PydanticSettingsError as exc:
        # A structured setting that is not JSON; the value is not repeated (it may hold secrets).
        m = re.search(r'field "(\w+)"', str(exc))
        name = f"JETLOOP_{m.group(1).upper()}" if m else "a JETLOOP_ setting"
        raise SettingsError(f"setting {name}: not valid JSON") from None
