"""The CLI a person uses day to day (issue 23): ``create`` and ``run --keep`` leave a sandbox
to work with (``run --sandbox NAME``, ``files``, ``ls``, ``kill``), the global options are taken
after the command too, every sub-command's ``--help`` has a description, and the frictions a
first session meets get a hint that names the fix.

Imports of the client are deferred to the command that needs them (``--help`` stays fast)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from ._common import (
    PROG,
    CliError,
    json_option,
    print_json,
    ready_timeout_option,
    seconds,
    template_option,
)

__all__ = [
    "cmd_create",
    "create_subcommand",
    "error_hints",
    "finish_subcommands",
    "kept_line",
    "kill_warning",
    "name_the_flag",
    "run_kept",
    "run_options",
    "shell_hint",
]

_LOCAL_COMMANDS = ("dev", "demo")
"""Sub-commands with a parser of their own (``cli/_local.py``): their options are theirs."""
_SHELL_CHARACTERS = frozenset("|&;<>()$`*?[]{}~'\"\\\n")


# --------------------------------------------------------------------------- the parser


def finish_subcommands(
    parser: argparse.ArgumentParser, global_options: Callable[[argparse.ArgumentParser, Any], None]
) -> None:
    """Every sub-command (and theirs) takes the global options after its name too (unset
    unless given there, so that ``--broker-url X ls`` keeps working), and gets its help line
    as the description its ``--help`` starts with."""
    for name, help_text, sub in _subparsers(parser):
        if sub.description is None:
            sub.description = _sentence(help_text)
        if name not in _LOCAL_COMMANDS:
            global_options(sub, argparse.SUPPRESS)


def _subparsers(
    parser: argparse.ArgumentParser,
) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, help, parser)`` of every sub-command below ``parser``, depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name, ""), sub))
                found += _subparsers(sub)
    return found


def _sentence(text: str) -> str:
    return f"{text[:1].upper()}{text[1:]}." if text else text


def create_subcommand(sub: Any) -> None:
    p = sub.add_parser(
        "create",
        help="create a sandbox and print its name; it runs until its lifetime ends "
        "(--timeout) or `kill NAME`",
    )
    template_option(p)
    p.add_argument(
        "--timeout",
        type=seconds(positive=True),
        default=None,
        help="the sandbox's lifetime in seconds, from its creation (default: "
        "$AGENT_SANDBOX_TTL_SECONDS, else 300; at most the policy's cap; `extend` changes it)",
    )
    ready_timeout_option(p)
    json_option(p, "print the sandbox as JSON")


def run_options(p: argparse.ArgumentParser) -> None:
    """``run``'s ``--keep``, ``--sandbox`` and ``--background``."""
    p.add_argument(
        "--background",
        action="store_true",
        help="start the command, print its command id and return; it goes on running (with "
        "--sandbox NAME or --keep; --timeout 0: no time limit, until the sandbox ends)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the new sandbox after the command and print its name on stderr "
        "(delete it with `kill NAME`)",
    )
    p.add_argument(
        "--sandbox",
        metavar="NAME",
        help="run in this existing sandbox (from `create`, `run --keep` or `ls`) instead of "
        "a new one; it is kept",
    )


# --------------------------------------------------------------------------- the commands


def cmd_create(args: argparse.Namespace, client: Any) -> int:
    """``create``: a new sandbox, kept; its name (``--json``: the sandbox) on stdout."""
    options: dict[str, Any] = {"template": args.template}
    if args.timeout is not None:
        options["shutdown_after_seconds"] = math.ceil(args.timeout)
    try:
        sandbox = client.create_sandbox(sandbox_ready_timeout=args.ready_timeout, **options)
        try:
            info = sandbox.get_info() if args.json else sandbox.info  # with its deadline
        finally:
            sandbox.close_connection()  # it keeps running
    finally:
        client.close()
    if args.json:
        print_json({**info.to_dict(), "seconds_left": info.seconds_left()})
    else:
        print(info.name)
    return 0


def run_kept(args: argparse.Namespace, client: Any, run_in: Callable[[Any], int]) -> int:
    """``run --sandbox NAME`` (an existing sandbox) or ``run --keep`` (a new one, its name on
    stderr when the command ended, however it ended): ``run_in(sandbox)``; the sandbox is
    never deleted."""
    if args.sandbox is not None:
        if args.template is not None:
            raise CliError(
                "run: --template is for a new sandbox, --sandbox NAME runs in an existing one; "
                "leave out one of them.",
                2,
            )
        resolve = 30.0 if args.ready_timeout is None else args.ready_timeout
        sandbox = client.get_sandbox(args.sandbox, resolve_timeout=resolve)
    else:
        sandbox = client.create_sandbox(
            template=args.template, sandbox_ready_timeout=args.ready_timeout
        )
    try:
        return run_in(sandbox)
    finally:
        if args.sandbox is None:
            print(kept_line(sandbox.name), file=sys.stderr, flush=True)
        sandbox.close_connection()  # it keeps running


def kept_line(name: str) -> str:
    return (
        f"{PROG}: sandbox {name} kept: run in it with `{PROG} run --sandbox {name} -- CMD`, "
        f"delete it with `{PROG} kill {name}`"
    )


# --------------------------------------------------------------------------- the hints


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
