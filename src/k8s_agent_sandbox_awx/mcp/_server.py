"""The MCP server on the official SDK's low-level ``Server``.

:func:`build_server` announces the tools (``_tools``) and answers ``tools/call`` with
``_calls.call_tool`` (every failure a result with ``isError``); :class:`McpApp` is what its
sessions share. ``_stdio`` and ``_http`` serve it; ``_serve`` starts one of them.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Mapping
from typing import Any

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server

from .._version import __version__
from ..client.http._config import BrokerConnectionConfig
from . import _bounds as bounds
from ._calls import HANDLERS, Call, ToolResult, call_tool
from ._sessions import Sandboxes, Session, SessionEnded
from ._tools import TOOLS, ToolSpec

__all__ = ["INSTRUCTIONS", "SIGNALS", "McpApp", "build_server"]

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop the server (its sessions' default sandboxes deleted first)."""

INSTRUCTIONS = (
    "Sandboxes are isolated Linux machines on the team's Kubernetes cluster, created through "
    "the identity broker under this server's identity and policy. Every tool works in this "
    "session's default sandbox when you leave `sandbox` out: it is created on first use and "
    "deleted when the session ends, so files and processes in it persist between calls until "
    "then. Use run_command for shell commands, run_code for Python whose variables persist "
    "between calls (as in a notebook), write_file/read_file/list_files for files (paths "
    "relative to /app, or absolute under /app or /workspace), create_sandbox for more sandboxes "
    "(delete them with kill_sandbox). Long outputs are cut, with a note saying how to see more."
)


class McpApp:
    """What every session of one server shares: the broker connection settings, the
    sandbox handles and the output limit."""

    def __init__(
        self,
        config: BrokerConnectionConfig,
        max_output_chars: int = bounds.DEFAULT_MAX_OUTPUT_CHARS,
    ) -> None:
        self.config = config
        self.sandboxes = Sandboxes(config)
        self.max_output_chars = max_output_chars
        self.tools = [spec for spec in TOOLS if spec.name in HANDLERS]
        self._closing: asyncio.Future[None] | None = None

    async def call(
        self, session: Session, name: str, arguments: Mapping[str, Any] | None
    ) -> ToolResult:
        return await call_tool(
            Call(self.sandboxes, session, self.max_output_chars), name, arguments
        )

    async def close(self, sessions: Callable[[], Any]) -> None:
        """End every session (``sessions()``: a coroutine that does) and stop using the
        handles; once, however many callers (the end of input, a signal) ask."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(sessions))
        await asyncio.shield(self._closing)

    async def _close(self, sessions: Callable[[], Any]) -> None:
        try:
            await sessions()
        finally:
            await self.sandboxes.close()


def build_server(app: McpApp, session_of: Callable[[ServerRequestContext[Any]], Session]) -> Server:
    """The low-level server: ``tools/list`` and ``tools/call``; ``session_of(ctx)`` is the
    session a request belongs to."""

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[_tool(spec) for spec in app.tools])

    async def on_call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        try:
            session = session_of(ctx)
        except SessionEnded as exc:
            return _result(ToolResult.error(f"{params.name}: {exc}."))
        return _result(await app.call(session, params.name, params.arguments))

    return Server(
        "agent-sandbox-awx",
        version=__version__,
        title="Kubernetes agent sandboxes",
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=on_call_tool,
    )


def _tool(spec: ToolSpec) -> types.Tool:
    return types.Tool(
        name=spec.name,
        title=spec.title,
        description=spec.description,
        input_schema=spec.input_schema(),
        annotations=types.ToolAnnotations(
            title=spec.title,
            read_only_hint=spec.read_only,
            destructive_hint=spec.destructive,
            idempotent_hint=spec.idempotent,
            open_world_hint=False,
        ),
    )


def _result(result: ToolResult) -> types.CallToolResult:
    content: list[types.ContentBlock] = [types.TextContent(text=text) for text in result.text]
    content += [types.ImageContent(data=data, mime_type=mime) for data, mime in result.images]
    return types.CallToolResult(
        content=content, structured_content=result.structured, is_error=result.is_error
    )
