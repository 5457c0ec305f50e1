"""Namespaces: tenants the NATS server keeps apart, one account each (docs/design.md,
"Namespaces").

A namespace holds sessions, turns, calls, approvals, questions, events, blobs and dead
letters. Each is a NATS account of its own, so its streams, buckets, consumers, subjects and
reply inboxes exist only there: a credential of one namespace cannot name, list, read or
change anything of another, because for the server there is nothing of another to name.
Inside a namespace everything is as before (the same subjects, streams and keys), so a
client needs no prefix: its credential is its namespace.

The store directory keeps the credentials (0600, written whole; ``jetloop.services.natsauth``
turns them into the server's accounts):

- ``default`` is the namespace every store had before namespaces existed: its users are the
  roles of ``nats-users.json`` (``worker``, ``client``, ``operator``).
- ``namespaces/<name>.json`` is the client credential of namespace ``<name>`` (user
  ``<name>.client``), ``namespaces/<name>.worker.json`` its workers' (user ``<name>.worker``),
  ``namespaces/<name>.<who>.json`` one more person's or service's (user ``<name>.<who>``).

An identity (``who``) acting in a namespace has a credential of its own: over NATS the
workers take who decided from the credential (``jetloop.services.control``), never from what
the message says.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError

# Defined with the rest of the public tree; importable from here too.
from jetloop.schemas.errors import NamespaceError as NamespaceError
from jetloop.schemas.ids import DEFAULT_NAMESPACE
from jetloop.services.storefiles import replace, write_once

DEFAULT = DEFAULT_NAMESPACE
DIRECTORY = "namespaces"
# The embedded server keeps each account's JetStream data in a directory named after it.
JETSTREAM_DIR = Path("nats") / "jetstream"
# The account the default namespace lived in before namespaces existed (nats-server's global
# account): its data moves to DEFAULT's directory once (``migrate_default``).
GLOBAL_ACCOUNT = "$G"

WORKER = "worker"
CLIENT = "client"
OPERATOR = "operator"
# The default namespace's users from before namespaces (``nats-users.json``) keep their names.
DEFAULT_ROLES = (WORKER, CLIENT, OPERATOR)
LIMITS = "limits"
# Not a person's name: the workers', the read-only role's, and the system account's user;
# ``<namespace>.limits.json`` is the namespace's limits, not a credential.
RESERVED_IDENTITIES = frozenset({WORKER, OPERATOR, "watch", LIMITS})

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
NAME_RULE = "1 to 40 of a-z, 0-9, _ and -, starting with a letter or digit"


def check_name(name: str) -> str:
    # fullmatch: ``$`` also matches before a trailing newline, and "a\n" names no account.
    if not _NAME.fullmatch(name):
        raise NamespaceError(f"namespace {name!r} is not a name: {NAME_RULE}")
    return name


def check_identity(who: str) -> str:
    if not _NAME.fullmatch(who):
        raise NamespaceError(f"identity {who!r} is not a name: {NAME_RULE}")
    return who


def user_name(namespace: str, who: str) -> str:
    """The NATS user of ``who`` in ``namespace``: ``<namespace>.<who>``, but the default
    namespace's three roles keep their names from before namespaces."""
    if namespace == DEFAULT and who in DEFAULT_ROLES:
        return who
    return f"{namespace}.{who}"


def identity(user: str) -> tuple[str, str]:
    """``(namespace, who)`` of a NATS user named by :func:`user_name`."""
    namespace, dot, who = user.partition(".")
    return (namespace, who) if dot else (DEFAULT, user)


@dataclass(frozen=True)
class Credential:
    user: str
    password: str


MiB = 1024 * 1024
GiB = 1024 * MiB
# The server's max_payload (nats-server's default, which the embedded server keeps): an
# account's can only be smaller.
SERVER_MAX_PAYLOAD = 1 * MiB

Size = Annotated[ByteSize, Field(ge=1)]
Count = Annotated[int, Field(ge=1)]


