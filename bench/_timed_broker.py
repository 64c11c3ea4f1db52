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

from k8s_agent_sandbox_awx.broker.backends.kubernetes import _api, _informer
from k8s_agent_sandbox_awx.broker.server import _run
from k8s_agent_sandbox_awx.cli import _cli

_fd = -1


def _emit(*event: Any) -> None:
    os.write(_fd, (json.dumps(event) + "\n").encode())


def _ready(obj: dict[str, Any]) -> bool:
    for condition in (obj.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def _timed_app(app: Any) -> Any:
    async def timed(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        began = time.perf_counter()

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                # before the last bytes go out: the client may be done before send returns
                _emit("http", scope["method"], scope["path"], began, time.perf_counter())
            await send(message)

        return await app(scope, receive, sending)

    return timed


def _install() -> None:
    request = _api.KubeClient._request

    async def timed_request(self: Any, call: Any) -> dict[str, Any]:
        began = time.perf_counter()
        try:
            return await request(self, call)
        finally:
            name = call.name
            if name is None and call.verb == "create" and call.body:
                name = (json.loads(call.body).get("metadata") or {}).get("name")
            _emit("api", call.verb, name, began, time.perf_counter())

    put = _informer.ClaimCache._put

    def timed_put(self: Any, obj: dict[str, Any]) -> None:
        put(self, obj)
        _emit("cache", obj["metadata"]["name"], _ready(obj), time.perf_counter())

    probes = _run.with_probes
    _api.KubeClient._request = timed_request  # type: ignore[method-assign]
    _informer.ClaimCache._put = timed_put  # type: ignore[method-assign]
    _run.with_probes = lambda app, *checks: probes(_timed_app(app), *checks)  # type: ignore[assignment]


if __name__ == "__main__":
    _fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    _install()
    sys.exit(_cli.main(sys.argv[2:]))
