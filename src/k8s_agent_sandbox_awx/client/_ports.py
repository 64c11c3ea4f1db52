"""``sandbox.ports``: the servers a sandbox runs on its own ports, reached through the broker.

A request to port ``P`` of a sandbox is a data-plane request to the broker with the router
headers (``X-Sandbox-ID``, ``X-Sandbox-Namespace``, ``X-Sandbox-Port: P``; under ``/rpc`` also
``X-Sandbox-Claim-Name``) and the caller's token (``Authorization: Bearer``), which the broker
checks and strips (docs/client.md, "Ports"). :class:`Ports` (and :class:`AsyncPorts`) make
such requests easy: ``client(port)`` (an httpx client), ``url(port, path)`` (for a tool that
sends its own headers), ``forward(port)`` (a local listener that needs no token at all,
:mod:`._port_forward`) and ``get_host(port)`` (E2B's name: a refusal that says what to use).

The broker's own refusals of a port request (it carries the ``Agent-Sandbox-Broker-Error``
header, which no answer of the sandbox's server can carry) are raised as typed errors
(:func:`broker_refusal`): nothing listens on the port (:class:`~..errors.PortNotListeningError`),
the policy forbids it (:class:`~..errors.PortNotAllowedError`), another identity's sandbox...
Every other answer, errors included, is the server's, returned as it is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Generator
from typing import TYPE_CHECKING, Any, NoReturn

import httpx

from .._fix import Fix, Say, attach
from ..errors import (
    BrokerAuthenticationError,
    BrokerConflictError,
    BrokerError,
    BrokerNotFoundError,
    BrokerPermissionError,
    BrokerUnavailableError,
    PortNotAllowedError,
    PortNotListeningError,
    UnsupportedOperationError,
)
from .http._client_settings import client_settings

if TYPE_CHECKING:
    from ..credentials._auth import CredentialSource
    from ._port_forward import PortForward

__all__ = ["BROKER_ERROR_HEADER", "PortAuth", "Ports", "PortsBase", "broker_refusal", "check_port"]

BROKER_ERROR_HEADER = "agent-sandbox-broker-error"
"""The mark of the broker's own answers (docs/broker-api.md, "Errors")."""
HEADERS_NEEDED = (
    "Authorization: Bearer <token>, X-Sandbox-ID, X-Sandbox-Namespace, X-Sandbox-Port "
    "(and X-Sandbox-Claim-Name for a sandbox made through /rpc)"
)


def check_port(port: object, runtime_port: int) -> int:
    """``port`` if it is a port of the sandbox's own servers; else a ``ValueError``/``TypeError``
    naming the port and the rule."""
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int from 1 to 65535, not {port!r}")
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is not a TCP port: give one from 1 to 65535")
    if port == runtime_port:
        what = f"port {port} is the sandbox runtime's own port, reserved for its API:"
        raise attach(ValueError(what), _RUNTIME_PORT_FIX)
    return port


_RUNTIME_PORT_FIX = Fix(
    Say(
        "use sandbox.commands and sandbox.files for it, and another port for your server",
        cli="use `agent-sandbox-awx run` and `agent-sandbox-awx files` for it, and forward "
        "another port: the one your server listens on",
    )
)


def _not_listening(port: int, sandbox: str, detail: str, status: int) -> tuple[str, Fix]:
    """What a ``port_not_listening`` refusal says, and how to start a server in each surface."""
    said = detail.partition(": start a server")[0]  # the broker's fact, not its advice
    if not said.startswith("nothing listens"):
        said = f"nothing listens on port {port} in sandbox {sandbox!r}"
    what = f"Could not reach port {port}: {said} ({status} port_not_listening)."
    return what, Fix(
        "Start a server on it first, listening on 127.0.0.1 or 0.0.0.0: ",
        Say(
            "sandbox.commands.run(..., background=True, timeout=0)",
            cli=f"`agent-sandbox-awx run --sandbox {sandbox} --background --timeout 0 -- CMD`",
        ),
        ".",
    )


