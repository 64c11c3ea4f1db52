"""The local broker of ``tests/broker`` (its templates and policy) and ``Api``, an httpx client
for one identity: the broker's own tests talk to it directly, never through the client package,
over real HTTPS on 127.0.0.1 with the CA the broker generated at start and real signed tokens."""

from __future__ import annotations

import contextlib
import socket
import ssl
import sys
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from k8s_agent_sandbox_awx.testing import LocalBroker, Policy

ECHO_RUNTIME = Path(__file__).resolve().parents[1] / "broker" / "echo_runtime.py"


@contextlib.contextmanager
def broker_tests_broker() -> Iterator[LocalBroker]:
    """Templates ``python``, ``restricted`` and ``echo`` (``tests/broker/echo_runtime.py``);
    Kubernetes callers may use ``python`` and ``echo`` in the namespace their token names, at
    most 3 sandboxes, 600 s."""
    templates: dict[str, str | list[str] | None] = {
        "python": None,
        "restricted": None,
        "echo": [sys.executable, str(ECHO_RUNTIME), "--port", "{port}"],
    }
    kubernetes_policy = Policy(
        templates=("python", "echo"),
        default_template="python",
        namespace=lambda caller: str(caller.attributes["namespace"]),
        max_sandboxes=3,
        max_lifetime_seconds=600,
    )
    with LocalBroker(templates=templates, kubernetes_policy=kubernetes_policy, warn=False) as b:
        yield b


class Api:
    """An httpx client for one identity (token), with helpers for the common calls."""

    def __init__(self, broker: LocalBroker, token: str | None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        self.broker = broker
        self.token = token
        self.http = httpx.Client(
            base_url=broker.url,
            verify=ssl.create_default_context(cafile=broker.ca_bundle),
            headers=headers,
            timeout=httpx.Timeout(30.0),
            follow_redirects=False,
        )

    def create(self, **body: Any) -> httpx.Response:
        headers = {}
        key = body.pop("idempotency_key", None)
        if key is not None:
            headers["Idempotency-Key"] = key
        return self.http.post("/v1/sandboxes", json=body, headers=headers)

    def ready(self, **body: Any) -> dict[str, Any]:
        created = self.create(**body)
        assert created.status_code == 201, created.text
        name = created.json()["name"]
        resp = self.http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20})
        assert resp.status_code == 200, resp.text
        obj: dict[str, Any] = resp.json()
        assert obj["phase"] == "Ready", obj
        return obj

    def data_headers(self, sandbox: dict[str, Any], **extra: str) -> dict[str, str]:
        router = sandbox["router"]
        headers = {
            "X-Sandbox-ID": router["sandbox_id"],
            "X-Sandbox-Namespace": router["namespace"],
            "X-Sandbox-Port": str(router["port"]),
        }
        headers.update(extra)
        return headers

    def run(self, sandbox: dict[str, Any], command: str, **body: Any) -> httpx.Response:
        return self.http.post(
            "/execute",
            json={"command": command, **body},
            headers=self.data_headers(sandbox),
        )


# -- the file API, for the data-plane tests (tests/broker/test_files*.py) ----------------------
def fs_get(api: Api, sandbox: dict[str, Any], op: str, **params: Any) -> httpx.Response:
    """``GET /fs/<op>?<params>`` of ``sandbox`` as ``api``'s caller."""
    return api.http.get(f"/fs/{op}", params=params, headers=api.data_headers(sandbox))


def fs_post(api: Api, sandbox: dict[str, Any], op: str, **body: Any) -> httpx.Response:
    """``POST /fs/<op>`` with the JSON ``body``."""
    return api.http.post(f"/fs/{op}", json=body, headers=api.data_headers(sandbox))


def fs_write(api: Api, sandbox: dict[str, Any], path: str, content: Any) -> httpx.Response:
    """``POST /fs/write`` of ``content`` (bytes, a file or an iterator) to ``path``."""
    return api.http.post(
        "/fs/write",
        data={"path": path},
        files={"file": ("blob", content)},
        headers=api.data_headers(sandbox),
    )


# -- requests written byte for byte (no client library rewrites them) --------------------------
def tls_exchange(broker: LocalBroker, data: bytes, *, lenient: bool = False) -> bytes:
    """``data`` sent to ``broker`` over TLS as it is; the whole answer, read until the broker
    closes. ``lenient``: a read that times out or breaks ends the answer (what came is it)."""
    url = urllib.parse.urlsplit(broker.url)
    host, port = url.hostname or "", url.port or 443
    context = ssl.create_default_context(cafile=broker.ca_bundle)
    with (
        socket.create_connection((host, port), timeout=15) as plain,
        context.wrap_socket(plain, server_hostname=host) as tls,
    ):
        tls.sendall(data)
        answer = b""
        try:
            while chunk := tls.recv(65536):
                answer += chunk
        except (TimeoutError, ssl.SSLError, ConnectionError):
            if not lenient:
                raise
    return answer


def raw_request(
    broker: LocalBroker,
    method: str,
    target: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    *,
    token: str | None,
    content_length: bool = True,
    extra: Sequence[str] = (),
) -> tuple[int, bytes, bytes]:
    """``method target`` with ``body`` exactly as given (``Content-Length`` unless not
    ``content_length``, a JSON ``Content-Type``, ``token`` as the bearer, then ``headers`` and
    the ``extra`` header lines); returns (status, raw head, body)."""
    url = urllib.parse.urlsplit(broker.url)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {url.hostname}:{url.port}", "Connection: close"]
    if content_length:
        lines.append(f"Content-Length: {len(body)}")
    lines += ["Content-Type: application/json", f"Authorization: Bearer {token}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    lines += list(extra)
    answer = tls_exchange(broker, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    head, _, rest = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, rest
