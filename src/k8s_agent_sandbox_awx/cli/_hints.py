"""The hints the CLI adds to a friction a first session meets: each names the fix (a shell line
given as one word, a ``kill`` of an unknown name, a plain ``http://`` URL against an HTTPS
broker, a directory removed without ``-r``, the broker URL's flag in an audience mismatch).

Imports of the client are deferred to the hint that needs them (``--help`` stays fast)."""

from __future__ import annotations

import argparse
import os

from ._common import PROG

__all__ = ["error_hints", "kill_warning", "name_the_flag", "shell_hint"]

_SHELL_CHARACTERS = frozenset("|&;<>()$`*?[]{}~'\"\\\n")


def shell_hint(cmd: list[str], exit_code: int) -> str | None:
    """Exit 127 (not found) of one argument with shell syntax in it (``run -- "a && b"``):
    the CLI runs no shell; say how to get one."""
    if exit_code != 127 or len(cmd) != 1:
        return None
    text = cmd[0]
    if not (_SHELL_CHARACTERS & set(text) or " " in text.strip()):
        return None
    return (
        f"{PROG}: hint: {text!r} ran as the name of one program (exit 127: not found); `run` "
        "uses no shell. For shell syntax (&&, pipes, globs, variables) use "
        f"`{PROG} run -- sh -c {_quoted(text)}`, or split the words: `run -- prog arg ...`."
    )


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def kill_warning(name: str) -> str:
    return (
        f"{PROG}: warning: no sandbox {name} at the broker (never created, already deleted or "
        f"expired, or another identity's); check the name with `{PROG} ls`."
    )


def error_hints(exc: BaseException, args: argparse.Namespace) -> list[str]:
    """Hints for an error the CLI's user can fix: a plain http:// URL that no server answers
    as HTTP (an HTTPS broker), a directory removed without ``-r``."""
    from ..errors import BrokerUnavailableError, SandboxFileError

    hints = []
    url = _broker_url(args)
    if (
        isinstance(exc, BrokerUnavailableError)
        and getattr(exc, "fix", None) is None  # a fix says it already (issue 30)
        and getattr(exc, "status_code", None) is None
        and url.startswith("http://")
    ):
        hints.append(
            f"hint: {url} is a plain http:// URL; the broker may speak HTTPS: try "
            f"--broker-url https://{url[len('http://') :]} (with --ca-bundle for a private CA)."
        )
    if isinstance(exc, SandboxFileError) and getattr(exc, "code", None) == "not_empty":
        hints.append(
            f"hint: it is a directory that is not empty; `{PROG} files rm -r NAME PATH` "
            "removes it and everything in it."
        )
    return hints


def name_the_flag(text: str, args: argparse.Namespace) -> str:
    """``text`` (an error's message) with the broker URL's variable replaced by the flag, when
    the URL came from ``--broker-url`` (an audience mismatch names where the URL was set)."""
    from ..client.http._config import ENV_BROKER_URL

    if getattr(args, "broker_url", None):
        return text.replace(f"fix {ENV_BROKER_URL}", "fix --broker-url")
    return text


def _broker_url(args: argparse.Namespace) -> str:
    from ..client.http._config import ENV_ALIASES

    if getattr(args, "broker_url", None):
        return str(args.broker_url)
    names = ENV_ALIASES["broker_url"]
    return next((os.environ[n] for n in names if os.environ.get(n)), "")
