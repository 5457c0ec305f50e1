"""``jetloop namespace``: make, list and delete namespaces, set what each may use of the
server, and give people credentials in them (``jetloop.services.namespaces``; docs/design.md,
"Namespaces")."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click
from pydantic import ByteSize, TypeAdapter, ValidationError

from jetloop.services import listening, namespaces
from jetloop.services.cli.main import _settings, main

if TYPE_CHECKING:
    from jetloop.services.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

# Written for "no limit", in a flag and in what the commands show.
NONE = "none"


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _shown(value: object) -> str:
    """A limit as the commands show it: sizes in binary units (1GiB), none for no limit."""
    if value is None:
        return NONE
    if isinstance(value, ByteSize):
        # Exact where it can be (what was set reads back as set), else about.
        for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value >= size and value % size == 0:
                return f"{value // size}{unit}"
        return f"{int(value)}B"
    return str(value)


def _limit_options(defaults: bool) -> Callable[[F], F]:
    """One option per limit (``namespaces.Limits``: every field, so a new limit needs no
    change here); ``defaults``: say each one's default for a new namespace."""

    def add(f: F) -> F:
        for name, field in reversed(namespaces.Limits.model_fields.items()):
            size = "SIZE" if "ByteSize" in repr(field.annotation) else "N"
            extra = f" [default: {_shown(field.default)}]" if defaults else ""
            f = click.option(
                _flag(name),
                name,
                metavar=size,
                help=f"{field.description}; {NONE}: no limit{extra}",
            )(f)
        return f

    return add


def _limits(base: namespaces.Limits, given: dict[str, str | None]) -> namespaces.Limits:
    """``base`` with the limits given as flags; a bad value is one line naming its flag."""
    values = base.model_dump()
    for name, text in given.items():
        if text is None:
            continue
        if text.strip().lower() == NONE:
            values[name] = None
            continue
        field = namespaces.Limits.model_fields[name]
        assert field.annotation is not None
        try:
            TypeAdapter(field.annotation).validate_python(text)
        except ValidationError as exc:
            why = exc.errors(include_url=False)[-1]["msg"]
            size = "ByteSize" in repr(field.annotation)
            example = "e.g. 512MiB, 1GiB" if size else "a number"
            raise click.ClickException(
                f"{_flag(name)} {text!r}: {why} ({example}, or {NONE} for no limit)"
            ) from None
        values[name] = text
    return namespaces.Limits.model_validate(values)


def _described(limits: namespaces.Limits) -> str:
    if limits == namespaces.NO_LIMITS:
        return "no limits"
    return " ".join(f"{_flag(k)[2:]}={_shown(v)}" for k, v in limits if v is not None)


@main.group()
def namespace() -> None:
    """Namespaces: tenants the NATS server keeps apart (one account each)."""


