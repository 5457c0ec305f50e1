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

import json
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from jetloop.services.storefiles import write_once

DEFAULT = "default"
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
# Not a person's name: the workers', the read-only role's, and the system account's user.
RESERVED_IDENTITIES = frozenset({WORKER, OPERATOR, "watch"})

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
NAME_RULE = "1 to 40 of a-z, 0-9, _ and -, starting with a letter or digit"


class NamespaceError(ValueError):
    """A namespace or identity name that cannot be, or one that does not exist: one line."""


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise NamespaceError(f"namespace {name!r} is not a name: {NAME_RULE}")
    return name


def check_identity(who: str) -> str:
    if not _NAME.match(who):
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
        if _NAME.match(p.name[: -len(f".{WORKER}.json")])
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
        if _NAME.match(who) and who not in RESERVED_IDENTITIES and who != CLIENT:
            out.append(who)
    return sorted(set(out))


def listing(store_dir: Path) -> list[str]:
    """The credential files of the store, by name: what the server's accounts are made of
    (a change means the server must reload them)."""
    return sorted(p.name for p in directory(store_dir).glob("*.json"))


def exists(store_dir: Path, namespace: str) -> bool:
    return namespace == DEFAULT or credential_path(store_dir, namespace, WORKER).exists()


def _make(store_dir: Path, namespace: str, who: str) -> Credential:
    path = credential_path(store_dir, namespace, who)
    user = user_name(namespace, who)
    write_once(path, json.dumps({"user": user, "password": secrets.token_urlsafe(24)}, indent=2))
    found = read_credential(store_dir, namespace, who)
    assert found is not None
    return found


def create(store_dir: Path, namespace: str) -> Credential:
    """Make namespace ``namespace``: its workers' credential and its client credential
    (returned). Making one that exists is refused."""
    check_name(namespace)
    if exists(store_dir, namespace):
        raise NamespaceError(f"namespace {namespace!r} exists")
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
