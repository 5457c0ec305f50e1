"""Commands that decide for the agent: ``approve`` (or reject), ``answer``, ``cancel``,
``reconcile``."""

from __future__ import annotations

import json
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
