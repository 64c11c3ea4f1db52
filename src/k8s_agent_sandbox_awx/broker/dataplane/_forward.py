"""The data plane: a caller's request to its own sandbox, forwarded, and the answer relayed.

Every decision is made on one checked target (:func:`._data_request.data_request`), which is then
forwarded byte for byte: the caller is authenticated, the sandbox must be the caller's (``403``
for another identity's, ``404`` for none), bound to the claim the request names
(:func:`check_claim_binding`), granted the scope of the path, and Ready. The request goes where
the backend routes it (:meth:`.backends._interface.Backend.route`) without the caller's token,
cookies or the router's own headers; the answer streams back as it comes (:mod:`._relay`). A
command start (``POST /execute``, ``POST /commands``) also carries the sandbox's environment
(its create's ``env``) in ``X-Sandbox-Env``, for the commands the runtime starts
(:mod:`.runtime._env`): no runtime is started with it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.types import Message, Send

from ..backends._http11 import Http11Answer, Http11Pool
from ..backends._interface import READY, Backend, ClaimGone, ClaimState, Route, Unroutable
from ..common._errors import ApiError
from ..common._gate import Gate
from ..common._metadata import DNS_LABEL
from ..common._route_names import PORT_ROUTE, data_route, method_label
from ..identity._policy import Caller, required_scope
from ..identity._rules import PolicySource
from ..runtime._env import HEADER as ENV_HEADER
from ..runtime._env import encode as encode_env
from ._data_request import BODYLESS, DataRequest, data_request
from ._ports import check_port_allowed, log_port_request, refuse_unsupported_upgrade
from ._relay import HOP_BY_HOP, Answer, Deleting, Relay, answer_headers, unrelayable
from ._target import CODE as TARGET_CODE
from ._target import Target
from ._unreachable import connect_failure, router_not_connected

_NOT_FORWARDED = (b"authorization", b"host", b"cookie", b"content-length")
"""Never forwarded (besides the hop-by-hop ones): the caller's credentials, the router's own
host, and the caller's framing (the router frames the body: :func:`_forwarded_body`)."""
_DROPPED = frozenset({name.encode("ascii") for name in HOP_BY_HOP}.union(_NOT_FORWARDED))
_COMMAND_PATHS = ("/execute", "/commands", "/code/execute")
"""The requests that run something (a ``POST``): counted (``Route.count_command``), and given
the sandbox's environment."""
SANDBOX_ENV_HEADER = ENV_HEADER.lower().encode("ascii")


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
        fix = "send the claim name that create returned, and the sandbox name its status reported"
        raise ApiError(
            403,
            "claim_mismatch",
            f"claim {header[:63]!r} is not bound to sandbox {state.name!r}; {fix}",
            logged=f"the claim X-Sandbox-Claim-Name names is not bound to sandbox "
            f"{state.name!r}; {fix}",
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
        url = None if isinstance(route.client, Http11Pool) else _httpx_url(route, target)
        if route.methods is not None and request.method not in route.methods:
            raise method_not_routed(request.method, route.methods, state.name)
        command = request.method == "POST" and target.path in _COMMAND_PATHS
        if data.port_request:
            command = False
            log_port_request(state.name, data.port, request.method)
        headers = forwarded_headers(request.headers.raw)
        headers.extend(route.headers)
        if command and state.env:  # the sandbox's environment: its commands', never the runtime's
            headers.append((SANDBOX_ENV_HEADER, encode_env(state.env).encode("ascii")))
        content = await _forwarded_body(request, headers)
        timeout = httpx.Timeout(connect=5.0, read=data.timeout, write=300.0, pool=10.0)
        sending = _sender(route, url, request.method, target, headers, content, timeout)
        port = data.port if data.port_request else None
        response = await _send_upstream(route, sending, state.name, command, data.timeout, port)
        try:  # the router's own 502 and 504 about the sandbox: the broker's (_unreachable)
            refused = unrelayable(response.status_code, state.name)
            if refused is not None:
                raise refused
            chunks = await router_not_connected(response, route, state.name, port)
            whole = response.whole_body() if isinstance(response, Http11Answer) else None
            start = {"status": response.status_code, "headers": answer_headers(response)}
            await send({"type": "http.response.start", **start})
            if whole is not None:  # all here: nothing to relay as it comes
                await send({"type": "http.response.body", "body": whole, "more_body": False})
                return
            what = request_named(request.method, target.path, data.port_request)
            deleting = self._deleting(state.name, state.namespace)
            await Relay(request.receive, send, state.name, what, deleting).pump(chunks)
        finally:
            await response.aclose()

    def _deleting(self, name: str, namespace: str) -> Deleting:
        async def deleting() -> bool:
            state = await self.backend.get(name, namespace=namespace)
            return state is None or state.ending

        return deleting


def request_named(method: str, path: str, port_request: bool) -> str:
    """A data-plane request as the broker's messages name it: its method and route template
    (``GET {data} /download/{path}``, ``POST {data} port``), never its raw path (a file's name,
    a user's server's ``/reset/<code>``)."""
    return f"{method_label(method)} {PORT_ROUTE if port_request else data_route(path)}"


def method_not_routed(method: str, methods: frozenset[str], name: str) -> ApiError:
    """The ``405`` of a method the route's router does not proxy (``Route.methods``), before
    anything is sent (the router's own ``405`` would read as the sandbox's)."""
    usual: tuple[str, ...] = ("GET", "POST", "PUT", "DELETE", "PATCH")
    allowed = [m for m in usual if m in methods] + sorted(methods - set(usual))
    return ApiError(
        405,
        "method_not_routed",
        f"{method} requests to sandbox {name!r} cannot go through the cluster's sandbox router, "
        f"which forwards only {', '.join(allowed)}: send GET instead of HEAD (and answer "
        "OPTIONS in your client), or ask the broker's operator for the pod data plane "
        '(backend.kubernetes.data_plane = "pod")',
        {"Allow": ", ".join(allowed)},
    )


def forwarded_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The caller's headers the router forwards: none of one hop, none of
    :data:`_NOT_FORWARDED` (the caller's credentials among them), no router header."""
    return [
        (k, v)
        for k, v in raw
        if (name := k.lower()) not in _DROPPED and not name.startswith(b"x-sandbox-")
    ]


async def _forwarded_body(request: Request, headers: list[tuple[bytes, bytes]]) -> Any:
    """The body the router forwards, framed by the router, never by the client's own framing
    headers (``headers``: the forwarded ones, without them): none for a method without a body;
    a client's chunked body is sent chunked; a body the client sent with a ``Content-Length``
    (which the server read it by) with that length; no framing at all: empty. A body whose
    whole arrived with the request's head (a command's JSON, as a rule) is bytes, sent in one
    write with the head; a longer one streams as it comes. A caller gone before its body's
    first message is :class:`ClientDisconnect` here, before a connection is made."""
    if request.method in BODYLESS:
        return None
    if "transfer-encoding" not in request.headers:
        length = request.headers.get("content-length")
        if length is None:
            return b""
        headers.append((b"content-length", str(int(length)).encode()))
    first = await request.receive()
    if first["type"] == "http.disconnect":  # gone before its body: nothing is sent, or counted
        raise ClientDisconnect()
    if not first.get("more_body", False):
        return bytes(first.get("body", b""))
    return _body_from(request, first)


async def _body_from(request: Request, message: Message) -> AsyncIterator[bytes]:
    """The rest of the request's body as it arrives, from its first ``message``."""
    while True:
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return
        message = await request.receive()


def _httpx_url(route: Route, target: Target) -> httpx.URL:
    """The URL httpx sends ``target`` to, built from parts: the request target is only ever
    the path (and query) of the URL, never its authority (see common._gate.origin_form), and
    exactly the bytes that were checked (the broker's own connections send them as they are)."""
    url = httpx.URL(scheme=route.scheme, host=route.host, port=route.port, raw_path=target.raw)
    if url.raw_path != target.raw:  # checked_target refuses what httpx would rewrite
        raise ApiError(
            400,
            TARGET_CODE,
            f"the request path {target.path!r} is not in normal form: the router would "
            "send it changed",
        )
    return url


def _sender(
    route: Route,
    url: httpx.URL | None,
    method: str,
    target: Target,
    headers: list[tuple[bytes, bytes]],
    content: Any,
    timeout: httpx.Timeout,
) -> Callable[[], Awaitable[Answer]]:
    """How the request is sent: over the route's own HTTP/1.1 connections
    (:class:`.backends._http11.Http11Pool`: the target sent as its bytes), or with httpx to
    ``url`` (:func:`_httpx_url`)."""
    client = route.client
    if isinstance(client, Http11Pool):
        verb = method.encode("ascii")
        return lambda: client.send(verb, target.raw, headers, content, timeout)
    assert url is not None  # _httpx_url's, for every httpx route
    upstream = client.build_request(method, url, headers=headers, content=content, timeout=timeout)
    return lambda: client.send(upstream, stream=True)


async def _send_upstream(
    route: Route,
    sending: Callable[[], Awaitable[Answer]],
    name: str,
    command: bool,
    read_timeout: float,
    port: int | None = None,
) -> Answer:
    """Send the request (``sending()``; counted if it runs a ``command``); its answer streams.
    A failure before the answer starts is the broker's 502 or 504, whose code says whether
    the request may have reached the sandbox: ``sandbox_unreachable`` (no connection: nothing
    was sent, nothing counted; for a port request, ``port``, whose connection was refused:
    ``port_not_listening``; what failed through a router: :mod:`._unreachable`),
    ``sandbox_answer_lost`` (the connection broke after the request was sent) or
    ``sandbox_timeout`` (sent, no answer in time). Both clients raise httpx's exceptions."""
    count = route.count_command if command else None
    if count is not None:
        count(1)
    try:
        return await sending()
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
