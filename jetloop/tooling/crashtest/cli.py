"""``jetloop trials --app``: the crash test of a user's agent, from the command line."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path

import click

from jetloop.services.logs import configure
from jetloop.tooling.crashtest.judge import CrashReport, format_report
from jetloop.tooling.crashtest.run import MODES, crash_test, default_seed
from jetloop.tooling.crashtest.script import ScriptError, read_messages


def main(
    app: str,
    messages: Path,
    *,
    modes: Sequence[str],
    rounds: int,
    seed: int | None,
    model_script: Path | None,
    quick: bool,
    vendor_dedupes: Sequence[str],
    out_json: Path | None,
    pure: Sequence[str] = (),
    keep: Path | None,
    tool_worker: str | None = None,
) -> int:
    """Each mode in turn; prints each report; 0 when every verdict is pass."""
    wrong = [m for m in modes if m not in MODES]
    if wrong:
        raise click.UsageError(f"--app takes --mode {' or '.join(MODES)}, not {', '.join(wrong)}")
    try:
        msgs = read_messages(messages)
    except ScriptError as exc:
        raise click.UsageError(f"--messages: {exc}") from None
    command = shlex.split(tool_worker) if tool_worker else None
    if tool_worker is not None and not command:
        raise click.UsageError("--tool-worker: give the command that starts the worker")
    seed = default_seed() if seed is None else seed
    click.echo(f"JETLOOP_KILL_SEED={seed}")
    # Said before anything runs: this is no simulation.
    click.echo(
        f"The tools really run: every call of these {len(msgs)} message(s) is made, and made "
        f"again after each kill, by worker processes working in {os.getcwd()}: point them at "
        "test accounts and sandboxes, not production."
    )
    configure("console", "warning")
    reports: list[CrashReport] = []
    for i, mode in enumerate(modes):
        try:
            rep = asyncio.run(
                crash_test(
                    app,
                    msgs,
                    model_script=model_script,
                    mode=mode,
                    rounds=rounds,
                    seed=seed + i,
                    quick=quick,
                    vendor_dedupes=vendor_dedupes,
                    pure=pure,
                    work_dir=keep / mode if keep is not None else None,
                    tool_worker=command,
                )
            )
        except (ScriptError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(format_report(rep))
        reports.append(rep)
    if out_json is not None:
        body = [r.to_json() for r in reports]
        out_json.write_text(json.dumps(body[0] if len(body) == 1 else body, indent=2) + "\n")
    return 0 if all(r.ok for r in reports) else 1
