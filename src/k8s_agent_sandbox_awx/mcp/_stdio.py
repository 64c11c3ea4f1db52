"""Stdio mode: one MCP session over standard input and output, the process's whole life.

Its default sandbox is deleted when standard input closes (the agent ended the session) and on
SIGTERM, SIGINT or SIGHUP; then the process exits 0. Only SIGKILL leaves it to its lifetime.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from mcp.server.stdio import stdio_server

from ._server import SIGNALS, McpApp, build_server
from ._sessions import Session

__all__ = ["serve_stdio"]

logger = logging.getLogger("k8s_agent_sandbox_awx.mcp")


async def serve_stdio(app: McpApp) -> int:
    """Serve one session over standard input and output (see the module)."""
    session = Session(app.sandboxes, "stdio")
    server = build_server(app, lambda ctx: session)
    loop = asyncio.get_running_loop()
    for signum in SIGNALS:
        loop.add_signal_handler(signum, _on_signal, app, session, signum)
    try:
        async with stdio_server() as (read_stream, write_stream):
            logger.info(
                "serving the Model Context Protocol over stdio for %s (%d tools, pid %d); this "
                "session's default sandbox is deleted when standard input closes or on SIGTERM",
                app.config.broker_url,
                len(app.tools),
                os.getpid(),
            )
            await server.run(read_stream, write_stream, server.create_initialization_options())
    finally:
        await app.close(session.close)
    return 0


_STOPPING: set[asyncio.Task[None]] = set()


def _on_signal(app: McpApp, session: Session, signum: int) -> None:
    task = asyncio.ensure_future(_stop(app, session, signum))
    _STOPPING.add(task)


async def _stop(app: McpApp, session: Session, signum: int) -> None:
    """A signal: delete the session's default sandbox, then exit at once (the SDK reads
    standard input in a thread that only a new line or the input's end would release)."""
    logger.info("%s: stopping", signal.Signals(signum).name)
    try:
        await app.close(session.close)
    finally:
        logging.shutdown()
        sys.stderr.flush()
        os._exit(0)
