"""The local sandbox runtime: one process per sandbox, speaking the legacy python-runtime protocol.

Run as ``python -m k8s_agent_sandbox_awx.broker.runtime --port PORT --base-dir DIR`` (one
runtime: :mod:`._server`), or with ``--fork-server`` (the local backend's fork server, which
forks one runtime per sandbox: :mod:`._forkserver`). It uses the standard library only
(``python-multipart`` is imported on the first upload), so it starts in a few tens of
milliseconds.

The modules, each named for what it holds: :mod:`._server` (the one HTTP server and its route
table), :mod:`._http` (reading and answering a request), :mod:`._paths` (the roots and the one
path resolver), :mod:`._multipart` (the one multipart reader), :mod:`._files`,
:mod:`._file_api` and :mod:`._watch` (the file API), :mod:`._legacy` (``/execute`` and the
legacy file endpoints), :mod:`._command` and :mod:`._commands` (managed commands),
:mod:`._pty` (managed commands on a pseudo-terminal),
:mod:`._process` (dying with the parent), :mod:`._forkserver`, :mod:`._tree` (removing trees).

The process dies with its parent: ``PR_SET_PDEATHSIG`` (Linux) plus a thread that watches the
parent pid. On ``SIGTERM`` it kills the process groups of running commands and exits.

NO ISOLATION: commands run as host processes with the user's privileges. Development and tests
only.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import _process, _server
from ._forkserver import fork_server
from ._process import PARENT_PID_ENV


def safe_import_path(base_dir: str, path: list[str] | None = None) -> None:
    """Drop from the import path (``sys.path``) every entry that names the working directory
    or the base directory: ``''`` (``python -c``), the directory itself (``python -m``, as the
    runtime's image starts it, from ``/app``) and relative entries. A caller who may write files
    there (the ``files`` scope) would otherwise have the runtime import its ``ctypes.py`` on the
    runtime's next lazy import, and run its code without the ``commands`` scope. The directory
    this package was imported from is kept (it is not the sandbox's)."""
    entries = sys.path if path is None else path
    package_parent = os.path.realpath(os.path.join(os.path.dirname(__file__), *[".."] * 3))
    unsafe = {os.path.realpath(os.getcwd()), os.path.realpath(base_dir)} - {package_parent}
    entries[:] = [
        entry
        for entry in entries
        if entry and os.path.isabs(entry) and os.path.realpath(entry) not in unsafe
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default: $PORT, else 8888")
    parser.add_argument(
        "--port-file",
        default=os.environ.get("SANDBOX_PORT_FILE") or None,
        help="listen on a port the system picks (unless --port) and write it to this file",
    )
    parser.add_argument(
        "--unix-socket",
        default=None,
        help="listen on this Unix socket instead of a TCP port (an isolated sandbox's runtime)",
    )
    parser.add_argument("--base-dir", default=os.environ.get("SANDBOX_BASE_DIR", os.getcwd()))
    parser.add_argument(
        "--fork-server",
        action="store_true",
        help="read spawn requests (JSON lines) on stdin and fork one runtime per request",
    )
    args = parser.parse_args(argv)
    if args.fork_server:
        return fork_server()
    safe_import_path(args.base_dir)
    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        _process.die_with_parent(int(parent))
    port = args.port
    if port is None:
        port = 0 if args.port_file else int(os.environ.get("PORT") or "8888")
    _server.serve(args.host, port, args.base_dir, args.port_file, args.unix_socket)
    return 0
