"""Where a Kubernetes sandbox's data plane goes: to the router, or straight to its pod.

- **router** (``data_plane = "router"``): every request goes to ``router_url`` with upstream's
  router headers for the claim's Sandbox (``X-Sandbox-ID`` = ``status.sandbox.name``, which a
  warm-adopted Sandbox keeps from its pool; ``X-Sandbox-Namespace``; ``X-Sandbox-Port``;
  ``X-Sandbox-Pod-IP`` = the claim's pod IP, :func:`preferred_pod_ip` of its
  ``status.sandbox.podIPs``, checked as the router checks it) and ``Authorization: Bearer`` the
  broker's OWN router credential, read from ``router_token_file`` and read again when the file
  changes (a rotated Secret). The caller's token is never forwarded (the forward drops the
  caller's Authorization and every X-Sandbox-* header the caller sent, X-Sandbox-Pod-IP
  among them: the pod IP the router dials is always that of the caller's own claim).
  Upstream's routers find a pod by ``X-Sandbox-Pod-IP``, else by the DNS name
  ``{X-Sandbox-ID}.{namespace}.svc.cluster.local``, which exists only when the Sandbox has a
  headless Service (its template's ``service: true``; warm-pool Sandboxes have none by
  default): without a pod IP in the claim (none yet) the header is left out and the router
  falls back to that name (``router_pod_ip = false`` always leaves it to that name, for
  templates with ``service: true`` behind a router that resolves names only or refuses the
  header). Upstream's Python router proxies only :data:`ROUTER_METHODS`
  (``Route.methods``: the broker refuses the others before sending). An ``http://`` router is
  reached over the broker's own connections (:mod:`.._http11`), an ``https://`` one with httpx.
- **pod** (``data_plane = "pod"``): ``http://<podIP>:<runtime_port>`` from the claim's
  ``status.sandbox.podIPs`` (IPv4 first on a dual-stack cluster, as upstream's client); a
  loopback, link-local, multicast or unspecified address is refused (the router's SSRF rule)
  unless ``allow_loopback_pod_ips`` (tests: stand-in pods on 127.0.0.N), which admits
  loopback addresses only. Each pod's runtime has a connection pool of its own
  (:meth:`Routes.pod_client`; the broker's own plain-HTTP connections, :mod:`.._http11`, which
  cost a fraction of httpx's CPU per request): one pool for every pod costs each request a
  scan of all the pool's connections (httpcore's), 2.7 ms of CPU per request at 500 sandboxes
  with 100 kept alive, 31 ms with all 500 kept (bench/bench_kube_scale.py). A pod's pool is
  closed once no claim in the cache leads to it and it has not been used for
  :data:`POD_POOL_IDLE_SECONDS` (:meth:`Routes.prune`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import ssl
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal
from urllib.parse import urlsplit

import httpx

from ...._cookies import NoCookies
from ...._urls import masked_url
from .._http11 import Http11Pool
from .._interface import RUNTIME_PORT, BackendUnavailable, ClaimGone, Route, Unroutable
from ._claims import KubeClaimState

__all__ = ["ROUTER_METHODS", "RouteSettings", "Routes", "checked_pod_ip", "preferred_pod_ip"]

DATA_PLANE_TIMEOUT = 300.0
POD_KEEPALIVE: Final = 8
"""Idle connections kept per pod (more at once are closed after their request): at most 8
idle sockets per live sandbox, where one pool for every pod kept 100 in all."""
ROUTER_KEEPALIVE: Final = 100
"""Idle connections kept to the router (one pool for every sandbox behind it)."""
POD_KEEPALIVE_SECONDS: Final = 15.0
"""How long an idle connection is kept (to a pod, or to the router)."""
POD_POOL_IDLE_SECONDS: Final = 60.0
"""A pod's pool unused this long, and led to by no claim in the cache, is closed."""
CHECKED_IPS_KEPT: Final = 4096
"""How many claims' checked pod IPs a backend remembers (all forgotten past it)."""
ROUTER_METHODS: Final = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH"})
"""The methods upstream's Python router proxies (its catch-all route's methods, sandbox_router.py
at agent-sandbox commit 2fd412d5); it answers any other (``HEAD``, ``OPTIONS``) ``405`` itself,
which the broker would relay as if the sandbox's server had said it."""


@dataclass(frozen=True)
class RouteSettings:
    data_plane: Literal["router", "pod"] = "router"
    router_url: str | None = None
    router_token_file: Path | None = None
    router_ca_file: Path | None = None
    runtime_port: int = RUNTIME_PORT
    allow_loopback_pod_ips: bool = False
    router_pod_ip: bool = True
    """Send X-Sandbox-Pod-IP (``False``: the router resolves the Sandbox's Service name)."""


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


def _client(verify: ssl.SSLContext, *, keep: int = ROUTER_KEEPALIVE) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        follow_redirects=False,
        trust_env=False,
        verify=verify,
        timeout=httpx.Timeout(connect=5.0, read=DATA_PLANE_TIMEOUT, write=300.0, pool=10.0),
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=keep,
            keepalive_expiry=POD_KEEPALIVE_SECONDS,
        ),
        cookies=NoCookies(),
    )