class Limits(BaseModel):
    """What one namespace may use of the server; None: no limit. The defaults are those of
    a namespace made now. All but ``turn_rate`` (which jetloop's workers keep, in their
    intake) are the account's limits in nats-server's
    config (the field names are its keys; ``jetloop.services.natsauth`` writes them), so the
    server enforces them for every credential of the namespace, the workers' too."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_file: Size | None = Field(
        default=ByteSize(1 * GiB),
        description="JetStream file storage of all its streams, buckets and blobs: past it "
        "every write of the namespace is refused, and no other namespace's",
    )
    max_mem: Size | None = Field(
        default=ByteSize(16 * MiB),
        description="JetStream memory storage (jetloop keeps none in memory)",
    )
    max_streams: Count | None = Field(default=32, description="streams (jetloop makes 9)")
    max_consumers: Count | None = Field(
        default=1000,
        description="consumers on each stream (a worker makes one per agent on the turns, "
        "three per agent on the steps; every reader, listing and live view one for a while)",
    )
    max_connections: Count | None = Field(
        default=256, description="connections open at once, the workers' and the gateway's too"
    )
    max_subscriptions: Count | None = Field(
        default=10_000, description="subscriptions of all its connections"
    )
    max_payload: Annotated[ByteSize, Field(ge=1, le=SERVER_MAX_PAYLOAD)] | None = Field(
        default=None,
        description=f"one message's size, at most the server's {SERVER_MAX_PAYLOAD // MiB} MiB "
        "(a client that sends a larger one is disconnected)",
    )
    turn_rate: Annotated[float, Field(gt=0)] | None = Field(
        default=20.0,
        description="turn requests a second its workers take in (the rest wait queued)",
    )


NO_LIMITS = Limits.model_validate(dict.fromkeys(Limits.model_fields))


def limits_path(store_dir: Path, namespace: str) -> Path:
    return directory(store_dir) / f"{namespace}.{LIMITS}.json"


def read_limits(store_dir: Path, namespace: str) -> Limits:
    """The limits of ``namespace``: its file's, or ``NO_LIMITS`` when it has none."""
    path = limits_path(store_dir, namespace)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return NO_LIMITS
    except OSError as exc:
        raise NamespaceError(f"{path} cannot be read: {exc}") from None
    try:
        return Limits.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise NamespaceError(f"{path} holds no limits: {where}: {first['msg']}") from None


def write_limits(store_dir: Path, namespace: str, limits: Limits) -> Path:
    """Write the limits of ``namespace`` whole (0600); a running ``up`` applies them within
    seconds (``listing`` changes, and the server reloads its accounts)."""
    check_name(namespace)
    path = limits_path(store_dir, namespace)
    replace(path, limits.model_dump_json(indent=2) + "\n")
    return path


def directory(store_dir: Path) -> Path:
    return store_dir / DIRECTORY


def credential_path(store_dir: Path, namespace: str, who: str = CLIENT) -> Path:
    name = f"{namespace}.json" if who == CLIENT else f"{namespace}.{who}.json"
    return directory(store_dir) / name


def read_credential(store_dir: Path, namespace: str, who: str = CLIENT) -> Credential | None:
    """The credential of ``who`` in ``namespace``, or None when the store has none."""
    if namespace == DEFAULT and who in DEFAULT_ROLES:
        try:
            users = json.loads((store_dir / "nats-users.json").read_text())
        except (OSError, ValueError):
            return None
        password = users.get(who) if isinstance(users, dict) else None
        return Credential(who, password) if isinstance(password, str) and password else None
    path = credential_path(store_dir, namespace, who)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise NamespaceError(f"{path} cannot be read: {exc}") from None
    if not isinstance(data, dict) or not all(
        isinstance(data.get(k), str) and data[k] for k in ("user", "password")
    ):
        raise NamespaceError(f'{path} is not a credential: {{"user": …, "password": …}}')
    return Credential(data["user"], data["password"])


def names(store_dir: Path) -> list[str]:
    """Every namespace of the store: ``default`` first, then the others by name."""
    found = sorted(
        p.name[: -len(f".{WORKER}.json")]
        for p in directory(store_dir).glob(f"*.{WORKER}.json")
        if _NAME.fullmatch(p.name[: -len(f".{WORKER}.json")])
    )
    return [DEFAULT, *(n for n in found if n != DEFAULT)]


def identities(store_dir: Path, namespace: str) -> list[str]:
    """Who has a credential in ``namespace`` (the workers' not counted)."""
    if namespace == DEFAULT:
        out = [CLIENT, OPERATOR]
    else:
        out = [CLIENT] if credential_path(store_dir, namespace).exists() else []
    for p in directory(store_dir).glob(f"{namespace}.*.json"):
        who = p.name[len(namespace) + 1 : -len(".json")]
        if _NAME.fullmatch(who) and who not in RESERVED_IDENTITIES and who != CLIENT:
            out.append(who)
    return sorted(set(out))


