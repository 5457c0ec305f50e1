"""MCP servers' tools as jetloop tools: every call one durable tool step.

An agent lists MCP servers (``MCPServer.stdio(...)``: a command the worker runs, talking over
its stdin and stdout; ``MCPServer.http(...)``: a streamable HTTP endpoint). A worker connects
to each when it first needs it and keeps the connection; a connection that broke (the server
died or restarted, the network) is made again on the next use, without user code.

- **Which tools**: a server's tools are listed at every model step (so the model is offered
  the tools as they are now) and again before every call, so a server that added, removed or
  changed tools between two turns or in the middle of one (whether it says so with
  ``notifications/tools/list_changed`` or not) is seen at once: a call of a tool the server
  no longer lists is not made and fails with the reason the model sees, as a tool a deploy
  removed; one whose arguments no longer fit the new schema, the same.
- **Effects from annotations**: ``readOnlyHint`` → ``READ``; ``idempotentHint`` (not
  read-only) → ``IDEMPOTENT_WRITE``; anything else — no annotations, or a tool that is not
  idempotent — is a single-attempt write (MCP's own defaults say such a tool may be
  destructive). ``effects={"tool": Effect...}`` overrides per tool. The effect a call was
  planned with is written ahead with it and never read again from the server.
- **The idempotency key travels**: every call sends the step's key in the request's ``_meta``
  under ``dev.jetloop/idempotency-key`` (with ``dev.jetloop/call-id``,
  ``dev.jetloop/attempt`` and ``dev.jetloop/namespace``), the same key on every attempt, for a
  server that dedupes.
- **Failures**: a call that could not be sent (no connection) is tried again whatever its
  effect; one that was sent and whose answer never came (the server died, the connection
  broke, the timeout) is in doubt and settled by its effect (made again, made again with the
  same key, or ``outcome_unknown``); an answer with ``isError``, or an error the server
  answered, is a failed call the model sees. The listing before a call also finds a
  connection that died since the last call (the server restarted): it is made again before
  anything is sent rather than after, so a single-attempt write is not put in doubt by it.

The MCP Python SDK (``pip install 'jetloop[mcp]'``) is imported only when a worker connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import BaseModel

from jetloop.agents.jsonargs import json_args_model
from jetloop.agents.tools import ApprovalPolicy, Effect, Tool, ToolContext
from jetloop.schemas.errors import RetryableToolError, ToolError

if TYPE_CHECKING:
    from mcp import Client

log = structlog.get_logger("jetloop.mcp")

# The names under which a call's identity travels in the request's ``_meta`` (the protocol
# reserves unprefixed and ``modelcontextprotocol``/``mcp`` names; these are jetloop's).
META_IDEMPOTENCY_KEY = "dev.jetloop/idempotency-key"
META_CALL_ID = "dev.jetloop/call-id"
META_ATTEMPT = "dev.jetloop/attempt"
META_NAMESPACE = "dev.jetloop/namespace"

# The tool names every model provider accepts (OpenAI's and Anthropic's rule).
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# How many pages of a tool list are read before the rest is ignored (a server that pages
# forever must not stall a model step).
MAX_LIST_PAGES = 50
# How long a ping before a single-attempt call may take: past it the connection is made again
# (a live server answers a ping in milliseconds).
PING_SECONDS = 5.0


class MCPUnreachable(Exception):
    """The MCP server could not be connected to or listed (nothing was sent to a tool)."""


def effect_of(annotations: Any) -> tuple[Effect, str]:
    """The effect class the server's tool annotations give, and which hint decided it."""
    read_only = getattr(annotations, "read_only_hint", None) if annotations else None
    idempotent = getattr(annotations, "idempotent_hint", None) if annotations else None
    if read_only is True:
        return Effect.READ, "readOnlyHint"
    if idempotent is True:
        return Effect.IDEMPOTENT_WRITE, "idempotentHint"
    if annotations is None or (read_only is None and idempotent is None):
        return Effect.NON_IDEMPOTENT_WRITE, "no annotations"
    return Effect.NON_IDEMPOTENT_WRITE, "not idempotent"


