"""``run``: create a sandbox, run one command in it with its output streamed, delete it
(``--keep``, ``--sandbox NAME``: the sandbox stays; ``--background``: the command goes on
running); its parser, its time limits and its Ctrl-C handling (:class:`_Interrupts`: the
cleanup after Ctrl-C always ends, within :data:`CLEANUP_TIMEOUT`).

Imports of the client are deferred to the command that needs them (``--help`` stays fast)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from . import _connect, _hints, _kept
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
    "CLEANUP_TIMEOUT",
    "CUT_TIMEOUT",
    "LAST_DELETE_TIMEOUT",
    "RUN_TIMEOUT",
    "add_parser",
    "cmd_run",
]

CLEANUP_TIMEOUT = 30.0
"""Seconds ``run`` may spend cleaning up after Ctrl-C (kill the command, delete the sandbox)."""
RUN_TIMEOUT = 300.0
"""``run``'s command time limit without ``--timeout`` (seconds: the runtime's default cap)."""
CUT_TIMEOUT = 1.0
"""Seconds each later cleanup step gets once the cleanup was cut (the time limit passed, or a
second Ctrl-C): a step that cannot finish is cut again, so the CLI always exits."""
LAST_DELETE_TIMEOUT = 5.0
"""The request time limit of the one last delete, on new connections, of a sandbox whose
cleanup hit :data:`CLEANUP_TIMEOUT` (not tried after a second Ctrl-C: the user wants out)."""


def add_parser(sub: Any) -> None:
    """``run`` and its options, on the CLI's sub-commands ``sub``."""
    p = sub.add_parser(
        "run",
        help="create a sandbox, run one command, print its output, kill it "
        "(--keep: keep it; --sandbox NAME: run in an existing one)",
    )
    template_option(p)
    p.add_argument(
        "--timeout",
        type=seconds(positive=False),
        default=None,
        help=f"command time limit in seconds (default {RUN_TIMEOUT:g}; 0: none, with --background)",
    )
    ready_timeout_option(p)
    json_option(p, "print the result as JSON (--background: the command id)")
    _kept.run_options(p)
    p.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        help="-- COMMAND [ARG...]: the program and its arguments, run without a shell "
        "(for pipes, && and globs: -- sh -c 'a && b')",
    )


class _CleanupCut(BaseException):
    """The cleanup after Ctrl-C was cut short (not an ``Exception``: no cleanup step swallows
    it)."""


