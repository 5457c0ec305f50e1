"""An agent whose tools come from an MCP server: the repository's example ledger server
(examples/mcp_ledger/server.py), run by the worker over stdio, or reached over streamable
HTTP at ``TEST_MCP_URL`` when that is set. The model is the tests' scripted one (tests/apps.py).

The server's invocation log and state files are named by ``MCP_LEDGER_LOG`` and
``MCP_LEDGER_STATE`` in the worker's environment (handed on to a stdio server), and
``MCP_LEDGER_DELAY`` makes each tool take that long.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from jetloop.agents import Agent, App, Limits, MCPServer, ScriptedModel, ask_user
from tests.apps import script

SERVER = Path(__file__).resolve().parent.parent / "examples" / "mcp_ledger" / "server.py"
PASSED_ON = ("PATH", "MCP_LEDGER_LOG", "MCP_LEDGER_STATE", "MCP_LEDGER_DELAY", "MCP_LEDGER_TOOLS")


def ledger() -> MCPServer:
    url = os.environ.get("TEST_MCP_URL")
    options = {"approval": {"close_account": True}, "timeout_seconds": 30.0}
    if url:
        return MCPServer.http("ledger", url, headers={"Authorization": "Bearer test"}, **options)
    env = {k: os.environ[k] for k in PASSED_ON if k in os.environ}
    return MCPServer.stdio("ledger", sys.executable, [str(SERVER)], env=env, **options)


def _agent() -> Agent:
    return Agent(
        name="tester",
        instructions="Follow the script.",
        model=ScriptedModel(script),
        tools=(ask_user,),
        limits=Limits(max_model_steps=8),
        mcp_servers=(ledger(),),
    )


app = App([_agent()])
