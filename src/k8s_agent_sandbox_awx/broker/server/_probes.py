"""``/healthz`` and ``/readyz``: the probes, answered in front of the broker's app.

``/healthz`` is 200 while the process serves. ``/readyz`` asks the app's readiness check: a
callable returning what is not ready (a mapping ``{component: why}``; empty: ready), plain or
awaitable; 200 when it is empty, else 503 with that mapping as JSON. An optional second check
returns what is degraded but does not make the app unready (one issuer's outage: every replica
sees it, so failing readiness could not help): named in the 200's body as ``degraded``. A
check that fails or does not answer within :data:`READINESS_TIMEOUT` seconds counts as not
ready (and is logged). Both answer GET and HEAD without authentication; every other path goes
to the app.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Final

__all__ = ["READINESS_TIMEOUT", "ASGIApp", "ReadinessCheck", "with_probes"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.server")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ReadinessCheck = Callable[[], Mapping[str, str] | Awaitable[Mapping[str, str]]]
"""What is not ready, ``{component: why}`` (``{}``: ready), e.g. ``{"issuer cluster": "no
keys loaded yet"}``."""

READINESS_TIMEOUT: Final = 5.0

PROBES: Final = ("/healthz", "/readyz")


async def _not_ready(ready: ReadinessCheck | None) -> dict[str, str]:
    if ready is None:
        return {}
    try:
        answer = ready()
        if inspect.isawaitable(answer):
            answer = await asyncio.wait_for(answer, READINESS_TIMEOUT)
    except TimeoutError:
        log.error("the readiness check did not answer within %gs", READINESS_TIMEOUT)
        return {"readiness": f"the readiness check did not answer within {READINESS_TIMEOUT:g}s"}
    except Exception as exc:
        log.exception("the readiness check failed")
        return {"readiness": f"the readiness check failed: {type(exc).__name__}: {exc}"}
    return {str(name): str(why) for name, why in answer.items()}


async def _answer(
    send: Send, status: int, body: dict[str, Any], head: bool, **headers: str
) -> None:
    data = json.dumps(body, sort_keys=True).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"cache-control", b"no-store"),
        *((name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": b"" if head else data})


def with_probes(
    app: ASGIApp, ready: ReadinessCheck | None = None, degraded: ReadinessCheck | None = None
) -> ASGIApp:
    """``app`` with ``/healthz`` and ``/readyz`` answered in front of it (``ready``: the app's
    readiness check; ``None``: always ready; ``degraded``: what is degraded, shown while
    ready)."""

    async def probes(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in PROBES:
            await app(scope, receive, send)
            return
        method = scope.get("method", "GET")
        head = method == "HEAD"
        if method not in ("GET", "HEAD"):
            body = {"detail": "the probes answer GET and HEAD", "code": "method_not_allowed"}
            await _answer(send, 405, body, head, allow="GET, HEAD")
        elif scope["path"] == "/healthz":
            await _answer(send, 200, {"status": "alive"}, head)
        elif not_ready := await _not_ready(ready):
            await _answer(send, 503, {"status": "not ready", "not_ready": not_ready}, head)
        elif degraded is not None and (worse := await _not_ready(degraded)):
            await _answer(send, 200, {"status": "ready", "degraded": worse}, head)
        else:
            await _answer(send, 200, {"status": "ready"}, head)

    return probes