class PortAuth(httpx.Auth):
    """The caller's token on each request, read fresh from ``source()`` (the sandbox's
    credential source, its cache included) and only ever sent to the broker's origin."""

    def __init__(self, source: Callable[[], CredentialSource], broker_url: str) -> None:
        self._source = source
        self._audience = broker_url
        self._origin = _origin(httpx.URL(broker_url))

    def _check(self, request: httpx.Request) -> None:
        if _origin(request.url) != self._origin:
            raise BrokerError(
                f"Refusing to send the token to {request.url.scheme}://{request.url.host}: it "
                f"is not the broker's origin ({self._audience}). A port client only reaches "
                "the broker; give it paths (client.get('/page')), not other URLs."
            )

    def _seen(self, response: httpx.Response) -> None:
        if response.status_code == 401 and BROKER_ERROR_HEADER in response.headers:
            self._source().invalidate(self._audience)  # the next request reads it anew

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response]:
        self._check(request)
        credential = self._source().get_credential(self._audience)
        request.headers["Authorization"] = f"Bearer {credential.token}"
        response = yield request
        self._seen(response)

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        self._check(request)
        credential = await self._source().aget_credential(self._audience)
        request.headers["Authorization"] = f"Bearer {credential.token}"
        response = yield request
        self._seen(response)


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    default = {"http": 80, "https": 443}.get(url.scheme)
    return (url.scheme, url.host, url.port or default)


_BY_STATUS: dict[int, type[BrokerError]] = {
    401: BrokerAuthenticationError,
    403: BrokerPermissionError,
    404: BrokerNotFoundError,
    409: BrokerConflictError,
}


def broker_refusal(response: httpx.Response, port: int, sandbox: str) -> BrokerError:
    """The typed error for the broker's own refusal of a port request (its body read)."""
    try:
        body = json.loads(response.content)
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    code = str(body.get("code") or response.headers.get(BROKER_ERROR_HEADER, ""))
    detail = str(body.get("detail") or response.reason_phrase)
    request = response.request
    common: dict[str, Any] = {
        "status_code": response.status_code,
        "code": code,
        "detail": detail,
        "method": request.method,
        "path": request.url.path,
        "response": response,
    }
    message = f"Port {port} of sandbox {sandbox!r}: {detail} ({response.status_code} {code})"
    if code == "port_not_listening":
        what, fix = _not_listening(port, sandbox, detail, response.status_code)
        return PortNotListeningError(what, port=port, sandbox=sandbox, fix=fix, **common)
    if code == "port_not_allowed":
        return PortNotAllowedError(message, port=port, **common)
    kind = _BY_STATUS.get(response.status_code)
    if kind is None:
        kind = BrokerUnavailableError if response.status_code >= 500 else BrokerError
    return kind(message, **common)


