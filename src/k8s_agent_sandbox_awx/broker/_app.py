"""The broker's ASGI application: routing, and the parts it routes to.

One URL serves the issuers' documents (``/issuers/<name>/...``, the local broker's own
issuers), the control plane in the dialects it is configured for (``/v1/...``:
:mod:`.control._v1`; ``POST /rpc``: :mod:`.control._rpc`; both over :mod:`.control._claims`)
and the data plane (any request that carries ``X-Sandbox-ID``: :mod:`.dataplane._forward`).
Every request passes the gate first (:mod:`.common._gate`). Everything runs on the broker's
event loop; what the backend keeps (:mod:`.backends._interface`) is the only state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .backends._interface import Backend, BackendUnavailable
from .common._errors import BACKEND_RETRY_AFTER, ApiError
from .common._gate import Gate, origin_form
from .common._observed import note_error
from .control._claims import Claims
from .control._rpc import Rpc
from .control._v1 import V1
from .dataplane._forward import Forward
from .dataplane._websocket import WebSocketForward, refuse
from .dataplane._ws_limits import WebSocketLimits
from .identity._issuer import PublishedIssuer
from .identity._rules import PolicySource
from .identity._verify import TokenVerifier

PROTOCOLS = ("v1", "rpc")
"""The control-plane dialects a broker can serve."""


def plane_of(scope: Scope, protocols: tuple[str, ...]) -> str:
    """Where a request goes: ``"data"`` (it carries X-Sandbox-ID and is no control-plane
    request), ``"issuer"``, ``"v1"``, ``"rpc"``, or ``""`` (no route: 404)."""
    path: str = scope["path"]
    is_control = path == "/v1" or path.startswith("/v1/")
    is_rpc = path == "/rpc" and "rpc" in protocols
    if not is_control and not is_rpc and "x-sandbox-id" in Headers(scope=scope):
        return "data"
    if path.startswith("/issuers/") and scope.get("method") == "GET":  # a WebSocket has none
        return "issuer"
    if is_control and "v1" in protocols:
        return "v1"
    if is_rpc:
        return "rpc"
    return ""


class BrokerApp:
    """The ASGI application of one broker: callers verified by ``verifier``, admitted by
    ``policies``, their sandboxes in ``backend``; the control-plane dialects of ``protocols``;
    ``issuer_by_name``: the issuers whose documents it serves (the local broker's);
    ``websocket_limits``: the bounds on the WebSockets it relays (default: the defaults)."""

    def __init__(
        self,
        *,
        verifier: TokenVerifier[Any],
        policies: PolicySource,
        backend: Backend,
        protocols: tuple[str, ...] = PROTOCOLS,
        issuer_by_name: Callable[[str], PublishedIssuer | None] | None = None,
        websocket_limits: WebSocketLimits | None = None,
    ) -> None:
        self.protocols = protocols
        self.backend = backend
        self._issuer_by_name = issuer_by_name
        self.gate = Gate(verifier)
        self.verifier = verifier
        self.claims = Claims(backend, policies)
        self.v1 = V1(self.claims, self.gate)
        self.rpc = Rpc(self.claims, self.gate)
        self.forward = Forward(backend, self.gate, policies)
        self.websocket = WebSocketForward(self.forward, websocket_limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            origin_form(scope)
            plane = plane_of(scope, self.protocols)
            if plane == "data":
                await self.forward.handle(request, send)
                return
            if plane == "issuer":
                response = self._issuer_document(scope["path"])
            elif plane == "v1":
                response = await self.v1.handle(request)
            elif plane == "rpc":
                response = await self.rpc.handle(request)
            else:
                raise self._no_route(request.method, scope["path"])
        except ApiError as exc:
            note_error(exc.code, exc.logged)
            response = exc.response()
        except BackendUnavailable as exc:
            outage = ApiError(
                503,
                "backend_unavailable",
                exc.detail,
                {"Retry-After": str(BACKEND_RETRY_AFTER)},
            )
            note_error(outage.code, outage.detail)
            response = outage.response()
        except ClientDisconnect:
            return
        await response(scope, receive, send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket handshake: proxied to a sandbox's port if it is a data-plane one
        (:mod:`.dataplane._websocket`), else ``404 not_found`` (no control-plane route takes
        WebSockets)."""
        if plane_of(scope, self.protocols) == "data":
            await self.websocket.handle(scope, receive, send)
            return
        only = "only a port request (X-Sandbox-ID, X-Sandbox-Port: your server's port) takes"
        no_route = ApiError(
            404,
            "not_found",
            f"no WebSocket route at {scope['path'][:200]}: {only} WebSockets",
            logged=f"no WebSocket route at this path: {only} WebSockets",
        )
        await refuse(send, no_route)

    def _no_route(self, method: str, path: str) -> ApiError:
        served = " and ".join(
            {"v1": "/v1/ (v1 dialect)", "rpc": "POST /rpc (rpc dialect)"}[p] for p in self.protocols
        )
        where = f"this broker's control plane is {served}; data-plane requests carry X-Sandbox-ID"
        return ApiError(
            404,
            "not_found",
            f"no route for {method} {path}: {where}",
            logged=f"no route for this request: {where}",
        )

    def _issuer_document(self, path: str) -> Response:
        _, _, rest = path.partition("/issuers/")
        name, _, doc = rest.partition("/")
        issuer = self._issuer_by_name(name) if self._issuer_by_name is not None else None
        if issuer is not None and doc == ".well-known/openid-configuration":
            return JSONResponse(issuer.openid_configuration())
        if issuer is not None and doc == "jwks":
            return JSONResponse(issuer.jwks())
        raise ApiError(404, "not_found", f"no issuer document at {path}")

    async def shutdown(self) -> None:
        """End what this broker owns (the backend's :meth:`~.backends._interface.Backend.close`)
        and the verifier's connections."""
        await self.backend.close()
        await self.gate.close()
