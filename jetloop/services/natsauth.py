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
  turn requests (``jl.turn.>``), make control requests (``jl.control.>``) but not change
  approval policies (``jl.control.approval_policy.>``), read streams
  and buckets through the JetStream API and follow them through ephemeral consumers, and
  hear live text (``jl.live.>``); it may not write any bucket or the object store, publish
  steps, events or dead letters, pull or ack the work queues, or change streams and
  consumers. Without the seal key, the CLI and the Python client take decisions through the
  workers' control API (``jl.control.*``), which this role may use.
- ``operator``: read-only: stream and consumer information, direct and message gets, and
  ephemeral consumers on the streams that are not work queues.

Least privilege on the bus (issue 29): each role below ``worker``, and each named identity
of a namespace, subscribes only under its own inbox prefix
(``jetloop.streams.connection.identity_inbox_prefix``; ``connect`` uses it for a connection
as that user) and publishes into no inbox at all, so it neither sees nor feeds the workers'
and the projector's pull deliveries, answers and direct gets, nor another identity's. It may
create consumers only on the legacy ephemeral subject ``$JS.API.CONSUMER.CREATE.<stream>``,
where the server refuses a durable name (named ones only on the blob store's stream); and it
may not pull from, ack or flow-control jetloop's own durable (the projector's), whose name that
subject cannot shield from an update in the request body: the projector checks its
consumer and makes it again when it was changed (``jetloop.services.readmodel.projector``).

One more user, ``watch``, lives in the server's *system account* (``SYS``): it may only
subscribe to the connection-closed advisories (``$SYS.ACCOUNT.*.DISCONNECT``). Workers
connect a second time as ``watch`` to learn at once that another worker's connection closed,
and hand that worker's steps on without waiting for their leases (``jetloop.services.rescue``).

Each namespace's account carries the namespace's limits (``jetloop.services.namespaces.Limits``,
``account_limits``): the server refuses a namespace's write past its storage limit, and its
connections, subscriptions and consumers past theirs, so no namespace can fill the disk or
the server for the others.
"""

from __future__ import annotations

import json
import secrets
import urllib.parse
from pathlib import Path

from jetloop.services import durability, namespaces
from jetloop.services.control import subject as control_subject
from jetloop.services.readmodel.projector import DEFAULT_DURABLE as PROJECTOR_DURABLE
from jetloop.services.settings import LOCAL_USER, NATS_USERS_FILE, WATCH_USER
from jetloop.services.storefiles import replace, write_once
from jetloop.sessions.requests import PRIVILEGED
from jetloop.streams.connection import identity_inbox_prefix
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


# The turn events of every session (``jl.event.<session>.turn.<how>``), and the model's
# answers, which carry ``turn.completed`` in the folded log (``jetloop.schemas.log``).
TURN_EVENTS = "jl.event.*.turn.*"
ANSWERS = "jl.event.*.history.assistant"


def _inbox(who: str) -> str:
    """The inboxes of role or identity ``who``: its prefix's alone, never another's."""
    return f"{identity_inbox_prefix(who)}.>"


# Not even a worker empties a state key's history through the stream API: that would let the
# key's first sealed state be put back over revision 0 (a seal names the revision it replaces:
# ``jetloop.streams.seal``). jetloop never purges the bucket; a key is deleted by a marker.
NO_ONE = [f"$JS.API.STREAM.PURGE.KV_{STATE_BUCKET}"]

WORKER_PERMISSIONS = {"publish": {"allow": [">"], "deny": NO_ONE}}


def client_permissions(who: str) -> dict[str, dict[str, list[str]]]:
    """A client's: start and follow turns, read, and make control requests as ``who`` only
    (``jl.control.<op>.<who>``: the workers take who decided from that subject, which the
    server lets no other credential publish), but no privileged one (changing an approval
    policy: ``jetloop.sessions.requests.PRIVILEGED``), which is the workers' role's."""
    return {
        "publish": {
            "allow": ["jl.turn.>", control_subject("*", who), *_READS],
            "deny": [
                *_WRITES,
                *_NOT_THEIRS,
                *(control_subject(op, who) for op in sorted(PRIVILEGED)),
            ],
        },
        # Its own inboxes (answers, its consumers' deliveries; a prefix per identity, so one
        # identity never hears another's), the live text of turns (``jetloop send`` prints
        # it) and the turn events and answers it could read from the log anyway, heard as
        # they are stored (a wait's wake-up: ``services.turnends``).
        "subscribe": {"allow": [_inbox(who), "jl.live.>", TURN_EVENTS, ANSWERS]},
    }


PERMISSIONS: dict[str, dict[str, dict[str, list[str]]] | None] = {
    LOCAL_USER: WORKER_PERMISSIONS,
    "client": client_permissions(namespaces.CLIENT),
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
        replace(path, json.dumps(users, indent=2))
    return {r: users[r] for r in ROLES}


def system_account(watch_password: str) -> dict[str, object]:
    """The config that names the system account and gives it the ``watch`` user: a part of
    every server's config that workers may watch (``server_config`` includes it)."""
    watch = {"user": WATCH_USER, "password": watch_password, "permissions": WATCH_PERMISSIONS}
    return {"accounts": {SYSTEM_ACCOUNT: {"users": [watch]}}, "system_account": SYSTEM_ACCOUNT}