class Routes:
    """The routes of one backend (its connections: one pool to the router, or one per pod)."""

    def __init__(self, settings: RouteSettings) -> None:
        self.settings = settings
        self._checked: dict[tuple[str, ...], str] = {}  # pod IPs -> checked_pod_ip's choice
        self._pods: dict[tuple[str, int], tuple[Http11Pool, list[float]]] = {}
        """(pod IP, port) -> its pool and [when it was last routed to]."""
        self._closing: set[asyncio.Task[None]] = set()
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
        """The router's pool for ``https://`` (and its readiness probe); the pods' are
        :meth:`pod_client`'s."""
        self._router_pool: Http11Pool | None = None
        """An ``http://`` router's pool: the broker's own connections, as a pod's."""
        if self._router is not None and self._router[0] == "http":
            _, host, port = self._router
            self._router_pool = Http11Pool(
                host, port, keep=ROUTER_KEEPALIVE, idle_seconds=POD_KEEPALIVE_SECONDS
            )
        # straight to a pod, a port request has a connection of its own: a user's server is not
        # ours to keep connections to (restarted, the next request would fail), and one that
        # answers in several writes stalls 40 ms per request on a kept-alive connection
        self.ports_http = _client(verify, keep=0)

    async def close(self) -> None:
        await self.http.aclose()
        await self.ports_http.aclose()
        if self._router_pool is not None:
            await self._router_pool.aclose()
        pools, self._pods = list(self._pods.values()), {}
        for client, _ in pools:
            await client.aclose()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def pod_client(self, ip: str, port: int) -> Http11Pool:
        """The pool of the runtime at ``ip``:``port`` (made at its first request): plain HTTP,
        the broker's own connections (:mod:`.._http11`)."""
        entry = self._pods.get((ip, port))
        if entry is None:
            pool = Http11Pool(ip, port, keep=POD_KEEPALIVE, idle_seconds=POD_KEEPALIVE_SECONDS)
            entry = self._pods[(ip, port)] = (pool, [0.0])
        entry[1][0] = time.monotonic()
        return entry[0]

    def prune(self, live: Iterable[tuple[str, ...]]) -> int:
        """Close the pools of the pods none of the ``live`` claims' pod IPs lead to and unused
        for :data:`POD_POOL_IDLE_SECONDS` (a deleted sandbox's pod; its requests long over);
        how many were closed."""
        leads = {self._checked.get(ips) or preferred_pod_ip(ips) for ips in live}
        idle = time.monotonic() - POD_POOL_IDLE_SECONDS
        gone = [k for k, (_, used) in self._pods.items() if k[0] not in leads and used[0] < idle]
        for key in gone:
            client, _ = self._pods.pop(key)
            task = asyncio.get_running_loop().create_task(client.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return len(gone)

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
        if not state.pod_ips:
            raise Unroutable(f"sandbox {state.name!r} has no pod IP yet")
        ip = self._checked_ip(state)
        client = self.pod_client(ip, target) if port == RUNTIME_PORT else self.ports_http
        return Route(ip, target, client)

    def _checked_ip(self, state: KubeClaimState) -> str:
        """:func:`checked_pod_ip` of the claim's pod IPs, worked out once per list of IPs (a
        refused one is refused again each time)."""
        ip = self._checked.get(state.pod_ips)
        if ip is None:
            ip = checked_pod_ip(state.pod_ips, state.name, self.settings.allow_loopback_pod_ips)
            if len(self._checked) >= CHECKED_IPS_KEPT:
                self._checked.clear()
            self._checked[state.pod_ips] = ip
        return ip

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
        if state.pod_ips and self.settings.router_pod_ip:  # else: the Sandbox's Service name
            headers.append((b"x-sandbox-pod-ip", self._checked_ip(state).encode()))
        if self._token is not None:
            headers.append((b"authorization", b"Bearer " + self._token.read().encode()))
        tls = self.verify if scheme == "https" else None
        return Route(
            host,
            port,
            self._router_pool or self.http,
            scheme=scheme,
            headers=headers,
            tls=tls,
            via_router=True,
            methods=ROUTER_METHODS,
        )


def _shown(url: str | None) -> str:
    return repr(masked_url(url) if url else url)


def _router_address(url: str | None) -> tuple[str, str, int]:
    parts = urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"backend.kubernetes.router_url {_shown(url)} is not an http(s):// URL with a host: "
            "give "
            "the router's Service address, e.g. http://sandbox-router-svc.agent-sandbox-system"
            ".svc.cluster.local:8080"
        )
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(
            f"backend.kubernetes.router_url {_shown(url)} has a path or query: the router serves "
            "the sandboxes' paths at its root; give scheme, host and port only"
        )
    return parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def preferred_pod_ip(ips: Sequence[str]) -> str | None:
    """The pod IP to use of ``ips`` (a claim's ``status.sandbox.podIPs``), as upstream's client
    selects it (``select_pod_ip``): the first IPv4 address (an IPv4-mapped IPv6 address counts,
    written as IPv4), else the first IPv6 one, in canonical form; entries that are no address
    are skipped; ``None``: none is."""
    first: str | None = None
    for entry in ips:
        try:
            address = ipaddress.ip_address(str(entry).strip())
        except ValueError:
            continue
        if address.version == 4:
            return str(address)
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        if mapped is not None:
            return str(mapped)
        first = first or str(address)
    return first


def checked_pod_ip(ips: Sequence[str], name: str, allow_loopback: bool) -> str:
    """The :func:`preferred_pod_ip` of ``ips``, unless it is an address no router forwards to."""
    preferred = preferred_pod_ip(ips)
    if preferred is None:
        raise Unroutable(f"sandbox {name!r} has no usable pod IP ({', '.join(ips)[:200]!r})")
    address = ipaddress.ip_address(preferred)
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
