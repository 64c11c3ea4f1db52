"""The data plane: a caller's request to its own sandbox, forwarded, and the answer relayed.

Every decision is made on one checked target (:func:`._gate.data_request`), which is then
forwarded byte for byte: the caller is authenticated, the sandbox must be the caller's (``403``
for another identity's, ``404`` for none), bound to the claim the request names
(:func:`check_claim_binding`), granted the scope of the path, and Ready. The request goes where
the backend routes it (:meth:`.backends._interface.Backend.route`) without the caller's token,
cookies or the router's own headers; the answer streams back as it comes (:mod:`._relay`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.datastructures import Headers
from starlette.requests import HTTPConnection, Request
from starlette.types import Send

from ._errors import ApiError
from ._gate import BODYLESS, DataRequest, Gate, data_request
from ._metadata import DNS_LABEL
from ._ports import check_port_allowed, log_port_request, refuse_unsupported_upgrade
from ._relay import HOP_BY_HOP, Deleting, Relay, answer_headers
from ._target import CODE as TARGET_CODE
from ._unreachable import connect_failure, router_not_connected
from .backends._interface import READY, Backend, ClaimGone, ClaimState, Route, Unroutable
from .identity._policy import Caller, required_scope
from .identity._rules import PolicySource

_NOT_FORWARDED = (b"authorization", b"host", b"cookie", b"content-length")
"""Never forwarded (besides the hop-by-hop ones): the caller's credentials, the router's own
host, and the caller's framing (the router frames the body: :func:`_forwarded_body`)."""
_COMMAND_PATHS = ("/execute", "/commands")


def check_claim_binding(headers: Headers, state: ClaimState) -> None:
    """The claim <-> sandbox binding, on every data-plane request (after the owner check): a
    sandbox created through ``/rpc`` needs ``X-Sandbox-Claim-Name`` naming its claim; a ``/v1``
    sandbox's claim has the sandbox's own name."""
    header = headers.get("x-sandbox-claim-name")
    bound = state.claim_name or state.name
    if header is None:
        if state.claim_name is None:
            return
        raise ApiError(
            403,
            "claim_required",
            f"sandbox {state.name!r} was created through /rpc: send X-Sandbox-Claim-Name "
            "with the claim name that create returned",
        )
    if header != bound:
        raise ApiError(
            403,
            "claim_mismatch",
            f"claim {header[:63]!r} is not bound to sandbox {state.name!r}; send the claim "
            "name that create returned, and the sandbox name its status reported",
        )


class Forward:
    """The data-plane forward of one broker, over ``backend`` (``policies``: the callers'
    policies, which decide the ports of a port request: :mod:`._ports`)."""

    def __init__(self, backend: Backend, gate: Gate, policies: PolicySource) -> None:
        self.backend = backend
        self.gate = gate
        self.policies = policies

    async def handle(self, request: Request, send: Send) -> None:
        """Forward one data-plane request (it carries X-Sandbox-ID) and relay the answer."""
        refuse_unsupported_upgrade(request.headers)
        data = data_request(request)
        caller = await self.gate.authenticate(request)
        state = await self._ready_sandbox(request, caller, data)
        route = await self.route(state, data.port)
        await self._forward(request, send, state, route, data)

    async def route(self, state: ClaimState, port: int) -> Route:
        """Where a request to ``port`` of the checked sandbox ``state`` goes (the backend's
        :meth:`~.backends._interface.Backend.route`), or the broker's error saying why not."""
        try:
            return await self.backend.route(state, port)
        except Unroutable as exc:
            raise ApiError(502, "sandbox_unreachable", exc.detail) from None
        except ClaimGone:  # terminated since the checks
            raise ApiError(409, "terminating", f"sandbox {state.name!r} is being deleted") from None

    async def _ready_sandbox(
        self, request: HTTPConnection, caller: Caller, data: DataRequest
    ) -> ClaimState:
        """The Ready sandbox ``data`` names, if it is the caller's and may serve the request."""
        sandbox_id = data.sandbox_id
        state = await self._lookup(request.headers, data)
        if state is None or state.namespace != data.namespace:
            raise ApiError(
                404, "not_found", f"no sandbox {sandbox_id!r} in namespace {data.namespace!r}"
            )
        if state.owner.key != caller.key:
            raise ApiError(
                403,
                "not_owner",
                f"sandbox {sandbox_id!r} belongs to another identity; only its owner may use it",
            )
        check_claim_binding(request.headers, state)
        if data.port_request:
            check_port_allowed(self.policies, caller, state, data.port)
        scope = None if data.port_request else required_scope(data.target.path)
        if scope is not None and scope not in state.scopes:
            raise ApiError(
                403,
                "scope_denied",
                f"sandbox {sandbox_id!r} was not granted the {scope!r} scope (granted: "
                f"{sorted(state.scopes)}); request it at create, within the caller's policy",
            )
        if state.ending:
            raise ApiError(409, "terminating", f"sandbox {sandbox_id!r} is being deleted")
        if state.phase != READY or not state.bound:
            raise ApiError(
                409,
                "not_ready",
                f"sandbox {sandbox_id!r} is {state.phase}, not Ready; wait for Ready first",
            )
        return state

    async def _lookup(self, headers: Headers, data: DataRequest) -> ClaimState | None:
        """The sandbox X-Sandbox-ID names (from the backend's cache where it keeps one). An
        ``/rpc`` sandbox named apart from its claim (warm adoption) that the cache has not seen
        yet is found through the claim X-Sandbox-Claim-Name names, if bound to that sandbox."""
        state = await self.backend.get(data.sandbox_id, namespace=data.namespace, cached=True)
        claim = headers.get("x-sandbox-claim-name")
        if state is not None or claim is None or not DNS_LABEL.match(claim) or len(claim) > 63:
            return state
        found = await self.backend.find_claim(claim, namespace=data.namespace)
        if found is None or not found.bound or found.data_plane_name != data.sandbox_id:
            return None
        return found

    async def _forward(
        self, request: Request, send: Send, state: ClaimState, route: Route, data: DataRequest
    ) -> None:
        target = data.target
        # Built from parts: the request target is only ever the path (and query) of the URL,
        # never its authority (see _gate.origin_form), and exactly the bytes that were checked.
        url = httpx.URL(scheme=route.scheme, host=route.host, port=route.port, raw_path=target.raw)
        if url.raw_path != target.raw:  # checked_target refuses what httpx would rewrite
            raise ApiError(
                400,
                TARGET_CODE,
                f"the request path {target.path!r} is not in normal form: the router would "
                "send it changed",
            )
        headers = forwarded_headers(request.headers.raw)
        headers.extend(route.headers)
        content = _forwarded_body(request, headers)
        upstream = route.client.build_request(
            request.method,
            url,
            headers=headers,
            content=content,
            timeout=httpx.Timeout(connect=5.0, read=data.timeout, write=300.0, pool=10.0),
        )
        command = request.method == "POST" and target.path in _COMMAND_PATHS
        if data.port_request:
            command = False
            log_port_request(state.name, data.port, request.method)
        port = data.port if data.port_request else None
        response = await _send_upstream(route, upstream, state.name, command, data.timeout, port)
        try:
            chunks = response.aiter_raw()
            if port is not None:  # the router's answer that nothing listens: the broker's 502
                chunks = await router_not_connected(response, route, state.name, port)
            what = f"{request.method} {target.path}"
            deleting = self._deleting(state.name, state.namespace)
            relay = Relay(request.receive, send, state.name, what, deleting)
            start = {"status": response.status_code, "headers": answer_headers(response)}
            await send({"type": "http.response.start", **start})
            await relay.pump(chunks)
        finally:
            await response.aclose()

    def _deleting(self, name: str, namespace: str) -> Deleting:
        async def deleting() -> bool:
            state = await self.backend.get(name, namespace=namespace)
            return state is None or state.ending

        return deleting


