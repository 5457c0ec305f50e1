"""Commands that decide for the agent: ``approve`` (or reject), ``answer``, ``cancel``,
``reconcile``, ``policy`` (a tool's approval override in a session, and who set it)."""

from __future__ import annotations

import getpass
import json
import time
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    pass

from jetloop.services.cli.main import _client_cmd, main, namespace_option


@main.command()
@click.argument("session_id")
@click.argument("approval_id")
@click.option("--reject", is_flag=True, help="reject instead of approve")
@click.option("--reason")
@click.option("--by", default="cli", show_default=True)
@click.option("--nats", "nats_url")
@namespace_option
def approve(
    session_id: str,
    approval_id: str,
    reject: bool,
    reason: str | None,
    by: str,
    nats_url: str | None,
) -> None:
    """Approve (or --reject) a call held for approval."""

    async def body(jl: Any) -> None:
        fn = jl.reject if reject else jl.approve
        ap = await fn(session_id, approval_id, by=by, reason=reason)
        click.echo(f"{ap.approval_id}: {ap.status.value} by {ap.decided_by}")

    _client_cmd(nats_url, body)


@main.command()
@click.argument("session_id")
@click.argument("question_id")
@click.argument("text")
@click.option("--by", default="cli", show_default=True)
@click.option("--nats", "nats_url")
@namespace_option
def answer(session_id: str, question_id: str, text: str, by: str, nats_url: str | None) -> None:
    """Answer a question the model asked."""

    async def body(jl: Any) -> None:
        q = await jl.answer(session_id, question_id, text, by=by)
        click.echo(f"{q.question_id}: answered {q.answer!r} by {q.answered_by}")

    _client_cmd(nats_url, body)


@main.command()
@click.argument("session_id")
@click.option("--turn", "turn_id", help="a turn id (default: the running turn)")
@click.option("--by", default="cli", show_default=True)
@click.option("--nats", "nats_url")
@namespace_option
def cancel(session_id: str, turn_id: str | None, by: str, nats_url: str | None) -> None:
    """Cancel a session's running turn."""

    async def body(jl: Any) -> None:
        t = await jl.cancel(session_id, turn_id, by=by)
        click.echo(f"turn {t.turn_id}: {t.status.value}")

    _client_cmd(nats_url, body)


@main.command()
@click.argument("call_key")
@click.option("--succeeded/--failed", required=True)
@click.option("--result", help="JSON result (with --succeeded)")
@click.option("--error", help="error text (with --failed)")
@click.option("--by", default="cli", show_default=True)
@click.option("--nats", "nats_url")
@namespace_option
def reconcile(
    call_key: str,
    succeeded: bool,
    result: str | None,
    error: str | None,
    by: str,
    nats_url: str | None,
) -> None:
    """Settle an outcome_unknown call as succeeded or failed."""
    try:
        value = json.loads(result) if result else None
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--result") from None

    async def body(jl: Any) -> None:
        rec = await jl.reconcile(call_key, succeeded, by=by, result=value, error=error)
        click.echo(f"{rec.key}: {rec.state.value} (reconciled by {rec.reconciled_by})")

    _client_cmd(nats_url, body)


@main.command()
@click.argument("session_id")
@click.argument("tool", required=False)
@click.option("--require", "required", flag_value="require", help="the tool needs approval")
@click.option("--waive", "required", flag_value="waive", help="the tool runs without approval")
@click.option("--reset", "required", flag_value="reset", help="the tool's own policy again")
@click.option("--agent", help="create the session for this agent if it does not exist yet")
@click.option("--by", default=getpass.getuser, show_default="your user name")
@click.option("--nats", "nats_url")
@namespace_option
def policy(
    session_id: str,
    tool: str | None,
    required: str | None,
    agent: str | None,
    by: str,
    nats_url: str | None,
) -> None:
    """Show a session's approval overrides and who set them, or change TOOL's (--require,
    --waive, --reset). Changing one needs the workers' role: run it beside the store of
    jetloop up (a client credential is refused)."""
    if (tool is None) != (required is None):
        raise click.UsageError("give TOOL with one of --require, --waive, --reset (or neither)")

    async def body(jl: Any) -> None:
        if tool is not None:
            value = {"require": True, "waive": False, "reset": None}[required or "reset"]
            await jl.set_approval(session_id, tool, value, agent=agent, by=by)
        snap = await jl.snapshot(session_id, history_limit=0)
        if snap is None:
            raise click.ClickException(f"no session {session_id}")
        shown = sorted(set(snap.approval_overrides) | set(snap.approval_changes))
        if not shown:
            click.echo(f"{session_id}: no approval overrides (each tool's own policy)")
        for name in shown:
            click.echo(f"{name}: {_word(snap.approval_overrides.get(name))}{_who(snap, name)}")

    _client_cmd(nats_url, body)


def _word(required: bool | None) -> str:
    return {True: "requires approval", False: "approval waived", None: "its own policy"}[required]


def _who(snap: Any, tool: str) -> str:
    change = snap.approval_changes.get(tool)
    if change is None:
        return ""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(change.at))
    return f" (set by {change.by} at {when}, was {_word(change.previous)})"
