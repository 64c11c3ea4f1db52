"""``agent-sandbox-awx mcp [--http [HOST:]PORT [--allow-remote]]``: the MCP server for agents.

Its options are checked here, before anything is imported; the server (``k8s_agent_sandbox_awx
.mcp``) and the ``mcp`` SDK it is built on (the ``[mcp]`` extra) are imported only when it
runs, so ``--help`` stays fast and a missing extra is one message that says how to install it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ..mcp._address import ListenError, is_loopback, parse_listen
from ._common import PROG, CliError, seconds

__all__ = ["MCP_REQUIREMENT", "add_parser", "install_hint", "run"]

MCP_REQUIREMENT = "mcp>=2.3,<3"
"""The SDK the ``[mcp]`` extra installs (pyproject.toml says the same; a test keeps them equal)."""
REMOTE_FLAG = "--allow-remote"


def install_hint() -> str:
    """How to install the ``[mcp]`` extra (from a clone: the index has an unrelated package of
    this name until a release exists), or the SDK alone into this very environment."""
    return (
        f'python3 -m pip install -e ".[mcp]" in a clone of the k8s-agent-sandbox-awx repository, '
        f"or {sys.executable} -m pip install '{MCP_REQUIREMENT}' into this environment"
    )


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number greater than 0")
    return int(text)


def add_parser(sub: Any) -> None:
    from ..mcp._bounds import DEFAULT_MAX_OUTPUT_CHARS

    p = sub.add_parser(
        "mcp",
        help="serve sandboxes to agents over the Model Context Protocol (stdio, or --http)",
        description="Serve the Model Context Protocol: tools that create sandboxes, run "
        "commands and read and write files in them, through the broker with this machine's "
        "credential (found as the SDK finds it: nothing to configure in a pod or a CI job). "
        "Over stdio (the default) for an agent that launches it; each session's default "
        "sandbox is deleted when the session ends. Needs the [mcp] extra.",
    )
    p.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio (HOST default "
        "127.0.0.1; PORT 0: any free one)",
    )
    p.add_argument(
        REMOTE_FLAG,
        action="store_true",
        help="let --http listen on an address other than loopback. The server has no "
        "authentication of its own: anyone who reaches the port acts with this server's "
        "identity (its sandboxes, its policy)",
    )
    p.add_argument(
        "--max-output-chars",
        type=_positive_int,
        default=DEFAULT_MAX_OUTPUT_CHARS,
        metavar="N",
        help=f"the most characters a tool returns in one field: a command's stdout, its stderr, "
        f"a file's text (default {DEFAULT_MAX_OUTPUT_CHARS}); longer ones are cut, with a note",
    )
    p.add_argument(
        "--idle-timeout",
        type=seconds(positive=True),
        default=None,
        metavar="SECONDS",
        help="with --http: a session with no request for this long ends and its default "
        "sandbox is deleted (default 1800)",
    )


def _address(args: argparse.Namespace) -> tuple[str, int] | None:
    """``--http``'s address, checked (a non-loopback one needs ``--allow-remote``)."""
    if args.http is None:
        given = ((REMOTE_FLAG, args.allow_remote), ("--idle-timeout", args.idle_timeout))
        for flag, value in given:
            if value:
                raise CliError(f"mcp: {flag} is for HTTP mode: add --http [HOST:]PORT.", 2)
        return None
    try:
        host, port = parse_listen(args.http)
    except ValueError as exc:
        raise CliError(f"mcp: {exc}.", 2) from None
    if not is_loopback(host) and not args.allow_remote:
        raise CliError(
            f"mcp: --http {args.http} listens beyond this machine, and the MCP server has no "
            "authentication of its own: anyone who reaches the port acts with this server's "
            "identity (creates sandboxes, runs commands, reads files under its policy). Listen "
            f"on 127.0.0.1 (--http 127.0.0.1:{port}), or add {REMOTE_FLAG} if a network policy "
            "or a proxy in front of it decides who gets in.",
            2,
        )
    return host, port


def run(args: argparse.Namespace, settings_of: Callable[[argparse.Namespace], Any]) -> int:
    """``agent-sandbox-awx mcp``: the exit code (0: input ended or stopped by a signal)."""
    http = _address(args)
    try:
        from ..mcp._serve import serve
    except ImportError as exc:
        raise CliError(
            f"`{PROG} mcp` needs the [mcp] extra ({exc.name or exc} could not be imported): "
            f"install it: {install_hint()}"
        ) from exc
    settings = settings_of(args)
    try:
        return serve(
            settings,
            http=http,
            max_output_chars=args.max_output_chars,
            idle_timeout=args.idle_timeout,
        )
    except ListenError as exc:
        raise CliError(f"mcp: {exc}") from None
