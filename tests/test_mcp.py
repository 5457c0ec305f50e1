"""MCP servers' tools as durable steps (jetloop.agents.mcp), against the repository's example
ledger server (examples/mcp_ledger/server.py) built with the MCP SDK: run by the worker over
stdio, or by the test over streamable HTTP. The server logs every invocation with the
idempotency key the call carried in ``_meta``: what a test counts.

The crash matrix's cells for MCP tools (worker kill, server restart, takeover) are rows of
tests/test_matrix.py; a crash test of an MCP agent is in tests/test_crashtest.py.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jetloop.agents import Effect
from jetloop.agents.mcp import META_IDEMPOTENCY_KEY, MCPServer
from jetloop.services.client import Client
from tests.apps_mcp import SERVER
from tests.conftest import WorkerFactory, body, call, script, until
from tests.mcp_ledger import Ledger, invocations, keys_of

APP = "tests.apps_mcp:app"
AGENTS = {"stdio": "tester", "http": "tester_http"}  # tests/apps_mcp.py


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(tmp_path / "mcp-log.jsonl", tmp_path / "mcp-state.json")
    try:
        yield led
    finally:
        led.stop()


class _Ctx:
    """What a tool is handed, for a call made outside a worker."""

    def __init__(self, key: str) -> None:
        self.idempotency_key = key
        self.call_id = f"{key}-call"
        self.attempt = 1
        self.namespace = "default"


async def test_effects_come_from_annotations_and_the_key_travels(ledger: Ledger) -> None:
    """read-only → READ, idempotent → IDEMPOTENT_WRITE, the rest (destructive, or no
    annotations) a single-attempt write; `effects=` overrides; `include` and `prefix` shape
    what the model is offered; the schema is the server's; the key is in `_meta`."""
    server = MCPServer.stdio(
        "ledger", sys.executable, [str(SERVER)], env={"PATH": os.environ["PATH"], **ledger.env()}
    )
    try:
        tools = {t.name: t for t in await server.list_tools()}
        assert {n: t.effect for n, t in tools.items()} == {
            "balance": Effect.READ,
            "set_limit": Effect.IDEMPOTENT_WRITE,
            "transfer": Effect.NON_IDEMPOTENT_WRITE,
            "close_account": Effect.NON_IDEMPOTENT_WRITE,
        }
        assert tools["balance"].effect_from == "MCP server ledger: readOnlyHint"
        assert tools["close_account"].effect_from == "MCP server ledger: no annotations"
        schema = tools["transfer"].json_schema()
        assert schema["required"] == ["account", "amount"]
        assert schema["properties"]["amount"]["type"] == "integer"
        # The server's schema checks the arguments before anything is sent.
        with pytest.raises(ValueError, match="amount"):
            tools["transfer"].args_model.model_validate({"account": "a", "amount": "lots"})

        args = tools["transfer"].args_model.model_validate({"account": "a", "amount": 5})
        assert await tools["transfer"].fn(args, _Ctx("k-1")) == "moved 5 out of a"
        assert invocations(ledger.log)[-1]["key"] == "k-1"
        assert META_IDEMPOTENCY_KEY == "dev.jetloop/idempotency-key"
    finally:
        await server.close()

    overridden = MCPServer.stdio(
        "ledger",
        sys.executable,
        [str(SERVER)],
        env={"PATH": os.environ["PATH"], **ledger.env()},
        effects={"transfer": Effect.IDEMPOTENT_WRITE},
        include=["transfer", "balance"],
        prefix="bank_",
    )
    try:
        tools = {t.name: t for t in await overridden.list_tools()}
        assert sorted(tools) == ["bank_balance", "bank_transfer"]
        assert tools["bank_transfer"].effect is Effect.IDEMPOTENT_WRITE
        assert tools["bank_transfer"].effect_from == "MCP server ledger: set in code"
    finally:
        await overridden.close()

    with pytest.raises(ValueError, match="exactly one"):
        MCPServer("both", command="x", url="http://127.0.0.1:1/mcp")


