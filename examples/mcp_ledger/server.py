"""A small MCP server for the MCP example of docs/agents.md and the MCP tests: a bank ledger.

Tools of each kind MCP's annotations describe:

- ``balance(account)``            read-only (``readOnlyHint``)
- ``set_limit(account, limit)``   an idempotent write (``idempotentHint``): setting a value
- ``transfer(account, amount)``   a destructive write, not idempotent (no dedupe)
- ``close_account(account)``      destructive, and without annotations at all

Every invocation is appended, before the tool does anything, to the JSON-lines file named by
``MCP_LEDGER_LOG`` (one line: tool, arguments, the ``_meta`` idempotency key a jetloop worker
sends, and this process's id), so a test can count the invocations of each call, kills
included. ``MCP_LEDGER_DELAY`` (seconds) makes every tool wait after logging, so a test can
kill in the middle of a call; ``MCP_LEDGER_TOOLS`` (comma-separated) offers only those tools,
as a new release of a server might. The accounts live in the JSON file ``MCP_LEDGER_STATE``.

Run: ``python server.py`` (stdio) or ``python server.py --http PORT`` (streamable HTTP at
``http://127.0.0.1:PORT/mcp``).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

KEY = "dev.jetloop/idempotency-key"

server = MCPServer("ledger")


def _state_file() -> Path:
    return Path(os.environ.get("MCP_LEDGER_STATE", "ledger-state.json"))


def _load() -> dict[str, Any]:
    f = _state_file()
    return json.loads(f.read_text()) if f.exists() else {}


def _save(state: dict[str, Any]) -> None:
    f = _state_file()
    # A temporary file of this process's own: two servers on one state file (one over stdio,
    # one over HTTP) must not move each other's half-written file into place.
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(f)


@contextmanager
def _changing() -> Iterator[dict[str, Any]]:
    """The state, read, changed and saved under an exclusive lock of its file: a change by
    another process sharing it is not lost between the read and the save."""
    lock = _state_file().with_name(f"{_state_file().name}.lock")
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        state = _load()
        yield state
        _save(state)


def _append(line: dict[str, Any]) -> None:
    log = os.environ.get("MCP_LEDGER_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())


async def _invoked(tool: str, args: dict[str, Any], ctx: Context) -> None:
    """Log the invocation (durably, before it acts), then wait as asked."""
    meta = ctx.request_context.meta or {}
    headers = {k.lower(): v for k, v in (ctx.headers or {}).items()}
    line = {
        "tool": tool,
        "args": args,
        "key": meta.get(KEY),
        "pid": os.getpid(),
        "authorization": headers.get("authorization"),
    }
    _append(line)
    delay = float(os.environ.get("MCP_LEDGER_DELAY", "0") or 0)
    if delay:
        await asyncio.sleep(delay)


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def balance(account: str, ctx: Context) -> str:
    """The account's balance, in cents."""
    await _invoked("balance", {"account": account}, ctx)
    return str(_load().get(account, {}).get("balance", 0))


@server.tool(annotations=ToolAnnotations(idempotentHint=True, destructiveHint=False))
async def set_limit(account: str, limit: int, ctx: Context) -> str:
    """Set the account's daily transfer limit, in cents."""
    await _invoked("set_limit", {"account": account, "limit": limit}, ctx)
    with _changing() as state:
        state.setdefault(account, {})["limit"] = limit
    return f"the limit of {account} is {limit}"


@server.tool(annotations=ToolAnnotations(destructiveHint=True, idempotentHint=False))
async def transfer(account: str, amount: int, ctx: Context) -> str:
    """Move ``amount`` cents out of the account (not idempotent: twice moves it twice)."""
    await _invoked("transfer", {"account": account, "amount": amount}, ctx)
    with _changing() as state:
        acct = state.setdefault(account, {})
        acct["balance"] = acct.get("balance", 0) - amount
    return f"moved {amount} out of {account}"


@server.tool()
async def close_account(account: str, ctx: Context) -> str:
    """Close the account (destructive; this tool says nothing of its effects)."""
    await _invoked("close_account", {"account": account}, ctx)
    with _changing() as state:
        state.setdefault(account, {})["closed"] = True
    return f"closed {account}"


_offered = os.environ.get("MCP_LEDGER_TOOLS")
if _offered:
    for _name in ("balance", "set_limit", "transfer", "close_account"):
        if _name not in _offered.split(","):
            server.remove_tool(_name)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
