"""What ``agent-sandbox-awx broker serve`` serves, built from the configuration.

PLACEHOLDER (issue 21): the broker app over a backend interface is being built (issue 20,
phase B2); until it lands, :func:`app_factory` serves an app that answers every broker route
``503 unavailable`` ("backend not wired yet") and is never ready. The lead replaces this one
function with the real broker app and its readiness check (issuers with keys loaded, backend
reachable).
"""

from __future__ import annotations

import json

from .config import BrokerConfig
from .server import ServedApp
from .server._probes import Receive, Scope, Send

__all__ = ["app_factory"]


def app_factory(config: BrokerConfig) -> ServedApp:
    """PLACEHOLDER: the app ``broker serve`` runs for ``config`` (see the module docstring)."""
    detail = (
        f"the broker's {config.backend.kind} backend is not wired yet: this build of "
        "`agent-sandbox-awx broker serve` runs a placeholder app (issue 21)"
    )
    body = json.dumps({"detail": detail, "code": "unavailable"}).encode()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (event := (await receive())["type"]) != "lifespan.shutdown":
                if event == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"agent-sandbox-broker-error", b"unavailable"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return ServedApp(app, lambda: {"backend": "not wired yet (placeholder app)"})
