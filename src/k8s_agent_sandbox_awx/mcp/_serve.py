"""``agent-sandbox-awx mcp``'s entry: the settings checked, logging on standard error, then
stdio (``_stdio``) or streamable HTTP (``_http``) until the input ends or a signal stops it."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Mapping
from typing import Any

from ..client.http._config import BrokerConnectionConfig
from . import _bounds as bounds
from ._server import McpApp

__all__ = ["PROG", "serve"]

PROG = "agent-sandbox-awx mcp"


def serve(
    settings: Mapping[str, Any],
    *,
    http: tuple[str, int] | None = None,
    max_output_chars: int = bounds.DEFAULT_MAX_OUTPUT_CHARS,
    idle_timeout: float | None = None,
) -> int:
    """Run the server until its input ends (stdio) or a signal stops it; the exit code."""
    config = BrokerConnectionConfig.from_env(**settings)  # a bad setting: before serving
    _log_to_stderr()
    app = McpApp(config, max_output_chars)
    if http is not None:
        from ._http import DEFAULT_IDLE_TIMEOUT, serve_http

        return asyncio.run(serve_http(app, *http, idle_timeout or DEFAULT_IDLE_TIMEOUT))
    from ._stdio import serve_stdio

    return asyncio.run(serve_stdio(app))


def _log_to_stderr() -> None:
    """Our messages (and the SDK's warnings) on standard error, one line each: standard
    output is the protocol's over stdio."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("k8s_agent_sandbox_awx.mcp").setLevel(logging.INFO)