class MCPServer:
    """An MCP server whose tools an agent offers (``Agent(mcp_servers=(...))``).

    Make one with ``MCPServer.stdio(name, command, args)`` or ``MCPServer.http(name, url,
    headers=...)``. Options: ``effects`` (tool → ``Effect``, over the annotations),
    ``approval`` (``True``/``False``/a predicate for every tool, or a mapping tool → policy),
    ``prefix`` (prepended to every tool's name the model sees, for two servers with tools of
    one name), ``include`` (only these tools), ``max_attempts``, ``timeout_seconds`` (a call's
    answer; past it the call is in doubt), ``connect_timeout_seconds``.
    """

    def __init__(
        self,
        name: str,
        *,
        command: str | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        url: str | None = None,
        headers: Mapping[str, str] | None = None,
        effects: Mapping[str, Effect] | None = None,
        approval: ApprovalPolicy | Mapping[str, ApprovalPolicy] = False,
        prefix: str = "",
        include: Sequence[str] | None = None,
        max_attempts: int = 3,
        timeout_seconds: float = 120.0,
        connect_timeout_seconds: float = 15.0,
    ) -> None:
        if (command is None) == (url is None):
            raise ValueError(
                f"MCP server {name!r}: give a command (stdio) or a url (streamable HTTP), "
                "exactly one of them"
            )
        if max_attempts < 1:
            raise ValueError(f"MCP server {name!r}: max_attempts must be at least 1")
        self.name = name
        self.command = command
        self.args = tuple(args)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.url = url
        self.headers = dict(headers or {})
        self.effects = {k: Effect(v) for k, v in (effects or {}).items()}
        self.approval = approval
        self.prefix = prefix
        self.include = frozenset(include) if include is not None else None
        self.max_attempts = max_attempts
        self.timeout_seconds = timeout_seconds
        self.connect_timeout_seconds = connect_timeout_seconds
        # What a crash test wraps every listed tool in (jetloop.tooling.crashtest.ledger).
        self.wrap: Callable[[Tool], Tool] | None = None
        self._listed: dict[str, Tool] = {}
        # Each listed tool as last made, with what it was made from (``_tool_of``).
        self._made: dict[str, tuple[Any, Tool]] = {}
        self._conn: _Connection | None = None
        self._locks: dict[int, asyncio.Lock] = {}

    @classmethod
    def stdio(
        cls,
        name: str,
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        **options: Any,
    ) -> MCPServer:
        """A server the worker runs as a subprocess and talks to over stdio. Its environment
        is the MCP SDK's safe default (PATH, HOME and a few more) with ``env`` over it, never
        the worker's own (its seal key and credentials stay in the worker)."""
        return cls(name, command=command, args=args, env=env, cwd=cwd, **options)

    @classmethod
    def http(
        cls, name: str, url: str, *, headers: Mapping[str, str] | None = None, **options: Any
    ) -> MCPServer:
        """A server at a streamable HTTP endpoint; ``headers`` go with every request."""
        return cls(name, url=url, headers=headers, **options)

    def watched(self, wrap: Callable[[Tool], Tool]) -> MCPServer:
        """A copy of this server (its own connection) whose every listed tool is ``wrap``-ped."""
        copy = MCPServer(
            self.name,
            command=self.command,
            args=self.args,
            env=self.env,
            cwd=self.cwd,
            url=self.url,
            headers=self.headers,
            effects=self.effects,
            approval=self.approval,
            prefix=self.prefix,
            include=sorted(self.include) if self.include is not None else None,
            max_attempts=self.max_attempts,
            timeout_seconds=self.timeout_seconds,
            connect_timeout_seconds=self.connect_timeout_seconds,
        )
        copy.wrap = wrap
        return copy

    def __repr__(self) -> str:
        where = self.url if self.url is not None else " ".join((self.command or "", *self.args))
        return f"MCPServer({self.name!r}, {where!r})"

    # -- the tools -----------------------------------------------------------------------

    def known(self, name: str) -> Tool | None:
        """The tool of this name in the last list this worker read (None: not listed)."""
        return self._listed.get(name)

    async def list_tools(self) -> list[Tool]:
        """The server's tools now, as jetloop tools; the last list read if the server cannot
        be listed now (MCPUnreachable if it never was)."""
        try:
            return await self.list_tools_with(await self._client())
        except Exception as exc:
            await self._drop()
            if self._listed:
                log.warning("mcp.list_failed", server=self.name, error=repr(exc), kept="last list")
                return list(self._listed.values())
            raise MCPUnreachable(f"MCP server {self.name!r} could not be listed: {exc!r}") from exc

    async def list_tools_with(self, client: Client) -> list[Tool]:
        listed: list[Any] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await asyncio.wait_for(
                client.list_tools(cursor=cursor), self.connect_timeout_seconds
            )
            listed.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        tools: dict[str, Tool] = {}
        for t in listed:
            if self.include is not None and t.name not in self.include:
                continue
            name = f"{self.prefix}{t.name}"
            if not TOOL_NAME.fullmatch(name) or name in tools:
                # A name no model provider accepts (or a second tool of one name) would fail
                # every model step of the agent: the tool is left out, and said so.
                log.warning("mcp.tool_refused", server=self.name, tool=name[:100])
                continue
            made = self._tool_of(t)
            tools[made.name] = made
        if tools.keys() != self._listed.keys():
            log.info("mcp.tools", server=self.name, tools=sorted(tools))
        self._listed = tools
        return list(tools.values())

    def _tool_of(self, t: Any) -> Tool:
        """The jetloop tool of a listed MCP tool: the one made before when the server lists it
        unchanged (an argument model is costly to build, and listings come at every step)."""
        seen = (t.description, t.title, t.annotations, json.dumps(t.input_schema, sort_keys=True))
        known = self._made.get(t.name)
        if known is not None and known[0] == seen:
            return known[1]
        made = self._make(t)
        self._made[t.name] = (seen, made)
        return made

    def _make(self, t: Any) -> Tool:
        if t.name in self.effects:
            effect, why = self.effects[t.name], "set in code"
        else:
            effect, why = effect_of(t.annotations)
        if isinstance(self.approval, Mapping):
            approval: ApprovalPolicy = self.approval.get(t.name, False)
        else:
            approval = self.approval
        schema = dict(t.input_schema) if t.input_schema else {"type": "object"}
        name = f"{self.prefix}{t.name}"
        made = Tool(
            name=name,
            description=t.description or t.title or "",
            args_model=json_args_model(name, schema),
            fn=_caller(self, t.name, single_attempt=effect is Effect.NON_IDEMPOTENT_WRITE),
            effect=effect,
            max_attempts=self.max_attempts,
            approval=approval,
            schema=schema,
            effect_from=f"MCP server {self.name}: {why}",
        )
        return self.wrap(made) if self.wrap is not None else made

    # -- calls ---------------------------------------------------------------------------

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any],
        ctx: ToolContext,
        *,
        single_attempt: bool = False,
    ) -> Any:
        """Call ``tool`` with the call's identity in ``_meta``; the result as the model reads
        it (the text, else the structured content, else the content blocks).

        ``single_attempt``: the call may not be made twice (a ``NON_IDEMPOTENT_WRITE``): the
        connection is pinged first, and one found dead (a stdio server that exited, an HTTP
        server gone) is made again before the call is sent, so a call that never left is
        tried again (``RetryableToolError``), not settled ``outcome_unknown``."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        try:
            client = await self._client()
            if single_attempt:
                client = await self._live(client)
        except MCPUnreachable as exc:
            raise RetryableToolError(f"{exc}; the call was not sent", not_sent=True) from exc
        meta: Any = {
            META_IDEMPOTENCY_KEY: ctx.idempotency_key,
            META_CALL_ID: ctx.call_id,
            META_ATTEMPT: ctx.attempt,
            # Call ids are unique only within a namespace: a server that keeps records keys
            # them by it too.
            META_NAMESPACE: ctx.namespace,
        }
        try:
            result = await client.call_tool(
                tool, arguments, read_timeout_seconds=self.timeout_seconds, meta=meta
            )
        except MCPError as exc:
            if exc.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT):
                await self._drop()
                raise ConnectionError(
                    f"MCP server {self.name!r}: no answer to the call ({exc.message})"
                ) from exc
            # The server answered the request with an error: the tool was not run as asked.
            raise ToolError(f"MCP server {self.name!r} refused the call: {exc.message}") from exc
        except Exception as exc:
            await self._drop()
            raise ConnectionError(
                f"MCP server {self.name!r}: the connection broke during the call ({exc!r})"
            ) from exc
        return _result_of(self.name, tool, result)

    # -- the connection ------------------------------------------------------------------

    def _lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        lock = self._locks.get(id(loop))
        if lock is None:
            lock = self._locks[id(loop)] = asyncio.Lock()
        return lock

    async def _client(self) -> Client:
        conn = self._conn
        if conn is not None and conn.usable():
            return conn.client_now()
        async with self._lock():
            conn = self._conn
            if conn is not None and conn.usable():
                return conn.client_now()
            if conn is not None:
                await conn.close()
            conn = _Connection(self)
            try:
                await conn.open(self.connect_timeout_seconds)
            except Exception as exc:
                raise MCPUnreachable(
                    f"MCP server {self.name!r} could not be connected to: {exc!r}"
                ) from exc
            self._conn = conn
            log.info("mcp.connected", server=self.name)
            return conn.client_now()

    async def _live(self, client: Client) -> Client:
        """``client``, unless a ping finds its connection closed or broken: then a new
        connection's (``MCPUnreachable`` when none can be made). Nothing of the call is sent
        before this returns. Any answer, an error too (a server may not implement ``ping``),
        and no answer in time (a busy server) leave the connection as it is: only a dead
        one is made again, so a live server's calls in flight are never cut."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        try:
            await asyncio.wait_for(client.send_ping(), min(self.timeout_seconds, PING_SECONDS))
            return client
        except TimeoutError:
            return client
        except MCPError as exc:
            if exc.code != CONNECTION_CLOSED:
                return client  # it answered
            error = repr(exc)
        except Exception as exc:  # the transport broke
            error = repr(exc)
        log.info("mcp.reconnect_before_call", server=self.name, error=error)
        await self._drop()
        return await self._client()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def close(self) -> None:
        """Close this worker's connection (a stdio server's process ends with it)."""
        await self._drop()