@namespace.command("create")
@click.argument("name")
@click.option("--store-dir", type=click.Path(file_okay=False), help="default JETLOOP_STORE_DIR")
@_limit_options(defaults=True)
def create(name: str, store_dir: str | None, **given: str | None) -> None:
    """Make namespace NAME and its client credential, written to
    <store>/namespaces/NAME.json (0600), with what it may use of the server (the flags;
    <store>/namespaces/NAME.limits.json). A running `jetloop up` serves it within seconds.
    Sizes take units: 512MiB, 1GiB (binary), 1GB (decimal)."""
    s = _settings(store_dir=store_dir)
    limits = _limits(namespaces.Limits(), given)
    try:
        cred = namespaces.create(s.store_dir, name, limits)
    except (namespaces.NamespaceError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    path = namespaces.credential_path(s.store_dir, name)
    click.echo(f"namespace {name}: client credential in {path} (user {cred.user})")
    click.echo(f"  limits: {_described(limits)}")
    up = listening.running(s.store_dir)
    if up is None:
        return  # served once `jetloop up` starts on this store
    if not up.embedded:
        # `up` dials servers of the user's (JETLOOP_NATS_URL): they know the namespace's
        # account only once their configuration has it, which is not this command's to wait on.
        click.echo(
            f"  the running `jetloop up` (pid {up.pid}) serves it once your NATS servers "
            "know its account (docs/design.md, Namespaces)"
        )
        return
    # An `up` runs on this store: back once its workers serve the namespace, so the next
    # command (a send, a client of the credential) finds it ready.
    if asyncio.run(_served(s.for_namespace(name), SERVED_WITHIN)):
        click.echo(f"  served by the running `jetloop up` (pid {up.pid})")
    else:
        raise click.ClickException(
            f"namespace {name} was made, but the running `jetloop up` (pid {up.pid}) does "
            f"not serve it after {SERVED_WITHIN:g} s: its log says why"
        )


# How long ``namespace create`` waits for a running ``up`` to serve the new namespace (it
# looks at the store every second, reloads the server's accounts, starts the workers).
SERVED_WITHIN = 30.0


async def _served(ns: Settings, within: float) -> bool:
    """Whether a worker of the namespace advertises itself within ``within`` seconds."""
    from jetloop.services.client import Client

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            async with await Client.connect(ns.nats_urls, verify=False, give_up_after=2) as c:
                if await (await c.registry()).workers():
                    return True
        except Exception:  # refused until the server knows the credential; no topology yet
            pass
        await asyncio.sleep(0.2)
    return False


@namespace.command("limits")
@click.argument("name")
@click.option("--store-dir", type=click.Path(file_okay=False), help="default JETLOOP_STORE_DIR")
@click.option("--json", "as_json", is_flag=True, help="JSON, for machines")
@_limit_options(defaults=False)
def limits_(name: str, store_dir: str | None, as_json: bool, **given: str | None) -> None:
    """Show what namespace NAME may use of the server or, with flags, change it (the others
    stay). A running `jetloop up` applies a change within seconds: a smaller storage limit
    refuses new writes past it, and deletes nothing."""
    s = _settings(store_dir=store_dir)
    try:
        namespaces.check_name(name)
        if not namespaces.exists(s.store_dir, name):
            raise namespaces.NamespaceError(
                f"no namespace {name!r}: `jetloop namespace create {name}`"
            )
        limits = namespaces.read_limits(s.store_dir, name)
        if any(v is not None for v in given.values()):
            limits = _limits(limits, given)
            namespaces.write_limits(s.store_dir, name, limits)
    except (namespaces.NamespaceError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(limits.model_dump(), indent=2))
        return
    for k, v in limits:
        click.echo(f"{_flag(k)[2:]}\t{_shown(v)}")


@namespace.command("list")
@click.option("--store-dir", type=click.Path(file_okay=False), help="default JETLOOP_STORE_DIR")
@click.option("--json", "as_json", is_flag=True, help="JSON, for machines")
def list_(store_dir: str | None, as_json: bool) -> None:
    """The namespaces of the store, who has a credential in each, and its limits."""
    s = _settings(store_dir=store_dir)
    try:
        rows = {
            ns: (
                [namespaces.user_name(ns, who) for who in namespaces.identities(s.store_dir, ns)],
                namespaces.read_limits(s.store_dir, ns),
            )
            for ns in namespaces.names(s.store_dir)
        }
    except namespaces.NamespaceError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        out = {
            ns: {"users": users, "limits": lim.model_dump()} for ns, (users, lim) in rows.items()
        }
        click.echo(json.dumps(out, indent=2))
        return
    for ns, (users, lim) in rows.items():
        click.echo(f"{ns}\t{', '.join(users)}\t{_described(lim)}")


@namespace.command("credential")
@click.argument("name")
@click.argument("who")
@click.option("--store-dir", type=click.Path(file_okay=False), help="default JETLOOP_STORE_DIR")
def credential(name: str, who: str, store_dir: str | None) -> None:
    """Make a credential for one more person or service WHO in namespace NAME, written to
    <store>/namespaces/NAME.WHO.json (0600): what WHO decides over NATS is recorded as
    decided by NAME.WHO. A running `jetloop up` lets it in within seconds."""
    s = _settings(store_dir=store_dir)
    try:
        cred = namespaces.add_identity(s.store_dir, name, who)
    except (namespaces.NamespaceError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    path = namespaces.credential_path(s.store_dir, name, who)
    click.echo(f"{cred.user}: credential in {path}")


@namespace.command("delete")
@click.argument("name")
@click.option("--store-dir", type=click.Path(file_okay=False), help="default JETLOOP_STORE_DIR")
@click.option("--yes", is_flag=True, help="delete without asking")
def delete(name: str, store_dir: str | None, yes: bool) -> None:
    """Delete namespace NAME and everything it holds: its sessions, turns, calls, approvals,
    questions, events, blobs and dead letters, and every credential in it. `jetloop up` must
    be stopped (a running server keeps the namespace's streams open)."""
    from jetloop.services.up import UpError, lock_store, release_store

    s = _settings(store_dir=store_dir)
    try:
        namespaces.check_name(name)
        if not namespaces.exists(s.store_dir, name) or name == namespaces.DEFAULT:
            namespaces.delete(s.store_dir, name)  # says why not
    except namespaces.NamespaceError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        # Held while deleting: no `up` runs on the store meanwhile.
        lock = lock_store(s.store_dir)
    except UpError as exc:
        raise click.ClickException(
            f"{exc}: stop it first (a running server keeps the namespace's streams open)"
        ) from None
    try:
        data = s.store_dir / namespaces.JETSTREAM_DIR / name
        who = [namespaces.user_name(name, w) for w in namespaces.identities(s.store_dir, name)]
        click.echo(f"namespace {name} holds: its data in {data} (every session, turn, call,")
        click.echo("  approval, question, event, blob and dead letter) and the credentials of its")
        click.echo(f"  workers and of {', '.join(who) or 'nobody else'}")
        if not yes:
            click.confirm(f"delete namespace {name} and all of it?", abort=True)
        removed = namespaces.delete(s.store_dir, name)
    finally:
        release_store(lock)
    click.echo(f"deleted namespace {name}: {len(removed)} paths removed")