def forwarded_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The caller's headers the router forwards: none of one hop, none of
    :data:`_NOT_FORWARDED` (the caller's credentials among them), no router header."""
    return [
        (k, v)
        for k, v in raw
        if k.decode("latin-1").lower() not in HOP_BY_HOP
        and k.lower() not in _NOT_FORWARDED
        and not k.lower().startswith(b"x-sandbox-")
    ]


def _forwarded_body(request: Request, headers: list[tuple[bytes, bytes]]) -> Any:
    """The body the router forwards, framed by the router, never by the client's own framing
    headers (``headers``: the forwarded ones, without them): none for a method without a body;
    a client's chunked body is sent chunked; a body the client sent with a ``Content-Length``
    (which the server read it by) with that length; no framing at all: empty."""
    if request.method in BODYLESS:
        return None
    if "transfer-encoding" not in request.headers:
        length = request.headers.get("content-length")
        if length is None:
            return b""
        headers.append((b"content-length", str(int(length)).encode()))

    async def body() -> AsyncIterator[bytes]:
        async for chunk in request.stream():
            if chunk:
                yield chunk

    return body()


async def _send_upstream(
    route: Route,
    upstream: httpx.Request,
    name: str,
    command: bool,
    read_timeout: float,
    port: int | None = None,
) -> httpx.Response:
    """Send ``upstream`` (counted if it runs a ``command``); its answer streams. A failure
    before the answer starts is the broker's 502 or 504, whose code says whether the request
    may have reached the sandbox: ``sandbox_unreachable`` (no connection: nothing was sent,
    nothing counted; for a port request, ``port``, whose connection was refused:
    ``port_not_listening``; what failed through a router: :mod:`._unreachable`),
    ``sandbox_answer_lost`` (the connection broke after the request was sent) or
    ``sandbox_timeout`` (sent, no answer in time)."""
    count = route.count_command if command else None
    if count is not None:
        count(1)
    try:
        return await route.client.send(upstream, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        if count is not None:
            count(-1)
        pooled = isinstance(exc, httpx.PoolTimeout)  # the broker's own pool: nothing failed
        failure = None if pooled else connect_failure(route, exc, name, port)
        if failure is not None:
            raise failure from None
        how = "" if isinstance(exc, httpx.ConnectError) else " (timed out)"
        to = f"port {port} of sandbox {name!r}" if port is not None else f"sandbox {name!r}"
        raise ApiError(502, "sandbox_unreachable", f"cannot connect to {to}{how}") from None
    except httpx.TimeoutException:
        raise ApiError(
            504,
            "sandbox_timeout",
            f"sandbox {name!r} did not answer within {read_timeout:g} s (X-Sandbox-Timeout); "
            "the request may have reached it",
        ) from None
    except httpx.HTTPError as exc:
        raise ApiError(
            502,
            "sandbox_answer_lost",
            f"the connection to sandbox {name!r} broke after the request was sent "
            f"({type(exc).__name__}): the request may have reached the sandbox",
        ) from None