def server_config(
    users: dict[str, str], store_dir: Path | None = None, sync: str = durability.ALWAYS
) -> str:
    """nats-server's config (JSON is valid config syntax): one account per namespace
    (``jetloop.services.namespaces``), each with its users and their permissions, and the
    system account. ``store_dir`` names where the namespaces' credentials are; without it,
    the default namespace alone. ``sync``: when the server puts an acknowledged write on
    disk (``jetloop.services.durability``; always, unless the operator chose otherwise)."""
    accounts: dict[str, object] = {}
    names = namespaces.names(store_dir) if store_dir is not None else [namespaces.DEFAULT]
    for ns in names:
        entries: list[dict[str, object]] = []
        if ns == namespaces.DEFAULT:
            for role in ACCOUNT_ROLES:
                entry: dict[str, object] = {"user": role, "password": users[role]}
                perms = PERMISSIONS[role]
                if perms is not None:
                    entry["permissions"] = perms
                entries.append(entry)
        else:
            assert store_dir is not None
            worker = namespaces.read_credential(store_dir, ns, namespaces.WORKER)
            assert worker is not None
            entries.append(_entry(worker, WORKER_PERMISSIONS))
        if store_dir is not None:
            for who in namespaces.identities(store_dir, ns):
                if ns == namespaces.DEFAULT and who in namespaces.DEFAULT_ROLES:
                    continue
                cred = namespaces.read_credential(store_dir, ns, who)
                if cred is not None:
                    entries.append(_entry(cred, client_permissions(who)))
        # Every namespace's account has JetStream: its streams and buckets are its own, within
        # the namespace's limits (none when it has no limits file).
        limits = namespaces.read_limits(store_dir, ns) if store_dir is not None else None
        accounts[ns] = {**account_limits(limits), "users": entries}
    system = system_account(users[WATCH_USER])
    config = {
        **durability.server_block(sync),
        **system,
        "accounts": {**accounts, **system["accounts"]},  # type: ignore[dict-item]
    }
    return json.dumps(config, indent=2) + "\n"


# Which of a namespace's limits (``namespaces.Limits``, whose field names are the server's
# keys) go in the account's ``jetstream`` block and which in its ``limits`` block; the
# others are kept by jetloop's workers (``turn_rate``).
JETSTREAM_LIMITS = ("max_file", "max_mem", "max_streams", "max_consumers")
ACCOUNT_LIMITS = ("max_connections", "max_subscriptions", "max_payload")


def account_limits(limits: namespaces.Limits | None) -> dict[str, object]:
    """The ``jetstream`` and ``limits`` of a namespace's account in nats-server's config:
    JetStream enabled with the namespace's storage, stream and consumer limits (-1: none),
    and its connection, subscription and payload limits (left out: none). A reload applies
    a change to running connections and streams: a write past a smaller storage limit is
    refused (JetStream error 10002), what is stored stays."""
    if limits is None or limits == namespaces.NO_LIMITS:
        return {"jetstream": "enabled"}
    values = limits.model_dump()
    js = {k: -1 if values[k] is None else int(values[k]) for k in JETSTREAM_LIMITS}
    out: dict[str, object] = {"jetstream": js}
    account = {k: int(values[k]) for k in ACCOUNT_LIMITS if values[k] is not None}
    if account:
        out["limits"] = account
    return out


def _entry(cred: namespaces.Credential, perms: object) -> dict[str, object]:
    return {"user": cred.user, "password": cred.password, "permissions": perms}


def write_config(
    store_dir: Path, server_name: str | None = None, sync: str = durability.ALWAYS
) -> Path:
    """Make the users if needed and write the server's config beside them (0600).
    ``server_name``: the name the server is started with, for a server that will reload the
    file (nats-server refuses a reload whose file names no server, or another, even when the
    command line names it); ``sync``: as ``server_config``."""
    text = server_config(make_users(store_dir), store_dir, sync)
    if server_name is not None:
        text = json.dumps({"server_name": server_name, **json.loads(text)}, indent=2) + "\n"
    path = store_dir / CONFIG_FILE
    replace(path, text)
    return path


def url_as(url: str, store_dir: Path, role: str = LOCAL_USER) -> str:
    """``url`` with the user ``role`` and its password from the store directory's users."""
    password = make_users(store_dir)[role] if (store_dir / NATS_USERS_FILE).exists() else None
    if password is None:
        raise FileNotFoundError(f"{store_dir / NATS_USERS_FILE} does not exist")
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{role}:{urllib.parse.quote(password, safe='')}@{rest}"
