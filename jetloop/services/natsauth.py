"""NATS authorization of the embedded default: users, roles and the server's config file.

``jetloop up`` makes ``<store dir>/nats-users.json`` once (0600, written whole and then
linked in place, as the seal key is), one random password per role, and starts its
nats-server with ``<store dir>/nats-server.conf`` (0600, written at every start from the
users file), in which each user has the subject permissions of its role:

- ``worker``: everything but purging the state bucket's stream (``NO_ONE``). Every process
  of ``up`` and every local command (the CLI, which with the store's seal key writes state
  itself for cancel, approve and reconcile) connects as ``worker``: whoever can read the
  store directory can read the seal key too, so a smaller role would protect nothing there.
- ``client``: for a program elsewhere that starts turns and watches them. It may publish
  turn requests (``jl.turn.>``), make control requests (``jl.control.>``), read streams
  and buckets through the JetStream API and follow them through ephemeral consumers, and
  hear live text (``jl.live.>``); it may not write any bucket or the object store, publish
  steps, events or dead letters, pull or ack the work queues, or change streams and
  consumers. Without the seal key, the CLI and the Python client take decisions through the
  workers' control API (``jl.control.*``), which this role may use.
- ``operator``: read-only: stream and consumer information, direct and message gets, and
  ephemeral consumers on the streams that are not work queues.

Least privilege on the bus (issue 29): each role below ``worker`` subscribes only under its
own inbox prefix (``jetloop.streams.connection.INBOX_PREFIXES``; ``connect`` uses it for a
connection as that role) and publishes into no inbox at all, so it neither sees nor feeds
the workers' and the projector's pull deliveries, answers and direct gets. It may create
consumers only on the legacy ephemeral subject ``$JS.API.CONSUMER.CREATE.<stream>``, where
the server refuses a durable name (named ones only on the blob store's stream); and it may
not pull from, ack or flow-control jetloop's own durable (the projector's), whose name that
subject cannot shield from an update in the request body: the projector checks its
consumer and makes it again when it was changed (``jetloop.services.readmodel.projector``).

One more user, ``watch``, lives in the server's *system account* (``SYS``): it may only
subscribe to the connection-closed advisories (``$SYS.ACCOUNT.*.DISCONNECT``). Workers
connect a second time as ``watch`` to learn at once that another worker's connection closed,
and hand that worker's steps on without waiting for their leases (``jetloop.services.rescue``).
"""

from __future__ import annotations

import json
import os
import secrets
import urllib.parse
from pathlib import Path

from jetloop.services.readmodel.projector import DEFAULT_DURABLE as PROJECTOR_DURABLE
from jetloop.services.settings import LOCAL_USER, NATS_USERS_FILE, WATCH_USER, write_once
from jetloop.streams.connection import INBOX_PREFIXES
from jetloop.streams.topology import BLOB_BUCKET, STATE_BUCKET

CONFIG_FILE = "nats-server.conf"
ROLES = (LOCAL_USER, "client", "operator", WATCH_USER)
# The roles of the account jetloop's streams live in (the global account).
ACCOUNT_ROLES = (LOCAL_USER, "client", "operator")

WORK_QUEUES = ("JL_TURNS", "JL_STEPS")

# What no one but a worker may publish.
_WRITES = [
    "$KV.>",
    "$O.>",
    "jl.step.>",
    "jl.sched.>",
    "jl.event.>",
    "jl.dead.>",
    "jl.cron.>",
    "jl.live.>",
    "$JS.API.STREAM.CREATE.>",
    "$JS.API.STREAM.UPDATE.>",
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.API.CONSUMER.DURABLE.CREATE.>",
    *(f"$JS.API.CONSUMER.CREATE.{q}" for q in WORK_QUEUES),
    *(f"$JS.API.CONSUMER.CREATE.{q}.>" for q in WORK_QUEUES),
    *(f"$JS.API.CONSUMER.MSG.NEXT.{q}.>" for q in WORK_QUEUES),
    *(f"$JS.ACK.{q}.>" for q in WORK_QUEUES),
]

# jetloop's durables outside the work queues: no one but a worker pulls, acks or
# flow-controls them (the work queues' are covered above, stream by stream).
OWN_DURABLES = (PROJECTOR_DURABLE,)
_NOT_THEIRS = [
    s
    for d in OWN_DURABLES
    for s in (
        f"$JS.API.CONSUMER.MSG.NEXT.*.{d}",
        f"$JS.ACK.*.{d}.>",
        f"$JS.FC.*.{d}.>",
    )
]

