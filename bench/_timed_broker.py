"""``broker serve`` with timestamps, for bench_kubernetes.py's decomposition of (a).

Run: ``python bench/_timed_broker.py TIMINGS_FILE broker serve --config FILE``. Before the CLI
starts, three wrappers are put around the broker's own code (nothing else changes):

- the ASGI app (inside the probes): ``http`` (method, path, arrival, its answer's last bytes
  handed to the server);
- ``KubeClient._request``, every unary API call: ``api`` (verb, claim name, start, end);
- ``ClaimCache._put``, every claim the cache's watch delivers: ``cache`` (name, Ready, time).

Each event is one JSON line appended to ``TIMINGS_FILE`` as it happens (one ``write``);
times are ``time.perf_counter()``, the system's monotonic clock, which the bench process reads
alike. The benchmark never uses this in production configurations; tests do not either.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any
from unittest import mock

from k8s_agent_sandbox_awx.broker.backends.kubernetes import _api, _api_request, _informer
from k8s_agent_sandbox_awx.broker.server import _probes, _run
from k8s_agent_sandbox_awx.cli import _cli

_fd = -1


def _emit(*event: Any) -> None:
    os.write(_fd, (json.dumps(event) + "\n").encode())


def _ready(obj: dict[str, Any]) -> bool:
    for condition in (obj.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def _timed_app(app: _probes.ASGIApp) -> _probes.ASGIApp:
    async def timed(scope: _probes.Scope, receive: _probes.Receive, send: _probes.Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        began = time.perf_counter()

        async def sending(message: _probes.Scope) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                # before the last bytes go out: the client may be done before send returns
                _emit("http", scope["method"], scope["path"], began, time.perf_counter())
            await send(message)

        await app(scope, receive, sending)

    return timed


def _install() -> None:
    request = _api.KubeClient._request

    async def timed_request(self: _api.KubeClient, call: _api_request.Call) -> dict[str, Any]:
        began = time.perf_counter()
        try:
            return await request(self, call)
        finally:
            name = call.name
            if name is None and call.verb == "create" and call.body:
                name = (json.loads(call.body).get("metadata") or {}).get("name")
            _emit("api", call.verb, name, began, time.perf_counter())

    put = _informer.ClaimCache._put

    def timed_put(self: _informer.ClaimCache, obj: dict[str, Any]) -> None:
        put(self, obj)
        _emit("cache", obj["metadata"]["name"], _ready(obj), time.perf_counter())

    def timed_probes(
        app: _probes.ASGIApp,
        ready: _probes.ReadinessCheck | None = None,
        degraded: _probes.ReadinessCheck | None = None,
    ) -> _probes.ASGIApp:
        return _probes.with_probes(_timed_app(app), ready, degraded)

    # for the process's life (never stopped); _run looks with_probes up in its own namespace
    mock.patch.object(_api.KubeClient, "_request", timed_request).start()
    mock.patch.object(_informer.ClaimCache, "_put", timed_put).start()
    mock.patch.object(_run, "with_probes", timed_probes).start()


if __name__ == "__main__":
    _fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    _install()
    sys.exit(_cli.main(sys.argv[2:]))
