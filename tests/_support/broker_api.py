"""The local broker of ``tests/broker`` (its templates and policy) and ``Api``, an httpx client
for one identity: the broker's own tests talk to it directly, never through the client package,
over real HTTPS on 127.0.0.1 with the CA the broker generated at start and real signed tokens."""

from __future__ import annotations

import contextlib
import ssl
import sys
from collections.abc import Iterator
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
