"""``jetloop namespace``: make, list and delete namespaces, and give people credentials in
them (``jetloop.services.namespaces``; docs/design.md, "Namespaces")."""

from __future__ import annotations

import json

import click

from jetloop.services.cli.main import _settings, main


@main.group()
def namespace() -> None:
    """Namespaces: tenants the NATS server keeps apart (one account each)."""


@namespace.command("create")
@click.argument("name")
@click.option("--store-dir", type=click.Path(file_okay=False), help="default JETLOOP_STORE_DIR")
def create(name: str, store_dir: str | None) -> None:
    """Make namespace NAME and its client credential, written to
    <store>/namespaces/NAME.json (0600). A running `jetloop up` serves it within seconds."""
    from jetloop.services import namespaces

    s = _settings(store_dir=store_dir)
    try:
        cred = namespaces.create(s.store_dir, name)
    except (namespaces.NamespaceError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    path = namespaces.credential_path(s.store_dir, name)
    click.echo(f"namespace {name}: client credential in {path} (user {cred.user})")


@namespace.command("list")
@click.option("--store-dir", type=click.Path(file_okay=False), help="default JETLOOP_STORE_DIR")
@click.option("--json", "as_json", is_flag=True, help="JSON, for machines")
def list_(store_dir: str | None, as_json: bool) -> None:
    """The namespaces of the store and who has a credential in each."""
    from jetloop.services import namespaces

    s = _settings(store_dir=store_dir)
    rows = {
        ns: [namespaces.user_name(ns, who) for who in namespaces.identities(s.store_dir, ns)]
        for ns in namespaces.names(s.store_dir)
    }
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for ns, users in rows.items():
        click.echo(f"{ns}\t{', '.join(users)}")


@namespace.command("credential")
@click.argument("name")
@click.argument("who")
@click.option("--store-dir", type=click.Path(file_okay=False), help="default JETLOOP_STORE_DIR")
def credential(name: str, who: str, store_dir: str | None) -> None:
    """Make a credential for one more person or service WHO in namespace NAME, written to
    <store>/namespaces/NAME.WHO.json (0600): what WHO decides over NATS is recorded as
    decided by NAME.WHO. A running `jetloop up` lets it in within seconds."""
    from jetloop.services import namespaces

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
    from jetloop.services import namespaces
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
