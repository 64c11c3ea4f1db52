"""A stand-in for an old sandbox runtime: the local runtime without the managed-command
endpoints, without the file API and without code contexts. ``/commands`` and ``/code/*`` answer
``404`` with the body of the upstream python runtime, a FastAPI app, for a route it does not
have (``{"detail": "Not Found"}``, no broker ``code``) and ``/fs/*`` ``404`` with a
runtime-style body (``{"detail": ...}``), as runtimes older than those protocols do (the
deployed runtimes before v0.3.0; upstream's python runtime has no ``/code`` at all);
``/execute`` and the legacy file endpoints work. Started by a local broker from its template
command line (``--port {port}``)."""

from __future__ import annotations

import sys
from typing import Any

from k8s_agent_sandbox_awx.broker.runtime import _http, _main, _server


def _not_found(handler: Any) -> None:
    if handler.command == "POST":
        _http.drain(handler)
    _http.send_json(handler, 404, {"detail": "Not Found"})  # FastAPI's answer for a route it
    # does not have


if __name__ == "__main__":
    for key in [k for k in _server.EXACT if k[1].startswith("/fs/")]:
        del _server.EXACT[key]  # no file API: "no route for GET /fs/..."
    for method in ("GET", "POST"):
        _server.EXACT[(method, "/commands")] = _not_found
    _server.PREFIXES[:] = [
        (method, prefix, _not_found if prefix in ("/commands/", "/code/") else endpoint)
        for method, prefix, endpoint in _server.PREFIXES
    ]
    sys.exit(_main.main(sys.argv[1:]))
