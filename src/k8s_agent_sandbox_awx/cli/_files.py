"""``files``: a sandbox's files, ``ls``, ``get``, ``put``, ``rm`` (its parser and its
commands).

Imports of the client are deferred to the command that needs them (``--help`` stays fast)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from . import _connect
from ._common import json_option, print_json

__all__ = ["add_parser", "cmd_files"]

_NAME_HELP = "the sandbox's name (from `ls`, `create` or `run --keep`)"
_PATH_HELP = "a path in the sandbox: relative to /app, or /app/... or /workspace/..."


def add_parser(commands: Any) -> None:
    """``files`` and its actions, on the CLI's sub-commands ``commands``."""
    files = commands.add_parser("files", help="the files of a sandbox: ls, get, put, rm")
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


def cmd_files(args: argparse.Namespace) -> int:
    from ..client._client import Sandbox

    client = _connect.client(args)
    try:
        sandbox = Sandbox(client, client.get_info(args.name))
        return _FILES[args.files_command](args, sandbox.files)
    finally:
        client.close()


def _files_ls(args: argparse.Namespace, files: Any) -> int:
    entries = files.list(args.path)
    if args.json:
        print_json([entry.to_dict() for entry in entries])
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
        print_json({"path": args.path, "destination": dest, "bytes": written})
    else:
        print(f"{args.path} -> {dest} ({written} bytes)")
    return 0


def _files_put(args: argparse.Namespace, files: Any) -> int:
    info = files.write_from(args.path or os.path.basename(args.local), args.local)
    if args.json:
        print_json(info.to_dict())
    else:
        print(f"{args.local} -> {info.path} ({info.size} bytes)")
    return 0


def _files_rm(args: argparse.Namespace, files: Any) -> int:
    removed = files.remove(args.path, recursive=args.recursive)
    if args.json:
        print_json({"path": args.path, "removed": removed})
    else:
        print(f"{args.path}: {'removed' if removed else 'did not exist'}")
    return 0


_FILES: dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "ls": _files_ls,
    "get": _files_get,
    "put": _files_put,
    "rm": _files_rm,
}
