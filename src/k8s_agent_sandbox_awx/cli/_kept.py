"""Kept sandboxes: ``create`` and ``run --keep`` leave a sandbox to work with (``run --sandbox
NAME``, ``files``, ``ls``, ``kill``); the sandbox is never deleted by them.

Imports of the client are deferred to the command that needs them (``--help`` stays fast)."""

from __future__ import annotations

import argparse
import math
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
    "kept_line",
    "run_kept",
    "run_options",
]


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
