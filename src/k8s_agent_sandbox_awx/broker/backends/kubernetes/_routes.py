"""Where a Kubernetes sandbox's data plane goes: to the router, or straight to its pod.

- **router** (``data_plane = "router"``): every request goes to ``router_url`` with upstream's
  router headers for the claim's Sandbox (``X-Sandbox-ID`` = ``status.sandbox.name``, which a
  warm-adopted Sandbox keeps from its pool; ``X-Sandbox-Namespace``; ``X-Sandbox-Port``) and
  ``Authorization: Bearer`` the broker's OWN router credential, read from ``router_token_file``
  and read again when the file changes (a rotated Secret). The caller's token is never
  forwarded (the forward drops the caller's Authorization and every X-Sandbox-* header).
- **pod** (``data_plane = "pod"``): ``http://<podIP>:<runtime_port>`` from the claim's
  ``status.sandbox.podIPs``; a loopback, link-local, multicast or unspecified address is
  refused (the router's SSRF rule) unless ``allow_loopback_pod_ips`` (tests: stand-in pods on
  127.0.0.N), which admits loopback addresses only.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import httpx

from ...._cookies import NoCookies
from .._interface import RUNTIME_PORT, BackendUnavailable, ClaimGone, Route, Unroutable
from ._claims import KubeClaimState

__all__ = ["RouteSettings", "Routes"]

DATA_PLANE_TIMEOUT = 300.0


@dataclass(frozen=True)
class RouteSettings:
    data_plane: Literal["router", "pod"] = "router"
    router_url: str | None = None
    router_token_file: Path | None = None
    router_ca_file: Path | None = None
    runtime_port: int = RUNTIME_PORT
    allow_loopback_pod_ips: bool = False


class RouterToken:
    """The broker's router credential in ``path``, read again whenever the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._token = ""

    def __repr__(self) -> str:
        return f"RouterToken({str(self.path)!r})"

    def read(self) -> str:
        try:
            info = os.stat(self.path)
            seen = (info.st_ino, info.st_mtime_ns, info.st_size)
            if seen != self._seen:
                token = self.path.read_text(encoding="utf-8").strip()
                if not token:
                    raise ValueError("it is empty")
                self._token, self._seen = token, seen
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise BackendUnavailable(
                f"the router credential file {self.path} (backend.kubernetes.router_token_file) "
                f"cannot be read ({why}): put the router's token (ROUTER_AUTH_TOKEN) there"
            ) from None
        return self._token


def _client(verify: ssl.SSLContext, *, keep: int = 100) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        follow_redirects=False,
        trust_env=False,
        verify=verify,
        timeout=httpx.Timeout(connect=5.0, read=DATA_PLANE_TIMEOUT, write=300.0, pool=10.0),
        limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=keep, keepalive_expiry=15.0
        ),
        cookies=NoCookies(),
    )


class Routes:
    """The routes of one backend (its connections: one pool to the router, or to the pods)."""

    def __init__(self, settings: RouteSettings) -> None:
        self.settings = settings
        self._token: RouterToken | None = None
        self._router: tuple[str, str, int] | None = None
        verify = ssl.create_default_context()
        if settings.data_plane == "router":
            self._router = _router_address(settings.router_url)
            if settings.router_token_file is not None:
                self._token = RouterToken(settings.router_token_file)
            if settings.router_ca_file is not None:
                verify = ssl.create_default_context(cafile=str(settings.router_ca_file))
        self.verify = verify
        """The TLS context the router's connections are verified with (a route carries it:
        ``Route.tls``, for the WebSockets through the router)."""
        self.http = _client(verify)
        # straight to a pod, a port request has a connection of its own: a user's server is not
        # ours to keep connections to (restarted, the next request would fail), and one that
        # answers in several writes stalls 40 ms per request on a kept-alive connection
        self.ports_http = _client(verify, keep=0)

    async def close(self) -> None:
        await self.http.aclose()
        await self.ports_http.aclose()

    def route(self, state: KubeClaimState, port: int) -> Route:
        """Where a request to the Ready sandbox of ``state`` on ``port`` goes: the runtime's
        port (8888, the data plane's default) is the runtime's own (``runtime_port``); any
        other is a port request to that port of the pod (docs/broker-api.md, "Ports")."""
        if state.ending:
            raise ClaimGone(state.name)
        target = self.settings.runtime_port if port == RUNTIME_PORT else port
        if port != RUNTIME_PORT and port == self.settings.runtime_port:
            raise Unroutable(
                f"port {port} is the runtime's own port in sandbox {state.name!r} (reserved for "
                f"its API, reached as port {RUNTIME_PORT}); use another port for your server"
            )
        if self._router is not None:
            return self._via_router(state, *self._router, target)
        client = self.http if port == RUNTIME_PORT else self.ports_http
        return Route(_pod_ip(state, self.settings.allow_loopback_pod_ips), target, client)

    def _via_router(
        self, state: KubeClaimState, scheme: str, host: str, port: int, target: int
    ) -> Route:
        sandbox = state.sandbox_name
        if not sandbox:
            raise Unroutable(f"sandbox {state.name!r} has no Sandbox bound to its claim yet")
        headers: list[tuple[bytes, bytes]] = [
            (b"x-sandbox-id", sandbox.encode()),
            (b"x-sandbox-namespace", state.namespace.encode()),
            (b"x-sandbox-port", str(target).encode()),
        ]
        if self._token is not None:
            headers.append((b"authorization", b"Bearer " + self._token.read().encode()))
        tls = self.verify if scheme == "https" else None
        return Route(
            host, port, self.http, scheme=scheme, headers=headers, tls=tls, via_router=True
        )


def _router_address(url: str | None) -> tuple[str, str, int]:
    parts = urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"backend.kubernetes.router_url {url!r} is not an http(s):// URL with a host: give "
            "the router's Service address, e.g. http://sandbox-router-svc.agent-sandbox-system"
            ".svc.cluster.local:8080"
        )
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(
            f"backend.kubernetes.router_url {url!r} has a path or query: the router serves "
            "the sandboxes' paths at its root; give scheme, host and port only"
        )
    return parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _pod_ip(state: KubeClaimState, allow_loopback: bool) -> str:
    if not state.pod_ips:
        raise Unroutable(f"sandbox {state.name!r} has no pod IP yet")
    return checked_pod_ip(state.pod_ips, state.name, allow_loopback)


def checked_pod_ip(ips: Sequence[str], name: str, allow_loopback: bool) -> str:
    """The first of ``ips``, unless it is an address no router forwards to."""
    try:
        address = ipaddress.ip_address(ips[0])
    except ValueError:
        raise Unroutable(f"sandbox {name!r} has no usable pod IP ({ips[0]!r})") from None
    loopback_ok = allow_loopback and address.is_loopback
    if not loopback_ok and (
        address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_unspecified
    ):
        raise Unroutable(
            f"sandbox {name!r}'s pod IP {address} is a loopback, link-local, multicast or "
            "unspecified address: refused, as the router refuses such a pod IP (set "
            "backend.kubernetes.allow_loopback_pod_ips only for tests on one machine)"
        )
    return str(address)