CALLS = {
    "balance": {"account": "acct-1"},
    "set_limit": {"account": "acct-1", "limit": 10_000},
    "transfer": {"account": "acct-1", "amount": 500},
}


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_mcp_tools_are_durable_steps(
    transport: str, ledger: Ledger, workers: WorkerFactory, client: Client
) -> None:
    """A turn that calls the three tools: each one tool step, made once with its key, its
    effect (from the annotations) in the snapshot; over HTTP the headers go with every
    request. A tool that asks for approval waits for it like any other."""
    agent = AGENTS[transport]
    if transport == "http":
        ledger.start_http()
    workers.start(app=APP, env=ledger.env())
    text = script([call(tool, **args) for tool, args in CALLS.items()])
    res = await client.wait(await client.send(agent, "s1", text), timeout=60)
    seen = body(res.text)["seen"]
    assert [s["status"] for s in seen] == ["ok", "ok", "ok"], seen
    assert seen[2]["result"] == "moved 500 out of acct-1"
    snap = await client.snapshot("s1")
    calls = {c.tool: c for c in snap.calls}
    assert {t: c.effect for t, c in calls.items()} == {
        "balance": "read",
        "set_limit": "idempotent_write",
        "transfer": "non_idempotent_write",
    }
    for tool in CALLS:
        assert keys_of(ledger.log, tool) == [calls[tool].idempotency_key]
    if transport == "http":
        assert {i["authorization"] for i in invocations(ledger.log)} == {"Bearer test"}

    # close_account asks for approval (set in tests/apps_mcp.py): not made until approved.
    h = await client.send(agent, "s2", script([call("close_account", account="acct-9")]))
    snap = await until(lambda: _with_approval(client, "s2"))
    assert keys_of(ledger.log, "close_account") == []
    await client.approve("s2", snap.approvals[0].approval_id, by="test")
    res = await client.wait(h, timeout=60)
    assert body(res.text)["seen"][0]["status"] == "ok"
    assert len(keys_of(ledger.log, "close_account")) == 1


async def _with_approval(client: Client, session: str) -> Any:
    snap = await client.snapshot(session)  # None until the turn is accepted
    return snap if snap is not None and snap.approvals else None


async def test_a_tool_the_server_no_longer_lists_is_not_made(
    ledger: Ledger, workers: WorkerFactory, client: Client
) -> None:
    """The server is released again without `close_account` while a call of it waits for
    approval: once approved, the call is not made and fails as a tool a deploy removed; the
    model sees why, and the next model step is offered the tools as they are now."""
    ledger.start_http()
    workers.start(app=APP, env=ledger.env())
    h = await client.send(
        "tester_http",
        "s1",
        script([call("close_account", account="acct-9")], [call("balance", account="acct-9")]),
    )
    snap = await until(lambda: _with_approval(client, "s1"))
    ledger.stop()
    ledger.start_http(MCP_LEDGER_TOOLS="balance,set_limit,transfer")
    await client.approve("s1", snap.approvals[0].approval_id, by="test")
    res = await client.wait(h, timeout=60)
    seen = body(res.text)["seen"]
    assert seen[0]["status"] == "error", seen[0]
    assert "no longer offers the tool 'close_account'" in seen[0]["error"], seen[0]
    assert "approved by test" in seen[0]["error"]
    assert seen[1]["status"] == "ok"
    assert keys_of(ledger.log, "close_account") == []


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_the_mcp_server_killed_mid_call(
    transport: str, ledger: Ledger, workers: WorkerFactory, client: Client
) -> None:
    """The server is SIGKILLed while a call of each tool runs in it (over stdio the worker's
    child; over HTTP the test's process, started again at once): each call is settled by its
    effect — the read and the idempotent write made again (the same key), the single-attempt
    write recorded `outcome_unknown` and never sent again — and the next call is made on a new
    server process, without user code."""
    if transport == "http":
        ledger.start_http(MCP_LEDGER_DELAY="2")
    workers.start(app=APP, env=ledger.env(MCP_LEDGER_DELAY="2"))
    agent = AGENTS[transport]
    handles = {
        tool: await client.send(agent, f"s-{tool}", script([call(tool, **args)]))
        for tool, args in CALLS.items()
    }

    async def all_running() -> set[int] | None:
        inv = invocations(ledger.log)
        return {i["pid"] for i in inv} if len(inv) == len(CALLS) else None

    pids = await until(all_running, timeout=60)
    assert len(pids) == 1
    (pid,) = pids
    os.kill(pid, signal.SIGKILL)
    if transport == "http":
        ledger.stop()
        ledger.start_http(MCP_LEDGER_DELAY="2")
    results = {tool: await client.wait(h, timeout=90) for tool, h in handles.items()}
    seen = {t: body(r.text)["seen"][0] for t, r in results.items()}
    status = {t: s["status"] for t, s in seen.items()}
    assert status == {"balance": "ok", "set_limit": "ok", "transfer": "outcome_unknown"}, seen
    for tool in ("balance", "set_limit"):
        keys = keys_of(ledger.log, tool)
        assert len(keys) == 2 and len(set(keys)) == 1, (tool, keys)
    assert len(keys_of(ledger.log, "transfer")) == 1, "a single-attempt write is never repeated"
    rec = await client.call("s-transfer", handles["transfer"].turn_id, 0, 0)
    assert rec is not None and rec.state == "outcome_unknown" and rec.attempts == 1

    res = await client.wait(
        await client.send(agent, "s-next", script([call("balance", account="acct-1")])),
        timeout=60,
    )
    assert body(res.text)["seen"][0]["status"] == "ok"
    assert invocations(ledger.log)[-1]["pid"] != pid


