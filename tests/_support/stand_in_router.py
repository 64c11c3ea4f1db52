"""A stand-in for agent-sandbox's Python router (the tests' ``StandInRouter``).

It behaves as upstream's ``clients/python/agentic-sandbox-client/sandbox-router/
sandbox_router.py`` does at kubernetes-sigs/agent-sandbox commit 2fd412d5, for HTTP (its
WebSocket route is not played: no test sends one through it):

- methods: only ``GET``, ``POST``, ``PUT``, ``DELETE`` and ``PATCH`` are proxied (the
  ``methods`` of its catch-all ``api_route``); any other is FastAPI's ``405 {"detail": "Method
  Not Allowed"}`` with ``Allow``, decided before anything else (routing precedes the handler);
- its bearer token (``ROUTER_AUTH_TOKEN``), checked first in the handler: ``401`` ``"Missing or
  invalid Authorization header."`` / ``"Invalid token."`` (``_check_router_auth``);
- the routing headers, checked as ``_resolve_target`` checks them (``400``: ``X-Sandbox-ID``
  required and a DNS-1123 label, ``X-Sandbox-Namespace`` (default ``default``) a label,
  ``X-Sandbox-Port`` (default 8888) 1-65535); the pod is **``X-Sandbox-Pod-IP``** when given
  (refused ``400`` if malformed, loopback, link-local, multicast or unspecified: the SSRF
  rule; ``allow_loopback_pod_ip`` is the Go router's ``--allow-loopback-pod-ip``, which its
  README offers "for integration tests against a localhost backend": the stand-in pods listen
  on 127.x.y.z), **else the DNS name** ``{id}.{namespace}.svc.{cluster_domain}``, which
  :class:`ClusterDns` resolves as the cluster's DNS resolves a headless Service: the Ready
  pods its selector selects, and no address (NXDOMAIN) when there is no such Service;
- forwarding: without the router headers, hop-by-hop headers (and those ``Connection``
  names), ``Host`` and ``Authorization`` (``_proxy_headers``); the timeout is
  ``X-Sandbox-Timeout`` capped at the proxy timeout (``PROXY_TIMEOUT_SECONDS``, 180 s; here
  ``proxy_timeout`` so that a test proves it in seconds), as httpx's per-operation timeout
  (connect at most 5 s); ``502 "Could not connect to the backend sandbox: ID"`` when the
  connection (or the name) fails, ``504 "Timed out waiting for the backend sandbox: ID"``
  when no answer came in time; the answer streams back (a stall past the timeout mid-stream
  drops the connection, as its ``StreamingResponse`` then fails).

``seen`` records the headers of every request it proxied (``raw``: as sent, repeats kept;
``resolved``: how it found the pod, ``"pod-ip"`` or ``"dns"``); ``refused`` counts the
requests refused for their token.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import httpx
import uvicorn

from tests._support.kube import KubeAPIServer, KubeError, free_ports

__all__ = ["ClusterDns", "RoutingError", "StandInRouter", "resolve_target"]

METHODS: Final = ("GET", "POST", "PUT", "DELETE", "PATCH")
DEFAULT_PROXY_TIMEOUT: Final = 180.0
DEFAULT_PORT: Final = 8888
ROUTER_HEADERS: Final = frozenset(
    {"x-sandbox-id", "x-sandbox-namespace", "x-sandbox-port", "x-sandbox-pod-ip",
     "x-sandbox-timeout"}
)  # fmt: skip
HOP_BY_HOP: Final = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
     "trailers", "transfer-encoding", "upgrade"}
)  # fmt: skip
_DNS_LABEL: Final = re.compile(r"^[a-z0-9](?:[-a-z0-9]*[a-z0-9])?$")


class RoutingError(Exception):
    """Invalid routing headers (the router's ``400``)."""


class ClusterDns:
    """The cluster DNS's answer for ``{service}.{namespace}.svc.{domain}``, from the API
    server: a headless Service resolves to the IPs of the Ready pods its selector selects (the
    ready addresses of its endpoints); no such Service, or no Ready pod: no address."""

    def __init__(self, kube: KubeAPIServer, cluster_domain: str = "cluster.local") -> None:
        self.kube, self.suffix = kube, f".svc.{cluster_domain}"

    def resolve(self, name: str) -> list[str]:
        if not name.endswith(self.suffix) or name[: -len(self.suffix)].count(".") != 1:
            return []
        service, namespace = name[: -len(self.suffix)].split(".")
        try:
            found = self.kube.get(f"/api/v1/namespaces/{namespace}/services/{service}")
        except KubeError as exc:
            if exc.status_code == 404:
                return []
            raise
        spec = found.get("spec") or {}
        selector = spec.get("selector") or {}
        if spec.get("clusterIP") != "None" or not selector:
            raise AssertionError(f"{name}: the stand-in DNS knows headless Services only")
        query = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        pods = self.kube.admin.get(
            f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": query}
        ).json()
        return [
            pod["status"]["podIP"]
            for pod in pods.get("items") or []
            if (pod.get("status") or {}).get("podIP") and _pod_ready(pod)
        ]


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def resolve_target(
    headers: Mapping[str, str], *, allow_loopback_pod_ip: bool = False
) -> tuple[str, str, int, str | None]:
    """``(sandbox id, namespace, port, pod IP or None)`` of the routing headers (lower-case
    names), checked as upstream's ``_resolve_target`` checks them; ``RoutingError`` says why
    not, in its words."""
    sandbox_id = headers.get("x-sandbox-id")
    if not sandbox_id:
        raise RoutingError("X-Sandbox-ID header is required.")
    if len(sandbox_id) > 63 or not _DNS_LABEL.match(sandbox_id):
        raise RoutingError("Invalid sandbox ID format.")
    namespace = headers.get("x-sandbox-namespace", "default")
    if not namespace or len(namespace) > 63 or not _DNS_LABEL.match(namespace):
        raise RoutingError("Invalid namespace format.")
    try:
        port = int(headers.get("x-sandbox-port", str(DEFAULT_PORT)))
    except ValueError:
        raise RoutingError("Invalid port format.") from None
    if not 1 <= port <= 65535:
        raise RoutingError("Invalid port format.")
    pod_ip = headers.get("x-sandbox-pod-ip")
    if not pod_ip:
        return sandbox_id, namespace, port, None
    try:
        ip = ipaddress.ip_address(pod_ip)
    except ValueError:
        raise RoutingError("Invalid target IP address format.") from None
    loopback = ip.is_loopback and not allow_loopback_pod_ip
    if loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        raise RoutingError("Invalid target IP address.")
    return sandbox_id, namespace, port, str(ip)


def request_timeout(headers: Mapping[str, str], proxy_timeout: float) -> float:
    """``_get_request_timeout``: X-Sandbox-Timeout if it is a positive finite number, at most
    the proxy timeout; else the proxy timeout."""
    try:
        value = float(headers.get("x-sandbox-timeout", "nan"))
    except ValueError:
        return proxy_timeout
    if not math.isfinite(value) or value <= 0:
        return proxy_timeout
    return min(value, proxy_timeout)


def proxied_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``_proxy_headers``: without the router's, the hop-by-hop ones (and those Connection
    names), Host and Authorization (and the framing, which the router's client redoes)."""
    named = {
        token.strip().lower()
        for k, v in headers
        if k.lower() == b"connection"
        for token in v.decode("latin-1").split(",")
    }
    excluded = ROUTER_HEADERS | HOP_BY_HOP | named | {"host", "authorization", "content-length"}
    return [(k, v) for k, v in headers if k.decode("latin-1").lower() not in excluded]


class StandInRouter:
    """See the module. ``StandInRouter(controller, token_file, proxy_timeout=...,
    allow_loopback_pod_ip=...)`` on plain HTTP on loopback; a context manager."""

    def __init__(
        self,
        controller: Any,
        token_file: Path,
        *,
        proxy_timeout: float = DEFAULT_PROXY_TIMEOUT,
        allow_loopback_pod_ip: bool = False,
        cluster_domain: str = "cluster.local",
        host: str = "127.0.0.1",
    ) -> None:
        self.kube: KubeAPIServer = controller.kube
        self.host = host
        self.token_file = token_file
        self.proxy_timeout = proxy_timeout
        self.allow_loopback_pod_ip = allow_loopback_pod_ip
        self.dns = ClusterDns(self.kube, cluster_domain)
        self.cluster_domain = cluster_domain
        [self.port] = free_ports(1)
        self.url = f"http://{host}:{self.port}"
        self.seen: list[dict[str, str]] = []
        self.raw: list[list[tuple[str, str]]] = []
        self.resolved: list[str] = []
        self.refused = 0
        self._loop = asyncio.new_event_loop()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._http: httpx.AsyncClient | None = None

    def __enter__(self) -> StandInRouter:
        config = uvicorn.Config(self._asgi, host=self.host, port=self.port, lifespan="off",
                                log_level="critical", access_log=False, http="h11",
                                ws="none", loop="asyncio", interface="asgi3")  # fmt: skip
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=lambda: self._loop.run_until_complete(server.serve()), daemon=True
        )
        self._thread.start()
        while not server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(10)
        if self._http is not None:
            self._loop.run_until_complete(self._http.aclose())
        self._loop.close()

    async def _asgi(self, scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["method"] not in METHODS:  # FastAPI's routing: before the handler
            allow = [(b"allow", ", ".join(METHODS).encode())]
            await _answer(send, 405, "Method Not Allowed", allow)
            return
        refusal = self._auth_refusal(headers.get("authorization"))
        if refusal is not None:
            self.refused += 1
            await _answer(send, 401, refusal)
            return
        try:
            target = resolve_target(headers, allow_loopback_pod_ip=self.allow_loopback_pod_ip)
        except RoutingError as exc:
            await _answer(send, 400, str(exc))
            return
        self.seen.append(headers)
        self.raw.append([(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]])
        self.resolved.append("pod-ip" if target[3] else "dns")
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await self._forward(scope, headers, target, body, send)

    def _auth_refusal(self, authorization: str | None) -> str | None:
        parts = (authorization or "").split()
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return "Missing or invalid Authorization header."
        if parts[1] != self.token_file.read_text().strip():
            return "Invalid token."
        return None

    async def _host(self, sandbox_id: str, namespace: str, pod_ip: str | None) -> str | None:
        """The address the router dials: the pod IP, else what the Service's name resolves to
        (``None``: NXDOMAIN)."""
        if pod_ip is not None:
            return pod_ip
        name = f"{sandbox_id}.{namespace}.svc.{self.cluster_domain}"
        addresses = await asyncio.to_thread(self.dns.resolve, name)
        return addresses[0] if addresses else None

    async def _forward(
        self,
        scope: Mapping[str, Any],
        headers: Mapping[str, str],
        target: tuple[str, str, int, str | None],
        body: bytes,
        send: Any,
    ) -> None:
        sandbox_id, namespace, port, pod_ip = target
        host = await self._host(sandbox_id, namespace, pod_ip)
        if host is None:  # httpx's ConnectError for a name that does not resolve
            await _answer(send, 502, f"Could not connect to the backend sandbox: {sandbox_id}")
            return
        timeout = request_timeout(headers, self.proxy_timeout)
        query = scope["query_string"]
        raw_path = scope["raw_path"] + (b"?" + query if query else b"")
        self._http = self._http or httpx.AsyncClient(trust_env=False)
        url = httpx.URL(scheme="http", host=host, port=port, raw_path=raw_path)
        request = self._http.build_request(
            scope["method"], url, headers=proxied_headers(list(scope["headers"])), content=body,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
        )  # fmt: skip
        try:
            response = await self._http.send(request, stream=True)
        except httpx.ConnectError:  # upstream's answer when the pod's port refuses
            await _answer(send, 502, f"Could not connect to the backend sandbox: {sandbox_id}")
            return
        except httpx.TimeoutException:
            await _answer(send, 504, f"Timed out waiting for the backend sandbox: {sandbox_id}")
            return
        try:
            out = [(k, v) for k, v in response.headers.raw
                   if k.decode("latin-1").lower() not in HOP_BY_HOP]  # fmt: skip
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": out})  # fmt: skip
            async for chunk in response.aiter_raw():  # a stall past the timeout raises
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


async def _answer(
    send: Any, status: int, detail: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += extra or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