def _caller(
    server: MCPServer, tool: str, *, single_attempt: bool = False
) -> Callable[[BaseModel, ToolContext], Any]:
    async def call(args: BaseModel, ctx: ToolContext) -> Any:
        return await server.call(tool, args.model_dump(), ctx, single_attempt=single_attempt)

    return call


def _result_of(server: str, tool: str, result: Any) -> Any:
    blocks = [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in result.content]
    text = "\n".join(b.get("text", "") for b in blocks if b.get("type") == "text")
    if result.is_error:
        raise ToolError(text or f"MCP server {server!r}: {tool} failed")
    if blocks and all(b.get("type") == "text" for b in blocks):
        return text
    if result.structured_content is not None:
        return result.structured_content
    return blocks


class _Connection:
    """One live MCP session, held open by a task of its own (the SDK's transports are
    context managers that must be left in the task that entered them)."""

    def __init__(self, server: MCPServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.client: Client | None = None
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def usable(self) -> bool:
        return (
            self.client is not None
            and self._task is not None
            and not self._task.done()
            and self.loop is asyncio.get_running_loop()
        )

    def client_now(self) -> Client:
        assert self.client is not None
        return self.client

    async def open(self, timeout: float) -> None:
        ready: asyncio.Future[None] = self.loop.create_future()
        self._task = asyncio.create_task(self._hold(ready), name=f"mcp:{self.server.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout)
        except BaseException:
            await self.close()
            raise

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        from mcp import Client

        try:
            async with Client(self._target(), cache=None) as client:
                self.client = client
                if not ready.done():
                    ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:  # the transport's end: the server died, or we left
            if not ready.done():
                ready.set_exception(ConnectionError(repr(exc)))
            elif not self._closing.is_set():
                log.warning("mcp.connection_lost", server=self.server.name, error=repr(exc))
            if not isinstance(exc, Exception) and not self._closing.is_set():
                raise
        finally:
            self.client = None

    def _target(self) -> Any:
        s = self.server
        if s.url is not None:
            if not s.headers:
                return s.url
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            return streamable_http_client(
                s.url, http_client=create_mcp_http_client(headers=s.headers)
            )
        from mcp.client.stdio import StdioServerParameters

        assert s.command is not None
        return StdioServerParameters(command=s.command, args=list(s.args), env=s.env, cwd=s.cwd)

    async def close(self) -> None:
        self._closing.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), 5.0)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        except BaseException:
            pass


__all__ = [
    "META_ATTEMPT",
    "META_CALL_ID",
    "META_IDEMPOTENCY_KEY",
    "META_NAMESPACE",
    "MCPServer",
    "MCPUnreachable",
    "effect_of",
]
