"""What the CLI's modules share: its name, its explained failure, the seconds type of its
options, the options several sub-commands take, the finish of every sub-command's parser
(the global options after the command, a description) and its JSON printing (standard library
only: ``--help`` stays fast)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = [
    "PROG",
    "CliError",
    "finish_subcommands",
    "json_option",
    "print_json",
    "ready_timeout_option",
    "seconds",
    "template_option",
    "write_private",
]

PROG = "agent-sandbox-awx"


class CliError(Exception):
    """A failure already explained for the user (exit code attached)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def seconds(*, positive: bool) -> Callable[[str], float]:
    """An argparse type: a number of seconds, > 0 (``positive``) or >= 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or not (value > 0 if positive else value >= 0):
            rule = "a number of seconds greater than 0" if positive else "a number of seconds >= 0"
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
        return value

    parse.__name__ = "seconds"
    return parse


TEMPLATE_HELP = (
    "sandbox template (default: $AGENT_SANDBOX_TEMPLATE, else the broker policy's default)"
)
READY_TIMEOUT_HELP = "seconds to wait for the sandbox to become ready"


def template_option(parser: argparse.ArgumentParser, help_text: str = TEMPLATE_HELP) -> None:
    """``--template NAME``: the new sandbox's template (``None``: the default)."""
    parser.add_argument("--template", help=help_text)


def ready_timeout_option(
    parser: argparse.ArgumentParser, help_text: str = READY_TIMEOUT_HELP
) -> None:
    """``--ready-timeout SECONDS`` (>= 0; ``None``: the client's default)."""
    parser.add_argument(
        "--ready-timeout", type=seconds(positive=False), default=None, help=help_text
    )


def json_option(parser: argparse.ArgumentParser, help_text: str = "print JSON") -> None:
    """``--json``: the command's result as JSON on standard output."""
    parser.add_argument("--json", action="store_true", help=help_text)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


_LOCAL_COMMANDS = ("dev", "demo")
"""Sub-commands with a parser of their own (``cli/_local.py``): their options are theirs."""
_SERVER_COMMANDS = ("broker", "check", "serve")
"""The broker server's sub-commands: a client's options (``--broker-url``, ``--ca-bundle``)
mean nothing to a server, so their ``--help`` does not list them (issue 30)."""


def finish_subcommands(
    parser: argparse.ArgumentParser, global_options: Callable[[argparse.ArgumentParser, Any], None]
) -> None:
    """Every sub-command (and theirs) takes the global options after its name too (unset
    unless given there, so that ``--broker-url X ls`` keeps working), and gets its help line
    as the description its ``--help`` starts with."""
    for name, help_text, sub in _subparsers(parser):
        if sub.description is None:
            sub.description = _sentence(help_text)
        if name not in _LOCAL_COMMANDS + _SERVER_COMMANDS:
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


def write_private(path: str, data: bytes, *, prefix: str = ".staged-") -> None:
    """Replace ``path`` with ``data`` atomically (a reader never sees half of it), the file 0600
    from its creation (``mkstemp``); its folder is made if missing."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
