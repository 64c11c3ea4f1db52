"""A scripted broker for the client's unit tests (httpx.MockTransport: no sockets) and a
stand-in credential source: ``tests/client/conftest.py`` turns them into fixtures."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx

from k8s_agent_sandbox_awx.credentials._credential import Credential

BROKER = "https://broker.test"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ0ZXN0In0.c2VjcmV0LXNpZ25hdHVyZQ"


class StubCredentials:
    """A CredentialSource stand-in: hands out tokens from a list, records calls."""

    def __init__(self, *tokens: str) -> None:
        self.tokens = list(tokens) or [TOKEN]
        self.index = 0
        self.calls: list[str] = []
        self.invalidated: list[str] = []
        self.lock = threading.Lock()

    def get_credential(self, audience: str) -> Credential:
        with self.lock:
            self.calls.append(audience)
            token = self.tokens[min(self.index, len(self.tokens) - 1)]
        return Credential(token=token, provider="stub", source="test")

    def invalidate(self, audience: str) -> None:
        with self.lock:
            self.invalidated.append(audience)
            self.index += 1


def sandbox_obj(name: str = "sbx-1", phase: str = "Pending", **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "name": name,
        "namespace": "team-a",
        "template": "python",
        "phase": phase,
        "ready": phase == "Ready",
        "reason": None,
        "message": None,
        "created_at": "2026-11-29T12:00:00Z",
        "expires_at": "2026-11-29T13:00:00Z",
        "labels": {},
        "annotations": {},
        "owner": {"provider": "kubernetes", "issuer": "https://k8s", "subject": "sa"},
        "router": {"sandbox_id": name, "namespace": "team-a", "port": 8888},
    }
    obj.update(extra)
    return obj


def error(status: int, code: str | None, detail: str, **headers: str) -> httpx.Response:
    """An error answer as the v1 broker makes it: a code in the body carries the broker's mark
    (``Agent-Sandbox-Broker-Error``) too."""
    body: dict[str, Any] = {"detail": detail}
    if code:
        body["code"] = code
        headers = {"Agent-Sandbox-Broker-Error": code, **headers}
    return httpx.Response(status, json=body, headers=headers)


class FakeBroker:
    """A scripted broker for MockTransport: per-route handlers plus a request log."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []
        self.routes: dict[tuple[str, str], Callable[[httpx.Request], httpx.Response]] = {}
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.ready_after_polls = 1
        self.polls = 0
        self.final_phase = "Ready"
        self.deleted: list[str] = []

    def route(self, method: str, path: str) -> Callable[[Any], Any]:
        def register(fn: Callable[[httpx.Request], httpx.Response]) -> Any:
            self.routes[(method, path)] = fn
            return fn

        return register

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.bodies.append(request.read())
        key = (request.method, request.url.path)
        if key in self.routes:
            return self.routes[key](request)
        return self.default(request)

    def default(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/sandboxes":
            name = f"sbx-{len(self.sandboxes) + 1}"
            self.sandboxes[name] = sandbox_obj(name)
            return httpx.Response(201, json=self.sandboxes[name])
        if path.startswith("/v1/sandboxes/"):
            name = path.rsplit("/", 1)[1]
            if name not in self.sandboxes:
                return error(404, "not_found", "no such sandbox")
            if request.method == "DELETE":
                self.deleted.append(name)
                del self.sandboxes[name]
                return httpx.Response(204)
            if request.url.params.get("wait") == "ready":
                self.polls += 1
                if self.polls >= self.ready_after_polls:
                    phase = self.final_phase
                    self.sandboxes[name].update(
                        phase=phase,
                        ready=phase == "Ready",
                        reason="ImagePull" if phase == "Failed" else None,
                    )
            return httpx.Response(200, json=self.sandboxes[name])
        if path == "/v1/sandboxes":
            return httpx.Response(200, json={"items": list(self.sandboxes.values())})
        if path.startswith("/commands"):
            return error(404, None, "Not Found")  # the legacy runtime (FastAPI) has no route
        if path == "/execute":
            cmd = json.loads(request.content)["command"]
            return httpx.Response(
                200, json={"stdout": f"ran {cmd}\n", "stderr": "", "exit_code": 0}
            )
        if path == "/v1/healthz":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/v1/whoami":
            return httpx.Response(200, json={"provider": "kubernetes", "subject": "sa"})
        if "x-sandbox-id" in request.headers:  # the runtime's own 404: no such endpoint
            return error(404, None, "Not Found")
        return error(404, "not_found", f"no route {path}")


def scripted_client(fake: FakeBroker, creds: StubCredentials, **settings: Any) -> Any:
    """A ``BrokerSandboxClient`` on ``fake`` (v1 unless ``broker_protocol`` says otherwise),
    authenticated by ``creds``, that never sleeps between its retries."""
    from k8s_agent_sandbox_awx import BrokerConnectionConfig, BrokerSandboxClient
    from k8s_agent_sandbox_awx.client.core._retry import RetryPolicy

    settings.setdefault("broker_protocol", "v1")  # the fake speaks v1 (no detection probe)
    config = BrokerConnectionConfig(broker_url=BROKER, **settings)
    client = BrokerSandboxClient(config, auth=creds, http_transport=httpx.MockTransport(fake))
    client._transport._sleep = lambda _s: None
    client._transport.retry = RetryPolicy(
        max_attempts=config.max_attempts, backoff_base=0.0, backoff_max=1.0
    )
    return client


class Kit:
    """What the client tests use of this module, as one fixture (``kit``)."""

    BROKER = BROKER
    TOKEN = TOKEN
    error = staticmethod(error)
    sandbox_obj = staticmethod(sandbox_obj)
    StubCredentials = StubCredentials