def listing(store_dir: Path) -> list[str]:
    """The credential and limits files of the store, by name, each limits file with a digest
    of what it says: what the server's accounts are made of (a change means the server must
    reload them; ``jetloop.services.namespaced`` compares two listings)."""
    out: list[str] = []
    for p in sorted(directory(store_dir).glob("*.json")):
        if not p.name.endswith(f".{LIMITS}.json"):
            out.append(p.name)
            continue
        try:
            digest = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        except FileNotFoundError:
            continue  # removed meanwhile (a namespace being deleted)
        out.append(f"{p.name}@{digest}")
    return out


def exists(store_dir: Path, namespace: str) -> bool:
    return namespace == DEFAULT or credential_path(store_dir, namespace, WORKER).exists()


def _make(store_dir: Path, namespace: str, who: str) -> Credential:
    path = credential_path(store_dir, namespace, who)
    user = user_name(namespace, who)
    write_once(path, json.dumps({"user": user, "password": secrets.token_urlsafe(24)}, indent=2))
    found = read_credential(store_dir, namespace, who)
    assert found is not None
    return found


def create(store_dir: Path, namespace: str, limits: Limits | None = None) -> Credential:
    """Make namespace ``namespace`` with ``limits`` (default ``Limits()``): its workers'
    credential and its client credential (returned). Making one that exists is refused."""
    check_name(namespace)
    if exists(store_dir, namespace):
        raise NamespaceError(f"namespace {namespace!r} exists")
    # The limits first: the server never serves the namespace without them.
    write_limits(store_dir, namespace, Limits() if limits is None else limits)
    client = _make(store_dir, namespace, CLIENT)
    # The workers' last: a namespace is listed (``names``) once it is whole.
    _make(store_dir, namespace, WORKER)
    return client


def add_identity(store_dir: Path, namespace: str, who: str) -> Credential:
    """A credential for one more person or service acting in ``namespace`` (made once)."""
    check_identity(who)
    if who in RESERVED_IDENTITIES or (namespace == DEFAULT and who in DEFAULT_ROLES):
        raise NamespaceError(f"identity {who!r} is reserved")
    if not exists(store_dir, namespace):
        raise NamespaceError(f"no namespace {namespace!r}: `jetloop namespace create {namespace}`")
    return _make(store_dir, namespace, who)


def delete(store_dir: Path, namespace: str) -> list[Path]:
    """Remove namespace ``namespace`` with everything it holds: its credentials and the
    embedded server's data of its account. Only with the server stopped (the caller makes
    sure): a running server keeps an account's streams open. Returns what was removed."""
    check_name(namespace)
    if namespace == DEFAULT:
        raise NamespaceError("the default namespace cannot be deleted")
    if not exists(store_dir, namespace):
        raise NamespaceError(f"no namespace {namespace!r}")
    removed: list[Path] = []
    data = store_dir / JETSTREAM_DIR / namespace
    if data.exists():
        shutil.rmtree(data)
        removed.append(data)
    # The workers' credential first: a half-deleted namespace is no longer listed.
    for path in [
        credential_path(store_dir, namespace, WORKER),
        *sorted(directory(store_dir).glob(f"{namespace}.*.json")),
        credential_path(store_dir, namespace),
    ]:
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed


def readmodel_path(default_db: Path, namespace: str) -> Path:
    """Each namespace's read model is a database of its own beside the default one's."""
    if namespace == DEFAULT:
        return default_db
    return default_db.with_name(f"{default_db.stem}.{namespace}{default_db.suffix}")


def migrate_default(store_dir: Path) -> bool:
    """Move the default namespace's data from the server's global account to its own account
    (the embedded server's store, with the server stopped). Idempotent and safe to repeat
    after a crash: one rename. True when it moved something."""
    root = store_dir / JETSTREAM_DIR
    old, new = root / GLOBAL_ACCOUNT, root / DEFAULT
    if not old.exists():
        return False
    if new.exists():
        if not any(old.iterdir()):
            old.rmdir()
            return False
        raise NamespaceError(
            f"{old} and {new} both hold data: the store was opened by an older and a newer "
            "jetloop; keep the one with your sessions and move the other away"
        )
    old.rename(new)
    return True
