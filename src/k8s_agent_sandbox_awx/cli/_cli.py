"""``agent-sandbox-awx``: whoami, doctor, run, shell, ls, kill, extend, files, broker (check, serve)
(and dev/demo from the [local] extra).

Imports are deferred to the subcommand that needs them, so ``--help`` and ``--version`` are
fast and never fail for a missing optional dependency. Errors print ``agent-sandbox-awx: error:``
and the message (a list in it stays one item per line, indented) and exit non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import _everyday, _port_forward
from ._common import PROG, json_option, ready_timeout_option, template_option
from ._common import CliError as _CliError
from ._common import print_json as _print_json
from ._common import seconds as _seconds

if TYPE_CHECKING:
    from ..client._client import BrokerSandboxClient

__all__ = ["main"]

# from a clone: the index has an unrelated package of this name until a release exists
_LOCAL_EXTRA = (
    'python3 -m pip install -e ".[local]" in a clone of the k8s-agent-sandbox-awx repository'
)
_INSECURE_FLAG = "--allow-insecure-http"
CLEANUP_TIMEOUT = 30.0
"""Seconds ``run`` may spend cleaning up after Ctrl-C (kill the command, delete the sandbox)."""
RUN_TIMEOUT = 300.0
"""``run``'s command time limit without ``--timeout`` (seconds: the runtime's default cap)."""
CUT_TIMEOUT = 1.0
LAST_DELETE_TIMEOUT = 5.0
"""The request time limit of the one last delete, on new connections, of a sandbox whose
cleanup hit :data:`CLEANUP_TIMEOUT` (not tried after a second Ctrl-C: the user wants out)."""
"""Seconds each later cleanup step gets once the cleanup was cut (the time limit passed, or a
second Ctrl-C): a step that cannot finish is cut again, so the CLI always exits."""


def _parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Kubernetes agent sandboxes through an OIDC identity broker.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    global_options(parser, None)
    _subcommands(parser.add_subparsers(dest="command", metavar="COMMAND"))
    _everyday.finish_subcommands(parser, global_options)
    return parser


def global_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """The options every command takes: before the command, and (``default``
    ``argparse.SUPPRESS``: unset unless given) after it too."""
    parser.add_argument(
        "--broker-url",
        default=default,
        help="the broker's https:// URL (default: $AGENT_SANDBOX_BROKER_URL)",
    )
    parser.add_argument(
        "--ca-bundle",
        default=default,
        help="CA bundle for the broker (default: "
        "$AGENT_SANDBOX_CA_BUNDLE, else the system trust store)",
    )
    parser.add_argument(
        _INSECURE_FLAG,
        action="store_true",
        default=default if default is not None else False,
        help="allow a plain http:// broker URL on this machine (127.0.0.1, ::1, localhost): "
        "local development only, the token travels unencrypted",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default if default is not None else False,
        help="show tracebacks",
    )


def _subcommands(sub: Any) -> None:
    p = sub.add_parser("whoami", help="show your verified identity and what its policy allows")
    json_option(p)
    p = sub.add_parser("doctor", help="check configuration, credentials, TLS and the broker")
    json_option(p)
    _everyday.create_subcommand(sub)
    p = sub.add_parser(
        "run",
        help="create a sandbox, run one command, print its output, kill it "
        "(--keep: keep it; --sandbox NAME: run in an existing one)",
    )
    template_option(p)
    p.add_argument(
        "--timeout",
        type=_seconds(positive=False),
        default=None,
        help=f"command time limit in seconds (default {RUN_TIMEOUT:g}; 0: none, with --background)",
    )
    ready_timeout_option(p)
    json_option(p, "print the result as JSON (--background: the command id)")
    _everyday.run_options(p)
    p.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        help="-- COMMAND [ARG...]: the program and its arguments, run without a shell "
        "(for pipes, && and globs: -- sh -c 'a && b')",
    )
    p = sub.add_parser("ls", help="list my sandboxes")
    json_option(p)
    p.add_argument("--selector", help="label selector k1=v1,k2=v2")
    p = sub.add_parser(
        "kill",
        help="delete sandboxes by name (already gone is fine), or with --command ID stop one "
        "command in a sandbox that stays",
    )
    json_option(p)
    p.add_argument("names", nargs="+", metavar="NAME", help="a sandbox's name (from `ls`)")
    p.add_argument(
        "--command",
        dest="command_id",
        metavar="ID",
        help="kill only this command (its id from `run --background`) in the one sandbox NAME; "
        "the sandbox goes on running",
    )
    p = sub.add_parser(
        "extend", help="set a sandbox's lifetime: the broker deletes it SECONDS from now"
    )
    json_option(p, "print the sandbox as JSON")
    p.add_argument("name", metavar="NAME", help="the sandbox's name (from `ls`)")
    p.add_argument(
        "seconds",
        type=_seconds(positive=True),
        metavar="SECONDS",
        help="its new lifetime, from now (at most the policy's cap from its creation)",
    )
    _shell_subcommand(sub.add_parser("shell", help="an interactive terminal in a sandbox"))
    _files_subcommands(sub.add_parser("files", help="the files of a sandbox: ls, get, put, rm"))
    _broker_subcommands(sub.add_parser("broker", help="the broker server: check, serve"))
    _port_forward.add_parser(sub)
    _local_subcommands(sub)


def _local_subcommands(sub: Any) -> None:
    """``dev`` and ``demo``: their own parsers (cli/_local.py) take their arguments."""
    for name, text in (
        ("dev", "run a local broker (needs the [local] extra)"),
        ("demo", "run a demo against a local broker (needs the [local] extra)"),
    ):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER, help=f"see `{PROG} {name} --help`")


def _broker_subcommands(broker: argparse.ArgumentParser) -> None:
    sub = broker.add_subparsers(dest="broker_command", metavar="ACTION", required=True)
    for name, text in (
        ("check", "validate a configuration file; print the effective configuration"),
        ("serve", "run the broker with a configuration file (needs the [broker] extra)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", required=True, metavar="FILE", help="the TOML file")


_NAME_HELP = "the sandbox's name (from `ls`, `create` or `run --keep`)"
_PATH_HELP = "a path in the sandbox: relative to /app, or /app/... or /workspace/..."


def _files_subcommands(files: argparse.ArgumentParser) -> None:
    sub = files.add_subparsers(dest="files_command", metavar="ACTION", required=True)
    p = sub.add_parser("ls", help="list a directory (default: the sandbox's base, /app)")
    p.add_argument("name", metavar="NAME", help=_NAME_HELP)
    p.add_argument(
        "path", nargs="?", default=".", metavar="PATH", help="the directory (default: /app)"
    )
    json_option(p, "print JSON (FileInfo objects)")
    p = sub.add_parser("get", help="download a file (DEST '-': standard output)")
    p.add_argument("name", metavar="NAME", help=_NAME_HELP)
    p.add_argument("path", metavar="PATH", help=_PATH_HELP)
    p.add_argument("dest", nargs="?", metavar="DEST", help="default: the file's name, here")
    json_option(p, "print what was written as JSON")
    p = sub.add_parser("put", help="upload a local file (atomic replace, parents created)")
    p.add_argument("name", metavar="NAME", help=_NAME_HELP)
    p.add_argument("local", metavar="LOCAL", help="the local file to upload")
    p.add_argument("path", nargs="?", metavar="PATH", help="default: LOCAL's name, in /app")
    json_option(p, "print the FileInfo as JSON")
    p = sub.add_parser("rm", help="remove a file or directory (a missing one is fine)")
    p.add_argument("name", metavar="NAME", help=_NAME_HELP)
    p.add_argument("path", metavar="PATH", help=_PATH_HELP)
    p.add_argument("-r", "--recursive", action="store_true", help="a directory and its contents")
    json_option(p)


def _shell_subcommand(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", metavar="NAME", help="the sandbox (or --new)")
    p.add_argument("--new", action="store_true", help="create a sandbox for the session")
    p.add_argument("--keep", action="store_true", help="with --new: keep it after the session")
    template_option(p, "with --new: its template (as for run)")
    ready_timeout_option(p, "with --new: seconds to wait for the sandbox to become ready")
    p.usage = "%(prog)s [-h] [NAME | --new [--keep] [--template T]] [-- COMMAND [ARG...]]"
    p.epilog = "-- COMMAND [ARG...]: what the terminal runs (default: the sandbox's login shell)"
    p.set_defaults(cmd=[])  # the words after `--`: split off before parsing (see _split_command)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The connection settings from the options (``None``: from the environment). The broker
    URL is checked here first, so that the fixes its errors name are the CLI's (a flag, not a
    keyword argument)."""
    from ..client.http._config import ENV_ALIASES, ENV_BROKER_URL, ENV_CA_BUNDLE, check_broker_url
    from ..errors import ConfigurationError

    names = ENV_ALIASES["broker_url"]  # ours, then the original package's BROKER_URL
    url = args.broker_url or next((os.environ[n] for n in names if os.environ.get(n)), None)
    if not url:
        raise ConfigurationError(
            f"No broker URL: set the environment variable {ENV_BROKER_URL} to the broker's "
            "https:// URL, or pass --broker-url URL."
        )
    url = check_broker_url(
        url, allow_insecure_http=args.allow_insecure_http, insecure_option=_INSECURE_FLAG
    )
    ca_from = "--ca-bundle" if args.ca_bundle else ENV_CA_BUNDLE
    if url.startswith("http://") and (args.ca_bundle or os.environ.get(ENV_CA_BUNDLE)):
        fix = "leave out --ca-bundle" if args.ca_bundle else f"unset {ENV_CA_BUNDLE}"
        raise ConfigurationError(
            f"A CA bundle is set ({ca_from}) but the broker URL {url!r} is plain http://, where "
            f"it would not be used: {fix}, or use the broker's https:// URL."
        )
    settings: dict[str, Any] = {"broker_url": args.broker_url, "ca_cert": args.ca_bundle}
    if args.allow_insecure_http:
        settings["allow_insecure_http"] = True
    return settings


