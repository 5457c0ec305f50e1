"""Agents whose tools come from an MCP server: the repository's example ledger server
(examples/mcp_ledger/server.py), run by the worker over stdio (agent ``tester``), or reached
over streamable HTTP at ``TEST_MCP_URL`` when that is set (agent ``tester_http``). The model
is the tests' scripted one (tests/apps.py).

The server's invocation log and state files are named by ``MCP_LEDGER_LOG`` and
``MCP_LEDGER_STATE`` in the worker's environment (handed on to a stdio server), and
``MCP_LEDGER_DELAY`` makes each tool take that long.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from jetloop.agents import Agent, App, Limits, MCPServer, ScriptedModel, ask_user
from tests.apps import script

SERVER = Path(__file__).resolve().parent.parent / "examples" / "mcp_ledger" / "server.py"
PASSED_ON = ("PATH", "MCP_LEDGER_LOG", "MCP_LEDGER_STATE", "MCP_LEDGER_DELAY", "MCP_LEDGER_TOOLS")


# Five attempts (backoff 0.5, 1, 2, 4 s): a server killed mid-call is started again (the test's
# HTTP process, or the worker's stdio child) in a Python that takes seconds to import its web
# stack on a busy machine; three attempts (1.5 s) were once all spent before its port opened.
OPTIONS: dict[str, Any] = {
    "approval": {"close_account": True},
    "timeout_seconds": 30.0,
    "max_attempts": 5,
}


def over_stdio() -> MCPServer:
    env = {k: os.environ[k] for k in PASSED_ON if k in os.environ}
    return MCPServer.stdio("ledger", sys.executable, [str(SERVER)], env=env, **OPTIONS)


def over_http(url: str) -> MCPServer:
    return MCPServer.http("ledger", url, headers={"Authorization": "Bearer test"}, **OPTIONS)


def _agent(name: str, server: MCPServer) -> Agent:
    return Agent(
        name=name,
        instructions="Follow the script.",
        model=ScriptedModel(script),
        tools=(ask_user,),
        limits=Limits(max_model_steps=8),
        mcp_servers=(server,),
    )


# `tester` reaches the server over stdio; `tester_http` over streamable HTTP, when the test
# runs one at TEST_MCP_URL.
_url = os.environ.get("TEST_MCP_URL")
app = App(
    [_agent("tester", over_stdio()), *([_agent("tester_http", over_http(_url))] if _url else [])]
)