class PortsBase:
    """What both kinds of ``sandbox.ports`` share: the sandbox's broker, token and routing."""

    def __init__(self, sandbox: Any) -> None:
        self._sandbox = sandbox

    @property
    def _config(self) -> Any:
        return self._sandbox.client.connection_config

    def _auth_source(self) -> CredentialSource:
        source: CredentialSource = self._sandbox.client._transport.auth
        return source

    def _checked(self, port: object) -> int:
        self._sandbox._check_active()
        return check_port(port, self._sandbox.info.router.port)

    def headers(self, port: int) -> dict[str, str]:
        """The router headers that route a request to ``port`` of this sandbox (all but
        ``Authorization``)."""
        headers: dict[str, str] = self._sandbox._target.headers()
        headers["X-Sandbox-Port"] = str(self._checked(port))
        return headers

    def url(self, port: int, path: str = "/") -> str:
        """The broker URL that reaches ``path`` on ``port`` of this sandbox. It needs these
        headers on every request: ``Authorization: Bearer <token>`` (a token the broker
        accepts, for the broker's URL as audience), ``X-Sandbox-ID``,
        ``X-Sandbox-Namespace`` and ``X-Sandbox-Port`` (and ``X-Sandbox-Claim-Name`` for a
        sandbox made through ``/rpc``): :meth:`headers` gives all but the token. Without
        them the URL is the broker's, not the sandbox's: for a tool that cannot add headers
        use :meth:`forward`."""
        self._checked(port)
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"path must start with '/', not {path!r}")
        broker: str = self._config.broker_url
        return broker.rstrip("/") + path

    def get_host(self, port: int) -> NoReturn:
        """E2B's ``get_host(port)``: there is no such host here. A sandbox's ports are reached
        through the broker, whose URL is the same for every sandbox and port (the router
        headers and the token pick them), so no bare ``host:port`` would reach the port.
        Use instead: ``ports.forward(port)`` (a local ``127.0.0.1`` URL that needs no token:
        for a browser, curl or a test runner), ``ports.client(port)`` (an httpx client), or
        ``ports.url(port)`` with the headers :meth:`headers` names. Always raises
        :class:`~..errors.UnsupportedOperationError`."""
        self._checked(port)
        raise UnsupportedOperationError(
            f"get_host({port}): a sandbox's port has no host of its own here: it is reached "
            "through the broker, whose URL needs the router headers and a token. Use "
            f"sandbox.ports.forward({port}) for a local URL without a token (with .url), "
            f"sandbox.ports.client({port}) for an httpx client, or sandbox.ports.url({port}) "
            f"with the headers {HEADERS_NEEDED}.",
            dialect=getattr(getattr(self._sandbox.client, "dialect", None), "name", "any"),
            operation="get_host",
        )

    def _settings(self, port: int, options: dict[str, Any]) -> dict[str, Any]:
        config = self._config
        settings = client_settings(config)
        settings["headers"] = {**settings["headers"], **self.headers(port)}
        settings.update(
            base_url=config.broker_url,
            auth=PortAuth(self._auth_source, config.broker_url),
            follow_redirects=False,  # a redirect is the server's answer, never followed
        )
        for name in ("timeout", "limits"):
            if name in options:
                settings[name] = options.pop(name)
        if options:
            raise TypeError(
                f"ports.client() takes timeout= and limits= only, not {sorted(options)}"
            )
        return settings


class Ports(PortsBase):
    """``sandbox.ports`` of a :class:`~._client.Sandbox` (see the module docstring)."""

    def client(self, port: int, **options: Any) -> httpx.Client:
        """An ``httpx.Client`` whose requests (``client.get("/path")``) go to ``port`` of this
        sandbox through the broker: the broker's CA and TLS settings, the router headers, the
        sandbox's token read fresh for each request (and only sent to the broker), redirects
        never followed, no cookie jar. The broker's own refusals raise typed errors
        (:class:`~..errors.PortNotListeningError`, :class:`~..errors.PortNotAllowedError`,
        :class:`~..errors.BrokerNotFoundError`...); the server's answers are returned as they
        are. ``timeout=`` and ``limits=`` are httpx's. Close it (``with``) when done."""
        port = self._checked(port)
        name = self._sandbox.name

        def refused(response: httpx.Response) -> None:
            if BROKER_ERROR_HEADER in response.headers:
                response.read()
                raise broker_refusal(response, port, name)

        settings = self._settings(port, options)
        return httpx.Client(**settings, event_hooks={"response": [refused]})

    def forward(self, port: int, local_port: int = 0) -> PortForward:
        """A local listener on ``127.0.0.1:local_port`` (``0``: a free one) that forwards
        every connection to ``port`` of this sandbox through the broker, adding the token
        (see :class:`~._port_forward.PortForward`). Use it as a context manager: ``with
        sandbox.ports.forward(3000) as fwd: httpx.get(fwd.url)``."""
        from ._port_forward import PortForward

        return PortForward(self._forward_target(port), local_port)

    def _forward_target(self, port: int) -> Any:
        from ._port_forward import ForwardTarget

        port = self._checked(port)
        return ForwardTarget(
            self._config, self.headers(port), lambda: self._auth_source(), port, self._sandbox.name
        )
