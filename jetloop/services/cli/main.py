"""The ``jetloop`` command group, and what its commands share: settings, a client with a
bounded wait for NATS, one-line errors, how an event is described.

The commands live beside it by what they are for (``run``, ``sessions``, ``decide``,
``inspect_command``); ``jetloop.services.cli`` imports them so that they register on ``main``.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from jetloop.services.client import Client
    from jetloop.services.settings import Settings

# The module (beside this one) that defines each command. A command's module is imported when
# the command runs, and all of them only to list them (``--help``): a command pays for its own
# imports alone, ``jetloop --version`` for none (tests/test_user_path.py holds it to this
# table).
COMMANDS = {
    **dict.fromkeys(
        ("up", "worker", "topology", "credentials", "trials", "bench", "gateway", "projector"),
        "run",
    ),
    **dict.fromkeys(
        ("send", "chat", "events", "snapshot", "turns", "turn", "sessions", "usage"),
        "sessions",
    ),
    **dict.fromkeys(("approve", "answer", "cancel", "reconcile", "policy"), "decide"),
    "inspect": "inspect_command",
    "namespace": "namespace_command",
}


class LazyGroup(click.Group):
    """A group whose commands register themselves when their module (``COMMANDS``) is
    imported; a name the table misses is looked for in every module."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        load_commands()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            importlib.import_module(f"{__package__}.{COMMANDS[cmd_name]}")
        if cmd_name not in self.commands:
            load_commands()
        return super().get_command(ctx, cmd_name)


def load_commands() -> None:
    """Import every command module (each registers its commands on ``main``)."""
    for module in sorted(set(COMMANDS.values())):
        importlib.import_module(f"{__package__}.{module}")


def _settings(**overrides: Any) -> Settings:
    from jetloop.schemas.errors import SettingsError
    from jetloop.services.settings import load_settings

    clean = {k: v for k, v in overrides.items() if v is not None}
    try:
        return load_settings(**clean)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None