_READS = [
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.>",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.MSG.GET.>",
    "$JS.API.DIRECT.GET.>",
    "$JS.API.CONSUMER.INFO.>",
    "$JS.API.CONSUMER.NAMES.>",
    "$JS.API.CONSUMER.LIST.>",
    # Only the legacy ephemeral form, one token after the stream: there the server refuses
    # a durable name (``$JS.API.CONSUMER.CREATE.<stream>.<name>`` would make a durable).
    "$JS.API.CONSUMER.CREATE.*",
    # Named ones only on the blob store's stream: object-store libraries (nats.js among them)
    # read an object through a named ordered consumer, and jetloop keeps no durable there.
    f"$JS.API.CONSUMER.CREATE.OBJ_{BLOB_BUCKET}.>",
    "$JS.API.CONSUMER.MSG.NEXT.>",
    "$JS.ACK.>",
    "$JS.FC.>",
]

# The system account's one user: it hears connections close, and nothing else.
SYSTEM_ACCOUNT = "SYS"
DISCONNECT_ADVISORIES = "$SYS.ACCOUNT.*.DISCONNECT"
WATCH_PERMISSIONS = {
    "publish": {"allow": ["_INBOX.>"]},
    "subscribe": {"allow": [DISCONNECT_ADVISORIES, "_INBOX.>"]},
}


def _inbox(role: str) -> str:
    return f"{INBOX_PREFIXES[role]}.>"


# Not even a worker empties a state key's history through the stream API: that would let the
# key's first sealed state be put back over revision 0 (a seal names the revision it replaces:
# ``jetloop.streams.seal``). jetloop never purges the bucket; a key is deleted by a marker.
NO_ONE = [f"$JS.API.STREAM.PURGE.KV_{STATE_BUCKET}"]

PERMISSIONS: dict[str, dict[str, dict[str, list[str]]] | None] = {
    LOCAL_USER: {"publish": {"allow": [">"], "deny": NO_ONE}},
    "client": {
        "publish": {
            "allow": ["jl.turn.>", "jl.control.>", *_READS],
            "deny": [*_WRITES, *_NOT_THEIRS],
        },
        # Its own inboxes (answers, its consumers' deliveries) and the live text of turns
        # (``jetloop send`` prints it as it comes).
        "subscribe": {"allow": [_inbox("client"), "jl.live.>"]},
    },
    "operator": {
        "publish": {"allow": _READS, "deny": [*_WRITES, *_NOT_THEIRS]},
        "subscribe": {"allow": [_inbox("operator")]},
    },
}


def make_users(store_dir: Path) -> dict[str, str]:
    """``<store dir>/nats-users.json``: made once with a random password per role (0600).
    A file from before a role existed gets a password for it (the others are kept)."""
    path = store_dir / NATS_USERS_FILE
    if not path.exists():
        write_once(path, json.dumps({r: secrets.token_urlsafe(24) for r in ROLES}, indent=2))
    users = json.loads(path.read_text())
    missing = [r for r in ACCOUNT_ROLES if not isinstance(users.get(r), str) or not users[r]]
    if missing:
        raise ValueError(f"{path} has no password for {', '.join(missing)}: delete it")
    if not isinstance(users.get(WATCH_USER), str) or not users[WATCH_USER]:
        users[WATCH_USER] = secrets.token_urlsafe(24)
        _replace(path, json.dumps(users, indent=2))
    return {r: users[r] for r in ROLES}


def system_account(watch_password: str) -> dict[str, object]:
    """The config that names the system account and gives it the ``watch`` user: a part of
    every server's config that workers may watch (``server_config`` includes it)."""
    watch = {"user": WATCH_USER, "password": watch_password, "permissions": WATCH_PERMISSIONS}
    return {"accounts": {SYSTEM_ACCOUNT: {"users": [watch]}}, "system_account": SYSTEM_ACCOUNT}


def server_config(users: dict[str, str]) -> str:
    """The ``authorization`` block of nats-server's config (JSON is valid config syntax)."""
    entries = []
    for role in ACCOUNT_ROLES:
        entry: dict[str, object] = {"user": role, "password": users[role]}
        perms = PERMISSIONS[role]
        if perms is not None:
            entry["permissions"] = perms
        entries.append(entry)
    config = {"authorization": {"users": entries}, **system_account(users[WATCH_USER])}
    return json.dumps(config, indent=2) + "\n"


def write_config(store_dir: Path) -> Path:
    """Make the users if needed and write the server's config beside them (0600)."""
    text = server_config(make_users(store_dir))
    path = store_dir / CONFIG_FILE
    _replace(path, text)
    return path


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole (0600) under another name, then move it in place."""
    draft = path.parent / f".{path.name}.{os.getpid()}"
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(draft, path)


def url_as(url: str, store_dir: Path, role: str = LOCAL_USER) -> str:
    """``url`` with the user ``role`` and its password from the store directory's users."""
    password = make_users(store_dir)[role] if (store_dir / NATS_USERS_FILE).exists() else None
    if password is None:
        raise FileNotFoundError(f"{store_dir / NATS_USERS_FILE} does not exist")
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{role}:{urllib.parse.quote(password, safe='')}@{rest}"
