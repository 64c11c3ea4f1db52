"""The HTTP client's settings, from a :class:`BrokerConnectionConfig` (no I/O): TLS (the CA
bundle, a client certificate), never following redirects, the named timeouts and connection
limits, the User-Agent, no cookies, the environment's proxies checked before the client is
built, and the one :class:`RetryPolicy`. The sync and the async pools (``_pool``,
``_async_pool``) and the port forwards build their ``httpx`` clients from
:func:`client_settings`; the pools' clients are :class:`CookielessClient` /
:class:`CookielessAsyncClient`, which skip httpx's cookie work on every request.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import ssl
import urllib.request
from collections.abc import Mapping
from typing import Any, Final

import httpx

from ..._cookies import NoCookies
from ..._version import __version__
from ...errors import ConfigurationError
from ..core._retry import RetryPolicy
from ..wire import _protocol as proto
from ._config import ENV_TRUST_ENV_PROXIES, BrokerConnectionConfig

__all__ = [
    "CookielessAsyncClient",
    "CookielessClient",
    "build_request",
    "client_settings",
    "retry_policy",
]


def _ssl_context(config: BrokerConnectionConfig) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=config.ca_cert)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(
            f"Could not load the CA bundle {config.ca_cert!r} ({exc}). Point ca_cert (or "
            "AGENT_SANDBOX_CA_BUNDLE) at a readable PEM file with the broker's CA certificate."
        ) from exc
    if config.client_cert:
        cert, key = config.client_cert
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(
                f"Could not load the client certificate {cert!r} with key {key!r} ({exc}). "
                "client_cert must be (certificate PEM path, private key PEM path)."
            ) from exc
    return context


_PROXY_SCHEMES = frozenset({"http", "https", "socks5", "socks5h"})


def _check_env_proxies() -> None:
    """Refuse, with a typed error naming the variable, a proxy from the environment that httpx
    cannot use: it would fail when the client is built (a raw ``ImportError`` for a SOCKS proxy
    without ``socksio``, a raw ``ValueError`` for another scheme), whatever the broker."""
    found = urllib.request.getproxies()
    if "*" in (host.strip() for host in found.get("no", "").split(",")):
        return  # NO_PROXY=*: httpx uses no proxy at all
    for key in ("https", "all", "http"):  # the variables httpx reads (it mounts all of them)
        value = found.get(key)
        if not value:
            continue
        names = [n for n in (f"{key}_proxy", f"{key.upper()}_PROXY") if os.environ.get(n)]
        name = names[0] if names else f"{key.upper()}_PROXY"
        scheme = value.partition("://")[0].lower() if "://" in value else "http"
        if scheme not in _PROXY_SCHEMES:
            problem = f"its scheme {scheme}:// is not a proxy scheme (http, https, socks5)"
        elif scheme.startswith("socks") and importlib.util.find_spec("socksio") is None:
            problem = "a SOCKS proxy needs the socksio package: pip install 'httpx[socks]'"
        else:
            continue
        shown = proto.redact_url(value, typed=True)
        raise ConfigurationError(
            f"The proxy {name}={shown!r} from the environment cannot be used: {problem}. "
            f"Fix or unset {name}, or set {ENV_TRUST_ENV_PROXIES}=0 to reach the broker "
            "without the environment's proxies."
        )


def _check_url(config: BrokerConnectionConfig) -> None:
    """The broker URL as the HTTP client reads it: a host that is no valid internationalised
    domain name (``xn--zz``) would fail at the first request, as a raw ``idna`` error."""
    try:
        problem = "" if httpx.URL(config.broker_url).host else "no host"  # decodes an IDNA host
    except (httpx.InvalidURL, UnicodeError) as exc:
        problem = str(exc) or type(exc).__name__
    if problem:
        shown = proto.redact_url(config.broker_url, typed=True)
        raise ConfigurationError(
            f"The broker URL {shown!r} cannot be used for HTTP ({problem}); set "
            "AGENT_SANDBOX_BROKER_URL (or broker_url=, --broker-url) to the broker's https:// "
            "URL."
        )


def client_settings(config: BrokerConnectionConfig) -> dict[str, Any]:
    """Keyword arguments for ``httpx.Client``/``httpx.AsyncClient``: TLS, never
    following redirects, the request timeout and the User-Agent (the broker URL checked)."""
    _check_url(config)
    verify: ssl.SSLContext | bool = True
    if config.broker_url.startswith("https://"):
        verify = _ssl_context(config)
    if config.use_env_proxies:
        _check_env_proxies()
    return {
        "follow_redirects": False,
        "trust_env": config.use_env_proxies,  # httpx reads nothing else from it here
        "verify": verify,
        "timeout": httpx.Timeout(config.request_timeout),
        "limits": httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_keepalive_connections,
        ),
        "headers": {"User-Agent": f"k8s-agent-sandbox-awx/{__version__}", **config.extra_headers},
        "cookies": NoCookies(),
    }


class _NoCookieStore(httpx.Cookies):
    """The cookies of a client that keeps none. httpx hands every answer to its client's
    ``cookies.extract_cookies`` (which builds a ``urllib`` request of it, its URL and every
    header copied, before asking the jar: about 25 µs per call even with a jar that keeps
    nothing) and adds its cookies to every request it builds: here neither happens."""

    def __init__(self) -> None:
        super().__init__(NoCookies())

    def extract_cookies(self, response: httpx.Response) -> None:
        return None

    def set_cookie_header(self, request: httpx.Request) -> None:
        return None


_NO_COOKIES = _NoCookieStore()
"""Shared: it holds nothing and never will (its jar stores no cookie, even one set by hand)."""


class CookielessClient(httpx.Client):
    """An ``httpx.Client`` without cookies (:class:`_NoCookieStore`): a ``Set-Cookie`` is never
    parsed, stored or sent back, and no cookie work is done per request."""

    @property
    def cookies(self) -> httpx.Cookies:
        return _NO_COOKIES

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        return None  # keeps none


class CookielessAsyncClient(httpx.AsyncClient):
    """:class:`CookielessClient` for asyncio."""

    @property
    def cookies(self) -> httpx.Cookies:
        return _NO_COOKIES

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        return None  # keeps none

    async def send_streamed(self, request: httpx.Request) -> httpx.Response:
        """``send(request, stream=True)`` without httpx's auth and redirect layers when the
        client uses neither (no auth, none in the URL, no event hooks, redirects not followed,
        the request's timeout set: what the clients of ``client_settings`` are): its one
        attempt (``_send_single_request``), the answer as ``send`` returns it (a redirect's
        ``next_request`` set, never followed). About 5 µs less per request; any other client or
        request goes through ``send``."""
        hooks = self.event_hooks
        if (
            self.auth is not None
            or self.follow_redirects
            or hooks["request"]
            or hooks["response"]
            or self.is_closed
            or "timeout" not in request.extensions
            or request.url.userinfo
        ):
            return await self.send(request, stream=True)
        response = await self._send_single_request(request)
        if response.has_redirect_location:
            try:
                response.next_request = self._build_redirect_request(request, response)
            except BaseException:
                await response.aclose()
                raise
        return response


@functools.lru_cache(maxsize=256)
def _parsed_url(url: str) -> httpx.URL:
    """An absolute URL parsed once (``httpx.URL`` is immutable: a request copies it)."""
    return httpx.URL(url)


def _merged_headers(
    defaults: tuple[tuple[bytes, bytes], ...], headers: tuple[tuple[str, str], ...]
) -> tuple[list[Any], set[bytes]]:
    """``httpx``'s merge of a client's headers (their raw pairs) and a request's: each of
    ``headers`` replaces the client's of the same name (any case), after the client's others,
    in order (the raw pairs of the client's, the request's as given: httpx encodes them as it
    would have); and the merged names, lower case."""
    given = {name.lower().encode("ascii") for name, _ in headers}
    names = set(given)
    merged: list[Any] = []
    for name, value in defaults:
        lower = name.lower()
        if lower not in given:
            merged.append((name, value))
            names.add(lower)
    merged += headers
    return merged, names


_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


@functools.lru_cache(maxsize=256)
def _prepared_headers(
    defaults: tuple[tuple[bytes, bytes], ...],
    method: str,
    url: str,
    headers: tuple[tuple[str, str], ...],
    has_body: bool,
) -> tuple[httpx.Headers, bool]:
    """The headers ``httpx.Request(..., content=body)`` would end with, normalised once per
    client headers, method, URL, request headers and whether there is a body (a request copies
    them): ``Host`` first unless given, ``Content-Length: 0`` after it for a body method
    without a body or a framing of its own (``Request._prepare``); and whether a body's
    ``Content-Length`` goes last (none given), which the caller adds."""
    merged, names = _merged_headers(defaults, headers)
    head: list[Any] = []
    host = _parsed_url(url)
    if b"host" not in names and host.host:
        head.append((b"Host", host.netloc))
    framed = bool(names & {b"content-length", b"transfer-encoding"})
    if not has_body and not framed and method.upper() in _BODY_METHODS:
        head.append((b"Content-Length", b"0"))
    add_length = has_body and b"content-length" not in names
    return httpx.Headers(head + merged), add_length


def build_request(
    client: httpx.Client | httpx.AsyncClient,
    method: str,
    url: str,
    *,
    params: Mapping[str, str] | None,
    headers: Mapping[str, str],
    content: bytes | None,
    timeout: httpx.Timeout,
) -> httpx.Request:
    """``client.build_request(...)`` of an absolute ``url``: for a pool's client (no cookies,
    no query parameters of its own) the same request built without its copies (the URL
    parsed once per URL, the merged and framed headers normalised once per kind of request:
    :func:`_prepared_headers`, the body given as its stream: about 40 µs less per request);
    for any other client, its own ``build_request``."""
    if not isinstance(client, CookielessClient | CookielessAsyncClient) or client.params:
        return client.build_request(
            method, url, params=params, headers=headers, content=content, timeout=timeout
        )
    body = content or b""
    prepared, add_length = _prepared_headers(
        tuple(client.headers.raw), method, url, tuple(headers.items()), bool(body)
    )
    request = httpx.Request(
        method,
        _parsed_url(url),
        params=params,
        headers=prepared,  # copied by the request
        stream=httpx.ByteStream(body),
        extensions={"timeout": timeout.as_dict()},
    )
    if add_length:
        request.headers["Content-Length"] = str(len(body))  # last, as httpx puts it
    request.read()  # its content, as a request of ``content=`` has it (a bytes stream: no copy)
    return request


def retry_policy(config: BrokerConnectionConfig) -> RetryPolicy:
    return RetryPolicy(
        max_attempts=config.max_attempts,
        backoff_base=config.backoff_base,
        backoff_max=config.backoff_max,
    )