class _Interrupts:
    """Ctrl-C during ``run`` (main thread, where ``signal.setitimer`` exists): the first one is a
    ``KeyboardInterrupt`` (the command is killed, the sandbox deleted) and starts the cleanup's
    time limit, :data:`CLEANUP_TIMEOUT`; when it passes, or at a second Ctrl-C,
    :class:`_CleanupCut` is raised wherever the cleanup waits (a read, a lock an interrupted
    library call left held), and every later step gets :data:`CUT_TIMEOUT`."""

    def __init__(self) -> None:
        self.interrupted = False
        self.second = False
        self.cut: str | None = None
        self._saved: list[tuple[int, Any]] = []

    def __enter__(self) -> _Interrupts:
        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            for signum, handler in ((signal.SIGALRM, self._alarm), (signal.SIGINT, self._sigint)):
                self._saved.append((signum, signal.signal(signum, handler)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._saved:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for signum, handler in reversed(self._saved):
                signal.signal(signum, handler)

    def limit(self, seconds: float) -> None:
        """Cut what runs now after ``seconds`` (with the handlers installed)."""
        if self._saved:
            signal.setitimer(signal.ITIMER_REAL, seconds)

    def _sigint(self, signum: int, frame: Any) -> None:
        if not self.interrupted:
            self.interrupted = True
            signal.setitimer(signal.ITIMER_REAL, CLEANUP_TIMEOUT)
            raise KeyboardInterrupt
        self.second = True
        self._cut_short("a second Ctrl-C stopped it")

    def _alarm(self, signum: int, frame: Any) -> None:
        if self.interrupted:
            self._cut_short(f"it did not finish within {CLEANUP_TIMEOUT:g}s")

    def _cut_short(self, why: str) -> None:
        self.cut = self.cut or why
        signal.setitimer(signal.ITIMER_REAL, CUT_TIMEOUT)
        raise _CleanupCut(why)


def _check_run_timeout(args: argparse.Namespace) -> None:
    """``run``'s ``--timeout`` (default :data:`RUN_TIMEOUT`) and ``--background``, checked
    before anything is sent: no time limit (``--timeout 0``) is for a background command, and
    a background command needs a sandbox that stays (``--sandbox NAME`` or ``--keep``)."""
    if args.timeout is None:
        args.timeout = RUN_TIMEOUT
    if args.background and args.sandbox is None and not args.keep:
        raise CliError(
            "run: --background starts the command and returns, so the sandbox must stay: "
            "add --sandbox NAME (an existing sandbox) or --keep (a new one, kept).",
            2,
        )
    if args.timeout == 0 and not args.background:
        raise CliError(
            "run: --timeout 0 (no time limit) is for --background: a foreground run waits for "
            "its command. Pass --timeout SECONDS, or start it with --background --timeout 0 "
            "(with --sandbox NAME or --keep).",
            2,
        )


def cmd_run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CliError(f"run: no command given; use `{PROG} run -- COMMAND [ARG...]`.", 2)
    _check_run_timeout(args)
    streams = (
        {} if args.json else {"on_stdout": _writer(sys.stdout), "on_stderr": _writer(sys.stderr)}
    )
    client = _connect.client(args)
    made: list[str] = []
    interrupts = _Interrupts()
    try:
        with interrupts:
            try:
                try:
                    return _run_in_sandbox(args, client, cmd, streams, made)
                finally:
                    if interrupts.cut is None:
                        client.close()
            except _CleanupCut:
                if not made or interrupts.second:
                    raise
                interrupts.limit(2 * LAST_DELETE_TIMEOUT)  # cut too if it cannot finish
                if not _last_delete(args, made[0]):
                    raise
        raise KeyboardInterrupt  # deleted after all: a plain interruption
    except _CleanupCut as exc:
        raise CliError(_cut_message(interrupts.cut or str(exc), made), 130) from None


def _last_delete(args: argparse.Namespace, name: str) -> bool:
    """Delete sandbox ``name`` on new connections (the old ones may be stuck: a lock an
    interrupted call left held), each request within :data:`LAST_DELETE_TIMEOUT`, not
    retried; whether that worked."""
    from ..client._client import BrokerSandboxClient

    settings = _connect.given(args)
    try:
        client = BrokerSandboxClient(
            request_timeout=LAST_DELETE_TIMEOUT, max_attempts=1, **settings
        )
        try:
            client.delete(name)
        finally:
            client.close()
    except Exception as exc:
        print(f"{PROG}: could not delete sandbox {name}: {exc}", file=sys.stderr)
        return False
    return True


def _cut_message(why: str, made: list[str]) -> str:
    """What may be left when the cleanup after Ctrl-C was cut short (``made``: the sandbox's
    name, once it was created)."""
    if made:
        name = made[0]
        left = (
            f"sandbox {name} (and the command in it) may be left; delete it with "
            f"`{PROG} kill {name}`"
        )
    else:
        left = f"a sandbox being created may be left; check with `{PROG} ls`"
    return f"interrupted; the cleanup was cut short ({why}): {left}."


def _run_in_sandbox(
    args: argparse.Namespace, client: Any, cmd: list[str], streams: dict[str, Any], made: list[str]
) -> int:
    """Create a sandbox (its name appended to ``made``), run ``cmd`` in it, delete it; with
    ``--keep`` or ``--sandbox NAME`` the sandbox stays (and is not in ``made``)."""
    if args.background:
        return _kept.run_kept(args, client, lambda sandbox: _start_in(args, sandbox, cmd))
    if args.sandbox is not None or args.keep:
        return _kept.run_kept(
            args,
            client,
            lambda sandbox: _run_done(
                args, sandbox.name, cmd, _run_command(args, sandbox, cmd, streams)
            ),
        )
    with client.create_sandbox(
        template=args.template, sandbox_ready_timeout=args.ready_timeout
    ) as sandbox:
        made.append(sandbox.name)
        result = _run_command(args, sandbox, cmd, streams)
    return _run_done(args, sandbox.name, cmd, result)


def _start_in(args: argparse.Namespace, sandbox: Any, cmd: list[str]) -> int:
    """``run --background``: start ``cmd`` in ``sandbox`` and print its command id (``--json``:
    the sandbox, the command id and its time limit, ``null``: none); it goes on running."""
    handle = sandbox.commands.run(cmd, background=True, timeout=args.timeout)
    limit = args.timeout or None
    if args.json:
        print_json({"sandbox": sandbox.name, "command_id": handle.command_id, "timeout": limit})
    else:
        print(handle.command_id, flush=True)
        until = "it exits or the sandbox ends" if limit is None else f"at most {limit:g}s"
        print(
            f"{PROG}: command {handle.command_id} runs in sandbox {sandbox.name} in the "
            f"background (until {until}); `{PROG} kill {sandbox.name} --command "
            f"{handle.command_id}` stops it, `{PROG} kill {sandbox.name}` ends it with the "
            "sandbox.",
            file=sys.stderr,
        )
    return 0


def _run_command(
    args: argparse.Namespace, sandbox: Any, cmd: list[str], streams: dict[str, Any]
) -> Any:
    """Run ``cmd`` in ``sandbox``, its output streamed (``streams``); its result."""
    from ..errors import CommandTimeoutError, UnsupportedByRuntimeError

    try:  # an argv: no shell; Ctrl-C kills the command (then the sandbox, unless it is kept)
        try:
            return sandbox.commands.run(cmd, timeout=args.timeout, **streams)
        except UnsupportedByRuntimeError:
            if not streams:
                raise
            # an old runtime cannot stream (the command did not run): the output at
            # the end instead
            result = sandbox.commands.run(cmd, timeout=args.timeout)
            _writer(sys.stdout)(result.stdout)
            _writer(sys.stderr)(result.stderr)
            return result
    except CommandTimeoutError as exc:
        if exc.result is not None and args.json:
            _print_result(args, sandbox.name, exc.result)
        if not args.json and exc.result is not None:
            sys.stderr.write("\n" if exc.result.stderr[-1:] not in ("", "\n") else "")
        raise CliError(
            f"the command ran longer than --timeout {args.timeout:g}s and was killed; "
            "pass a larger --timeout.",
            124,
        ) from exc


def _run_done(args: argparse.Namespace, name: str, cmd: list[str], result: Any) -> int:
    """The end of ``run``: the result as JSON (``--json``), a hint for a shell command given
    as one word; the command's exit code."""
    if args.json:
        _print_result(args, name, result)
    hint = _hints.shell_hint(cmd, int(result.exit_code))
    if hint:
        print(hint, file=sys.stderr)
    return int(result.exit_code)


def _writer(stream: Any) -> Any:
    """A callback that prints output as it arrives."""

    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    return write


def _print_result(args: argparse.Namespace, sandbox: str, result: Any) -> None:
    """The command's output as it is (stdout, stderr), or with ``--json`` one JSON object."""
    if args.json:
        print_json(
            {
                "sandbox": sandbox,
                "exit_code": result.exit_code,
                "stdout": result.stdout,
                "stderr": result.stderr,
                "timed_out": bool(result.timed_out),
            }
        )
        return
    sys.stdout.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.write(result.stderr)
