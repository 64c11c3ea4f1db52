"""A stand-in for an old sandbox runtime: the local runtime without the managed-command
endpoints and without the file API. ``/commands`` answers ``404`` with the body of the upstream
python runtime, a FastAPI app, for a route it does not have (``{"detail": "Not Found"}``, no
broker ``code``) and ``/fs/*`` ``404`` with a runtime-style body (``{"detail": ...}``), as
runtimes older than those protocols do (the deployed runtimes before v0.3.0); ``/execute`` and
the legacy file endpoints work. Started by a local broker from its template command line
(``--port {port}``)."""

from __future__ import annotations

import sys
import urllib.parse
from collections.abc import Callable
from typing import Any

from k8s_agent_sandbox_awx.broker.runtime import _fs, _runtime


def _without_commands(method: str) -> None:
    original: Callable[[Any], None] = getattr(_runtime._Handler, method)

    def handle(self: Any) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path == "/commands" or path.startswith("/commands/"):
            if self.command == "POST":
                self._drain()
            self._error(404, "Not Found")  # FastAPI's answer for a route it does not have
            return
        original(self)

    setattr(_runtime._Handler, method, handle)


if __name__ == "__main__":
    _fs.GET_ROUTES = frozenset()
    _fs.POST_ROUTES = frozenset()
    _without_commands("do_GET")
    _without_commands("do_POST")
    sys.exit(_runtime.main(sys.argv[1:]))