def _client(args: argparse.Namespace) -> BrokerSandboxClient:
    from ..client._client import BrokerSandboxClient

    settings = {k: v for k, v in _settings(args).items() if v is not None}
    return BrokerSandboxClient(**settings)


# ------------------------------------------------------------------------------ subcommands


def _cmd_whoami(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        who = client.whoami()
    finally:
        client.close()
    if args.json:
        _print_json(who)
        return 0
    print(f"provider:   {who.get('provider')}")
    print(f"issuer:     {who.get('issuer')}")
    print(f"subject:    {who.get('subject')}")
    print(f"audience:   {who.get('audience')}")
    print(f"expires_at: {who.get('expires_at')}")
    for key, value in sorted((who.get("attributes") or {}).items()):
        print(f"  {key}: {value}")
    policy = who.get("policy") or {}
    if policy:
        print("policy:")
        for key, value in sorted(policy.items()):
            print(f"  {key}: {_ports_text(value) if key == 'ports' else value}")
    return 0


def _ports_text(ports: Any) -> str:
    """The policy's ports as whoami shows them (``8000, 3000-3999``; ``none``); a broker
    that does not name them has no ``ports`` line at all."""
    if not isinstance(ports, list):
        return str(ports)
    return ", ".join(str(port) for port in ports) or "none"


def _cmd_ls(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        items = client.list_sandboxes(args.selector)
    finally:
        client.close()
    if args.json:
        _print_json([{**item.to_dict(), "seconds_left": item.seconds_left()} for item in items])
        return 0
    if not items:
        print("no sandboxes")
        return 0
    rows = [("NAME", "PHASE", "TEMPLATE", "NAMESPACE", "CREATED", "EXPIRES", "LEFT")]
    rows += [
        (
            i.name,
            i.phase,
            i.template or "-",
            i.namespace,
            i.created_at or "-",
            i.expires_at or "-",
            _left(i),
        )
        for i in items
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _left(info: Any) -> str:
    """The time until the broker deletes a sandbox, e.g. ``4m05s`` (``-``: unknown)."""
    left = info.seconds_left()
    if left is None:
        return "-"
    minutes, secs = divmod(int(left), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _cmd_extend(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        lifetime = client.extend(args.name, math.ceil(args.seconds))
        # a dialect whose answer has no state (/rpc): its status has no deadline, the answer has
        info = lifetime.info or dataclasses.replace(
            client.get_info(args.name), expires_at=lifetime.expires_at
        )
    finally:
        client.close()
    if args.json:
        _print_json(
            {**info.to_dict(), "seconds_left": info.seconds_left(), "capped": lifetime.capped}
        )
    else:
        capped = " (cut at the policy's cap)" if lifetime.capped else ""
        print(f"{info.name}: expires at {info.expires_at} (in {_left(info)}){capped}")
    return 0


def _cmd_port_forward(args: argparse.Namespace) -> int:
    return _port_forward.run(args, _client)


def _cmd_files(args: argparse.Namespace) -> int:
    from ..client._client import Sandbox

    client = _client(args)
    try:
        sandbox = Sandbox(client, client.get_info(args.name))
        return _FILES[args.files_command](args, sandbox.files)
    finally:
        client.close()


def _files_ls(args: argparse.Namespace, files: Any) -> int:
    entries = files.list(args.path)
    if args.json:
        _print_json([entry.to_dict() for entry in entries])
        return 0
    for entry in entries:
        mode = entry.mode or "-"
        kind = {"directory": "d", "file": "-", "symlink": "l"}.get(entry.type, "?")
        print(f"{kind} {mode:>5} {entry.size:>12}  {entry.name}{'/' if entry.is_dir else ''}")
    return 0


def _files_get(args: argparse.Namespace, files: Any) -> int:
    if args.dest == "-":
        written = files.read_to(args.path, sys.stdout.buffer)
        sys.stdout.flush()
        return 0
    dest = args.dest or os.path.basename(args.path.rstrip("/")) or "download"
    written = files.read_to(args.path, dest)
    if args.json:
        _print_json({"path": args.path, "destination": dest, "bytes": written})
    else:
        print(f"{args.path} -> {dest} ({written} bytes)")
    return 0


def _files_put(args: argparse.Namespace, files: Any) -> int:
    info = files.write_from(args.path or os.path.basename(args.local), args.local)
    if args.json:
        _print_json(info.to_dict())
    else:
        print(f"{args.local} -> {info.path} ({info.size} bytes)")
    return 0


def _files_rm(args: argparse.Namespace, files: Any) -> int:
    removed = files.remove(args.path, recursive=args.recursive)
    if args.json:
        _print_json({"path": args.path, "removed": removed})
    else:
        print(f"{args.path}: {'removed' if removed else 'did not exist'}")
    return 0


_FILES: dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "ls": _files_ls,
    "get": _files_get,
    "put": _files_put,
    "rm": _files_rm,
}


def _cmd_shell(args: argparse.Namespace) -> int:
    from ..client._client import Sandbox
    from ._shell import ShellUsageError, interactive_shell, terminal_fds

    command = list(args.cmd) or None
    if args.new == (args.name is not None):
        raise _CliError(f"shell: give a sandbox NAME or --new (`{PROG} shell --new`).", 2)
    if not args.new and (args.keep or args.template or args.ready_timeout is not None):
        raise _CliError("shell: --keep, --template and --ready-timeout go with --new.", 2)
    try:
        fds = terminal_fds()  # before a sandbox is made for nothing
        client = _client(args)
        try:
            if not args.new:
                return interactive_shell(Sandbox(client, client.get_info(args.name)), *fds, command)
            sandbox = client.create_sandbox(
                template=args.template, sandbox_ready_timeout=args.ready_timeout
            )
            if args.keep:
                print(f"{PROG}: sandbox {sandbox.name} (kept)", file=sys.stderr)
                return interactive_shell(sandbox, *fds, command)
            with sandbox:  # deleted at the end of the session
                return interactive_shell(sandbox, *fds, command)
        finally:
            client.close()
    except ShellUsageError as exc:
        raise _CliError(str(exc), 2) from None


def _cmd_kill(args: argparse.Namespace) -> int:
    if args.command_id is not None:
        return _kill_command(args)
    client = _client(args)
    done: list[dict[str, Any]] = []
    try:
        for name in args.names:
            existed = client.delete(name)
            done.append({"name": name, "deleted": existed})
            if not args.json:
                print(f"{name}: {'deleted' if existed else 'already gone'}")
            if not existed:
                print(_everyday.kill_warning(name), file=sys.stderr)
    finally:
        client.close()
        if args.json:  # also after an error: the names handled so far
            _print_json(done)
    return 0


def _kill_command(args: argparse.Namespace) -> int:
    """``kill NAME --command ID``: kill that command's process group; the sandbox stays."""
    if len(args.names) != 1:
        raise _CliError(
            f"kill --command ID stops a command in one sandbox: give one NAME, not "
            f"{len(args.names)} (`{PROG} kill NAME --command ID`).",
            2,
        )
    [name] = args.names
    client = _client(args)
    try:
        sandbox = client.get_sandbox(name, resolve_timeout=30.0)
        try:
            result = sandbox.commands.kill(args.command_id)
        finally:
            sandbox.close_connection()  # it keeps running
    finally:
        client.close()
    if args.json:
        _print_json({"name": name, "command_id": args.command_id, "state": result.state,
                     "exit_code": result.exit_code})  # fmt: skip
    else:
        print(f"{name}: command {args.command_id} {result.state} (exit code {result.exit_code})")
    return 0


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
        raise _CliError(
            "run: --background starts the command and returns, so the sandbox must stay: "
            "add --sandbox NAME (an existing sandbox) or --keep (a new one, kept).",
            2,
        )
    if args.timeout == 0 and not args.background:
        raise _CliError(
            "run: --timeout 0 (no time limit) is for --background: a foreground run waits for "
            "its command. Pass --timeout SECONDS, or start it with --background --timeout 0 "
            "(with --sandbox NAME or --keep).",
            2,
        )


def _cmd_run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise _CliError(f"run: no command given; use `{PROG} run -- COMMAND [ARG...]`.", 2)
    _check_run_timeout(args)
    streams = (
        {} if args.json else {"on_stdout": _writer(sys.stdout), "on_stderr": _writer(sys.stderr)}
    )
    client = _client(args)
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
        raise _CliError(_cut_message(interrupts.cut or str(exc), made), 130) from None


def _last_delete(args: argparse.Namespace, name: str) -> bool:
    """Delete sandbox ``name`` on new connections (the old ones may be stuck: a lock an
    interrupted call left held), each request within :data:`LAST_DELETE_TIMEOUT`, not
    retried; whether that worked."""
    from ..client._client import BrokerSandboxClient

    settings = {k: v for k, v in _settings(args).items() if v is not None}
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
        return _everyday.run_kept(args, client, lambda sandbox: _start_in(args, sandbox, cmd))
    if args.sandbox is not None or args.keep:
        return _everyday.run_kept(
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
        _print_json({"sandbox": sandbox.name, "command_id": handle.command_id, "timeout": limit})
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
        raise _CliError(
            f"the command ran longer than --timeout {args.timeout:g}s and was killed; "
            "pass a larger --timeout.",
            124,
        ) from exc


def _run_done(args: argparse.Namespace, name: str, cmd: list[str], result: Any) -> int:
    """The end of ``run``: the result as JSON (``--json``), a hint for a shell command given
    as one word; the command's exit code."""
    if args.json:
        _print_result(args, name, result)
    hint = _everyday.shell_hint(cmd, int(result.exit_code))
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
        _print_json(
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


def _cmd_local(name: str, argv: list[str]) -> int:
    try:
        from . import _local
    except ImportError as exc:
        raise _CliError(
            f"`{PROG} {name}` needs the local broker, which could not be imported "
            f"({exc.name or exc}): install the [local] extra: {_LOCAL_EXTRA}"
        ) from exc
    function = _local.dev_main if name == "dev" else _local.demo_main
    return int(function(argv))


def _cmd_broker(args: argparse.Namespace) -> int:
    from ._broker import broker_main

    return broker_main(args.broker_command, args.config)


def _local_isolation() -> dict[str, str | None]:
    """What local sandboxes get here (doctor's line on them)."""
    from ._local import local_isolation_report

    return local_isolation_report()


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ..client.http._config import BrokerConnectionConfig
    from ._doctor import run_doctor

    report = run_doctor(lambda: BrokerConnectionConfig.from_env(**_settings(args)))
    report.checks = [  # an audience mismatch names where the URL came from: the flag
        dataclasses.replace(c, detail=_everyday.name_the_flag(c.detail, args))
        for c in report.checks
    ]
    report.notes = [_everyday.name_the_flag(note, args) for note in report.notes]
    report.local_isolation = _local_isolation()
    if args.json:
        _print_json(report.to_dict())
    else:
        print(report)
    return 0 if report.ok else 1


# ------------------------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> int:
    with warnings.catch_warnings():  # restored on return (main may run inside a program)
        warnings.showwarning = _show_warning
        return _main(argv)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """A warning as the CLI's own line (a broken plugin, ...): no file path or source line."""
    first, *more = _lines(str(message)) or [category.__name__]
    print(f"{PROG}: warning: {first}", file=sys.stderr)
    for rest in more:
        print(f"  {rest}", file=sys.stderr)


def _main(argv: Sequence[str] | None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] in ("dev", "demo"):
        # dispatched before parsing, so that `dev --help` reaches the dev command's own parser
        try:
            return _cmd_local(arguments[0], arguments[1:])
        except _CliError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return exc.code
    parser = _parser()
    arguments, command = _split_command(arguments)
    args = parser.parse_args(arguments)
    if command is not None:
        args.cmd = command
    if args.command is None:
        parser.print_help()
        return 2
    if args.command in ("dev", "demo"):
        handler = None
    else:
        handler = {
            "whoami": _cmd_whoami,
            "doctor": _cmd_doctor,
            "create": lambda a: _everyday.cmd_create(a, _client(a)),
            "run": _cmd_run,
            "ls": _cmd_ls,
            "kill": _cmd_kill,
            "extend": _cmd_extend,
            "files": _cmd_files,
            "shell": _cmd_shell,
            "broker": _cmd_broker,
            "port-forward": _cmd_port_forward,
        }[args.command]
    try:
        if handler is None:
            return _cmd_local(args.command, list(args.args))
        return handler(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except _CliError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.code
    except Exception as exc:
        if args.debug or os.environ.get("AGENT_SANDBOX_DEBUG"):
            raise
        first, *more = _lines(_everyday.name_the_flag(str(exc), args)) or [type(exc).__name__]
        for note in getattr(exc, "__notes__", ()):  # what else it says (a leftover to kill)
            more += _lines(str(note))
        more += _everyday.error_hints(exc, args)
        print(f"{PROG}: error: {type(exc).__name__}: {first}", file=sys.stderr)
        for line in more:  # indented: no line of a message can pass for a line of its own
            print(f"  {line}", file=sys.stderr)
        return 1


def _split_command(arguments: list[str]) -> tuple[list[str], list[str] | None]:
    """``shell``'s arguments without the command after its ``--`` (argparse would take that
    command's first word for the optional NAME), and that command (``None``: none given)."""
    at = 0  # the subcommand: the first word after the global options (and their values)
    while at < len(arguments) and arguments[at].startswith("-") and arguments[at] != "--":
        at += 2 if arguments[at] in ("--broker-url", "--ca-bundle") else 1
    if arguments[at : at + 1] != ["shell"] or "--" not in arguments[at:]:
        return arguments, None
    end = arguments.index("--", at)
    return arguments[:end], arguments[end + 1 :]


def _lines(message: str) -> list[str]:
    """A message's lines with their indentation (a list in a message stays a list), other
    runs of whitespace (tabs, CRs, ...) collapsed to one space, blank lines dropped."""
    lines = []
    for line in message.splitlines():
        if words := line.split():
            indent = len(line) - len(line.lstrip(" "))
            lines.append(" " * indent + " ".join(words))
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