def _namespace(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is None:
        return
    from jetloop.services.namespaces import NamespaceError, check_name

    try:
        check_name(value)
    except NamespaceError as exc:
        raise click.BadParameter(str(exc)) from None
    # Every setting read from here on acts in it (JETLOOP_NAMESPACE).
    os.environ["JETLOOP_NAMESPACE"] = value


F = TypeVar("F", bound=Callable[..., Any])


def namespace_option(f: F) -> F:
    """``--namespace NAME``: the namespace a command acts in (default JETLOOP_NAMESPACE, else
    ``default``)."""
    return click.option(
        "--namespace",
        metavar="NAME",
        callback=_namespace,
        expose_value=False,
        is_eager=True,
        help="the namespace to act in (default JETLOOP_NAMESPACE, else default)",
    )(f)


def _run(coro: Coroutine[Any, Any, None], settings: Settings | None = None) -> None:
    """Run a command's coroutine; given the settings of a long-lived process (a worker,
    ``up``), on the loop they choose (``jetloop.services.runner``)."""
    from jetloop.services.runner import run
    from jetloop.streams.connection import ConnectionLost

    try:
        if settings is None:
            asyncio.run(coro)
        else:
            run(coro, use_uvloop=settings.uvloop)
    except KeyboardInterrupt:
        pass
    except ConnectionLost as exc:  # a worker's connection closed: exit 1, to be restarted
        raise click.ClickException(str(exc)) from None


@click.group(cls=LazyGroup)
@click.version_option(package_name="jetloop")
@namespace_option
def main() -> None:
    """jetloop: durable execution of AI-agent turns on NATS JetStream."""
    from jetloop.services.logs import configure

    # Commands that talk to NATS print only what matters; services reconfigure logging.
    configure("console", "warning")


def invoked_as() -> str:
    """The command as the user ran it, for hints they can paste: the path when they gave one
    (``.venv/bin/jetloop``, as the README does), else ``jetloop``."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.sep in argv0 and os.path.basename(argv0).startswith("jetloop"):
        return argv0
    return "jetloop"


async def _session_exists(jl: Client, session_id: str) -> bool:
    """A session exists once it has a state record (``session.<id>``) or an event."""
    from nats.js.errors import KeyNotFoundError, NotFoundError

    from jetloop.schemas import validate_name
    from jetloop.streams import topology as topo
    from jetloop.streams.state import session_key

    try:
        validate_name("session id", session_id)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    kv = await jl.js.key_value(topo.STATE_BUCKET)
    try:
        await kv.get(session_key(session_id))
        return True
    except KeyNotFoundError:
        pass
    try:
        await jl.js.get_msg(
            topo.EVENTS_STREAM, seq=1, subject=topo.event_subject(session_id, ">"), next=True
        )
    except NotFoundError:
        return False
    return True


# How long a client command waits for NATS before it says so in one line: the first
# connect, and a reconnect after the server went away (at most --timeout where it has one).
PATIENCE = 5.0
# The first connect is bounded tighter: with nothing listening (no `jetloop up`) a connect is
# refused at once, and a person waits for that line; a server that answers does in well
# under this, even over a network.
FIRST_CONNECT = 1.5

Body = Callable[["Client"], Coroutine[Any, Any, None]]


def _client_cmd(nats_url: str | None, body: Body, timeout: float | None = None) -> None:
    """Run ``body(client)`` with a connected client. NATS that cannot be reached or is lost
    (after ``PATIENCE`` seconds, or ``timeout`` if shorter), a NATS error and a refused
    control request each end the command with one line and exit status 1."""
    s = _settings(nats_url=nats_url)
    _run(_with_client(s.nats_urls, body, timeout))


async def _with_client(urls: list[str], body: Body, timeout: float | None) -> None:
    from nats.errors import ConnectionClosedError, NoServersError
    from nats.errors import Error as NatsError

    from jetloop.schemas.errors import ControlError, JetloopError
    from jetloop.services.cli.inspector import Missing
    from jetloop.services.client import Client

    # The URLs carry the NATS password (jetloop.services.settings): shown without it.
    where = ", ".join(re.sub(r"//[^/@]*@", "//", u) for u in urls)
    lost = asyncio.Event()

    async def on_closed() -> None:
        lost.set()

    patience = min(PATIENCE, timeout) if timeout else PATIENCE
    try:
        jl = await asyncio.wait_for(
            Client.connect(urls, give_up_after=patience, on_closed=on_closed),
            min(FIRST_CONNECT, patience),
        )
    except (NoServersError, TimeoutError, OSError):
        raise click.ClickException(
            f"cannot reach NATS at {where} (is 'jetloop up' running?)"
        ) from None
    except NatsError as exc:
        raise click.ClickException(f"NATS at {where} refused the connection: {exc}") from None
    except JetloopError as exc:  # a credential of another namespace than the one named
        raise click.ClickException(str(exc)) from None
    async with jl:
        work = asyncio.create_task(body(jl))
        gone = asyncio.create_task(lost.wait())
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # the connection is gone (or we were interrupted)
            await asyncio.wait((work,))
        try:
            work.result()
        except (asyncio.CancelledError, ConnectionClosedError):
            raise click.ClickException(
                f"lost the connection to NATS at {where} (is 'jetloop up' running?)"
            ) from None
        except ControlError as exc:
            raise click.ClickException(str(exc)) from None
        except (Missing, JetloopError, ValueError) as exc:
            # No such session or turn, a record not trusted, no seal key to verify with, a
            # name that cannot be one: the message says it.
            raise click.ClickException(str(exc)) from None
        except (NatsError, TimeoutError) as exc:
            raise click.ClickException(f"NATS at {where}: {_nats_error(exc)}") from None


def _nats_error(exc: BaseException) -> str:
    """A NATS error in a few words, with what to do where that is known."""
    from nats.errors import NoRespondersError
    from nats.js.errors import NotFoundError, ServiceUnavailableError

    if isinstance(exc, NotFoundError):
        return (
            f"{exc.description or 'not found'} (is the topology applied? "
            "`jetloop up` or `jetloop topology` applies it)"
        )
    if isinstance(exc, NoRespondersError | ServiceUnavailableError):
        return "JetStream did not answer (is JetStream enabled on that server?)"
    if isinstance(exc, TimeoutError):
        return "no answer in time (the server is busy or electing a leader: try again)"
    return str(exc) or type(exc).__name__


def _echo_model(model: Any) -> None:
    click.echo(json.dumps(model.model_dump(mode="json", exclude_none=True), indent=2))


# How a command read state without the seal key (a tenant's CLI, with only its client
# credential): the records' seals were checked by the workers, or not at all.
VERIFIED_BY_WORKERS = "verified by the workers (no seal key here: asked jl.control.snapshot)"
UNVERIFIED = (
    "NOT VERIFIED: read directly, without the seal key (JETLOOP_SEAL_KEY) to check the "
    "records' seals"
)


def _unverified_reads(jl: Client) -> str | None:
    """For a read only the seal key can verify (the workers serve none but the snapshot):
    None with the key; without it, the client reads unverified from here on, and the note
    that says so is returned, for the command to show (``_note``). Reading unverified
    chosen (``JETLOOP_READ_UNVERIFIED``) is said too."""
    if jl.sealer is not None and jl.verify:
        return None
    jl.verify = False
    return UNVERIFIED


def _note(how: str | None, to_stderr: bool) -> None:
    """Say how state was read (``VERIFIED_BY_WORKERS``, ``UNVERIFIED``); nothing when the
    seal key verified it. ``to_stderr``: beside JSON or an answer a program reads, which
    stay as they were."""
    if how is not None:
        click.echo(f"[{how}]", err=to_stderr)


def _describe(ev: Any) -> str:
    from jetloop.schemas import EventType

    d = ev.data
    match ev.type:
        case EventType.TURN_ACCEPTED:
            return "· accepted" + (" (queued behind the running turn)" if d.get("queued") else "")
        case EventType.TURN_STARTED:
            return "· started"
        case EventType.MODEL_ANSWERED:
            calls = ", ".join(f"{c['tool']}({json.dumps(c['args'])})" for c in d.get("calls", []))
            said = f"{d['text']} " if d.get("text") else ""
            return f"· model step {d.get('model_step')}: {said}→ {calls}"
        case EventType.MODEL_USAGE:
            cost = d.get("cost_usd")
            priced = f", ${cost:.6f}" if cost is not None else ""
            return (
                f"· model call (step {d.get('model_step')}, attempt {d.get('attempt')}): "
                f"{d.get('input_tokens')} tokens in, {d.get('output_tokens')} out{priced}"
            )
        case EventType.CALL_OUTCOME:
            err = f": {d['error']}" if d.get("error") else ""
            return f"· {d.get('tool')} {d.get('state')}{err}"
        case EventType.TURN_COMPLETED:
            if d.get("text"):
                return "· completed: " + "\n  ".join(str(d["text"]).splitlines())
            if d.get("text_ref"):
                return (
                    f"· completed (the answer is in the blob store: {invoked_as()} turn "
                    f"{ev.session_id} {ev.turn_id})"
                )
            return "· completed"
        case EventType.TURN_FAILED:
            return f"· failed: {d.get('error')}"
        case EventType.CRASH_RESUMED:
            return f"· resumed after a lost attempt ({d.get('step')})"
        case EventType.APPROVAL_REQUESTED:
            return (
                f"· {d.get('tool')} waits for approval: "
                f"{invoked_as()} approve {ev.session_id} {d.get('approval_id')}"
            )
        case EventType.APPROVAL_DECIDED:
            return f"· approval {d.get('status')} by {d.get('by')}"
        case EventType.APPROVAL_POLICY_CHANGED:
            word = {True: "required", False: "waived", None: "reset"}[d.get("required")]
            return f"· approval of {d.get('tool')} {word} by {d.get('by')}"
        case EventType.QUESTION_ASKED:
            return (
                f"· question: {d.get('question')} — "
                f"{invoked_as()} answer {ev.session_id} {d.get('question_id')} '…'"
            )
        case EventType.QUESTION_ANSWERED:
            return f"· answered by {d.get('by')}: {d.get('answer')}"
        case EventType.TIMER_SET:
            return f"· timer set for {d.get('at')}"
        case EventType.TIMER_FIRED:
            return "· timer fired"
        case EventType.TASK_STARTED:
            return f"· task started: {d.get('handle')}"
        case EventType.TURN_CANCELLED:
            return f"· cancelled by {d.get('by')}"
    return f"· {ev.type}"