async def test_a_single_attempt_write_is_not_sent_on_a_dead_connection(ledger: Ledger) -> None:
    """The stdio server died between two calls: the single-attempt write finds the dead
    connection before anything is sent (a ping), connects again and is made once, on the new
    server process (before: sent on the dead connection, it failed at once, "no answer to the
    call (Connection closed)", and was settled outcome_unknown though it never left)."""
    server = MCPServer.stdio(
        "ledger", sys.executable, [str(SERVER)], env={"PATH": os.environ["PATH"], **ledger.env()}
    )
    try:
        tools = {t.name: t for t in await server.list_tools()}
        transfer = tools["transfer"]
        assert transfer.effect is Effect.NON_IDEMPOTENT_WRITE
        args = transfer.args_model.model_validate({"account": "a", "amount": 5})
        assert await transfer.fn(args, _Ctx("k-1")) == "moved 5 out of a"
        (first,) = {i["pid"] for i in invocations(ledger.log)}
        os.kill(first, signal.SIGKILL)

        async def gone() -> bool:
            return b"Z" in _state(first)

        await until(gone, timeout=10)
        assert await transfer.fn(args, _Ctx("k-2")) == "moved 5 out of a"
        made = invocations(ledger.log)
        assert [i["key"] for i in made] == ["k-1", "k-2"]
        assert made[-1]["pid"] != first
    finally:
        await server.close()


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1][:3]
    except FileNotFoundError:
        return b" Z "


async def test_tools_no_provider_accepts_are_left_out() -> None:
    """A server (here a stub of one: names are the server's to choose) that lists a tool
    under a name no model provider accepts, or two tools under one name: those are left out,
    the others offered; the list is read page by page."""
    from mcp_types import ListToolsResult
    from mcp_types import Tool as McpTool

    def tool(name: str) -> McpTool:
        return McpTool(name=name, input_schema={"type": "object"})

    pages = {
        None: ListToolsResult(tools=[tool("fine"), tool("has space")], next_cursor="2"),
        "2": ListToolsResult(tools=[tool("x" * 65), tool("fine"), tool("a.b"), tool("ok-2")]),
    }

    class Listing:
        async def list_tools(self, cursor: str | None = None) -> ListToolsResult:
            return pages[cursor]

    server = MCPServer("stub", url="http://127.0.0.1:1/mcp")
    listed = await server.list_tools_with(Listing())  # type: ignore[arg-type]
    assert [t.name for t in listed] == ["fine", "ok-2"]
    assert all(t.effect is Effect.NON_IDEMPOTENT_WRITE for t in listed)
