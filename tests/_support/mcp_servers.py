"""``agent-sandbox-awx mcp`` as agents run it, driven by the ``mcp`` package's own client.

- :func:`stdio_client_of`: the server launched over stdio by the SDK's ``stdio_client`` (as an
  agent launches it), in a :class:`Connected` (its stderr in a file: the start line names its
  pid, for the signal tests).
- :class:`HttpServer`: ``agent-sandbox-awx mcp --http 127.0.0.1:0`` as a process of its own; its
  URL and pid from its start line; :meth:`HttpServer.client` opens a session on it.

Both take the SDK's environment (``LocalBroker.environ`` or ``sdk_environ``): the server finds
its broker and credential there, as the SDK does; the client never sees a token.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, TextContent

CLI = [sys.executable, "-m", "k8s_agent_sandbox_awx.cli._cli"]
_PID = re.compile(r"pid (\d+)\)")
_URL = re.compile(r"at (http://\S+/mcp) ")


def server_env(environ: Mapping[str, str], **more: str) -> dict[str, str]:
    """What the server process gets: a minimal environment (as agents pass one), plus the
    SDK's variables (``environ``) and ``more``."""
    kept = ("PATH", "HOME", "TMPDIR", "LANG", "PYTHONPATH")
    base = {k: os.environ[k] for k in kept if k in os.environ}
    plugins = {"AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return {**base, **plugins, **environ, **more}


def texts(result: CallToolResult) -> str:
    """Every text block of a tool's result, joined."""
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))


@dataclass
class Connected:
    """A client in a session with the server (``log``: the server's stderr)."""

    client: Client
    log: Path

    async def call(self, name: str, **arguments: Any) -> CallToolResult:
        return await self.client.call_tool(name, arguments)

    async def ok(self, name: str, **arguments: Any) -> dict[str, Any]:
        """The structured result of a call that must succeed (its JSON text agrees)."""
        result = await self.call(name, **arguments)
        assert not result.is_error, texts(result)
        structured = result.structured_content
        assert isinstance(structured, dict), result
        assert json.loads(texts(result)) == structured
        return structured

    async def error(self, name: str, **arguments: Any) -> str:
        """The text of a call that must fail as a tool result (never a protocol error)."""
        result = await self.call(name, **arguments)
        assert result.is_error, result
        return texts(result)

    def pid(self, timeout: float = 30.0) -> int:
        return int(wait_for_line(self.log, _PID, timeout).group(1))


def wait_for_line(log: Path, pattern: re.Pattern[str], timeout: float = 30.0) -> re.Match[str]:
    """The first match of ``pattern`` in ``log`` (waiting for the process to write it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        found = pattern.search(text)
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {pattern.pattern!r} in the server's stderr:\n{log.read_text()}")


@contextlib.asynccontextmanager
async def stdio_client_of(
    env: Mapping[str, str], log: Path, *args: str, mode: str = "auto"
) -> AsyncIterator[Connected]:
    """A session with ``agent-sandbox-awx mcp [args]`` over stdio (see the module)."""
    params = StdioServerParameters(command=CLI[0], args=[*CLI[1:], "mcp", *args], env=dict(env))
    with log.open("w") as errlog:
        async with Client(stdio_client(params, errlog=errlog), mode=mode) as client:
            yield Connected(client, log)


class HttpServer:
    """``agent-sandbox-awx mcp --http 127.0.0.1:0 [args]`` (see the module)."""

    def __init__(self, env: Mapping[str, str], log: Path, *args: str) -> None:
        self.log = log
        with log.open("w") as errlog:
            self.process = subprocess.Popen(
                [*CLI, "mcp", "--http", "127.0.0.1:0", *args],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errlog,
            )
        try:
            self.url = wait_for_line(log, _URL).group(1)
        except BaseException:
            self.process.kill()
            raise

    @contextlib.asynccontextmanager
    async def client(
        self, mode: str = "legacy", *, terminate: bool = True
    ) -> AsyncIterator[Connected]:
        """A session (``legacy``: the 2025 handshake, with an ``Mcp-Session-Id``; ``auto``:
        the 2026-07-28 protocol, sessionless); ``terminate=False``: the client goes away
        without ending its session (no ``DELETE``), as a client that crashed."""
        transport = streamable_http_client(self.url, terminate_on_close=terminate)
        async with Client(transport, mode=mode) as client:
            yield Connected(client, self.log)

    def pid(self) -> int:
        return int(wait_for_line(self.log, _PID).group(1))

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``signum`` and wait for the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:
            self.stop()
