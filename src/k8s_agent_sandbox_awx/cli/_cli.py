"""``agent-sandbox-awx``: whoami, doctor, explain, run, shell, ls, kill, extend, files, broker
(check, serve), mcp (from the [mcp] extra) and dev/demo (from the [local] extra).

Imports are deferred to the subcommand that needs them, so ``--help`` and ``--version`` are
fast and never fail for a missing optional dependency. Errors print ``agent-sandbox-awx: error:``
and the message (a list in it stays one item per line, indented) and exit non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import _explain, _files, _hints, _kept, _mcp, _port_forward, _run
from ._common import PROG, finish_subcommands, json_option, ready_timeout_option, template_option
from ._common import CliError as _CliError
from ._common import print_json as _print_json
from ._common import seconds as _seconds
from ._connect import INSECURE_FLAG
from ._connect import client as _client
from ._connect import settings as _settings
from ._messages import cli_message

if TYPE_CHECKING:
    pass

__all__ = ["main"]

# from a clone: the index has an unrelated package of this name until a release exists
_LOCAL_EXTRA = (
    'python3 -m pip install -e ".[local]" in a clone of the k8s-agent-sandbox-awx repository'
)


def _parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Kubernetes agent sandboxes through an OIDC identity broker.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    global_options(parser, None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _subcommands(sub)
    _mcp.add_parser(sub)
    _explain.add_parser(sub)
    finish_subcommands(parser, global_options)
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
        INSECURE_FLAG,
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
    _kept.create_subcommand(sub)
    _run.add_parser(sub)
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
    _files.add_parser(sub)
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


def _shell_subcommand(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", metavar="NAME", help="the sandbox (or --new)")
    p.add_argument("--new", action="store_true", help="create a sandbox for the session")
    p.add_argument("--keep", action="store_true", help="with --new: keep it after the session")
    template_option(p, "with --new: its template (as for run)")
    ready_timeout_option(p, "with --new: seconds to wait for the sandbox to become ready")
    p.usage = "%(prog)s [-h] [NAME | --new [--keep] [--template T]] [-- COMMAND [ARG...]]"
    p.epilog = "-- COMMAND [ARG...]: what the terminal runs (default: the sandbox's login shell)"
    p.set_defaults(cmd=[])  # the words after `--`: split off before parsing (see _split_command)


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
                print(_hints.kill_warning(name), file=sys.stderr)
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
        _print_json(
            {
                "name": name,
                "command_id": args.command_id,
                "state": result.state,
                "exit_code": result.exit_code,
            }
        )
    else:
        print(f"{name}: command {args.command_id} {result.state} (exit code {result.exit_code})")
    return 0


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


def _cmd_mcp(args: argparse.Namespace) -> int:
    return _mcp.run(args, _settings)


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

    report = run_doctor(lambda: BrokerConnectionConfig.from_env(**_settings(args)), args)
    report.checks = [  # an audience mismatch names where the URL came from: the flag
        dataclasses.replace(c, detail=_hints.name_the_flag(c.detail, args)) for c in report.checks
    ]
    report.notes = [_hints.name_the_flag(note, args) for note in report.notes]
    from ._ci import ci_name

    if ci_name() is None:  # a CI job runs no local sandboxes: the line would mean nothing there
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
            "explain": lambda a: _explain.run(a, _settings),
            "create": lambda a: _kept.cmd_create(a, _client(a)),
            "run": _run.cmd_run,
            "ls": _cmd_ls,
            "kill": _cmd_kill,
            "extend": _cmd_extend,
            "files": _files.cmd_files,
            "shell": _cmd_shell,
            "broker": _cmd_broker,
            "port-forward": _cmd_port_forward,
            "mcp": _cmd_mcp,
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
        said = _hints.name_the_flag(cli_message(exc, args), args)  # flags, not keywords
        first, *more = _lines(said) or [type(exc).__name__]
        for note in getattr(exc, "__notes__", ()):  # what else it says (a leftover to kill)
            more += _lines(str(note))
        more += _hints.error_hints(exc, args)
        print(f"{PROG}: error: {first}", file=sys.stderr)
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
