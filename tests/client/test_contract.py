"""The client's real traffic checked against the broker API's OpenAPI document."""

from __future__ import annotations

import json
import ssl
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import BrokerConnectionConfig, BrokerSandboxClient
from k8s_agent_sandbox_awx._upstream import SandboxNotFoundError
from k8s_agent_sandbox_awx.errors import LifetimeExceedsPolicyError, SandboxFileError

pytestmark = [pytest.mark.e2e, pytest.mark.upstream]  # the contract, with upstream's errors


class Recording(httpx.HTTPTransport):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exchanges: list[tuple[httpx.Request, bytes, httpx.Response, bytes]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read() if isinstance(request.stream, httpx.ByteStream) else b"<stream>"
        response = super().handle_request(request)
        content = response.read()
        self.exchanges.append((request, body, response, content))
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            content=content,
            extensions=response.extensions,
        )


def _parameters(operation: dict[str, Any], where: str) -> list[dict[str, Any]]:
    return [p for p in operation.get("parameters", []) if p.get("in") == where]


def _typed(text: str, param: dict[str, Any]) -> Any:
    kind = param["schema"].get("type")
    if kind == "integer":
        return int(text)
    if kind == "number":
        return float(text)
    if kind == "boolean" and text in ("true", "false"):
        return text == "true"
    return text


def test_client_traffic_conforms_to_openapi(broker: Any) -> None:
    from k8s_agent_sandbox_awx.testing._openapi import (
        check_response,
        load_openapi,
        match_path,
        validate,
    )

    doc = load_openapi()
    env = broker.environ("kubernetes")
    config = BrokerConnectionConfig.from_env(env)
    recording = Recording(verify=ssl.create_default_context(cafile=config.ca_cert))
    client = BrokerSandboxClient(config, environ=env, http_transport=recording)
    with client:
        client.healthz()
        client.whoami()
        sandbox = client.create_sandbox("python", labels={"team": "ml"}, env={"A": "1"})
        sandbox.commands.run("echo hi", timeout=5)
        sandbox.files.write("d/a.txt", b"abc")
        sandbox.files.read("d/a.txt")
        sandbox.files.list("d")
        sandbox.files.exists("d/a.txt")
        sandbox.files.write("d/s.bin", iter([b"one-", b"shot"]))
        sandbox.files.read("d/s.bin", format="text")
        sandbox.files.get_info("/app/d/a.txt")
        sandbox.files.make_dir("/workspace/m")
        sandbox.files.move("d/a.txt", "d/b.txt")
        with pytest.raises(SandboxFileError):
            sandbox.files.move("d/s.bin", "d/b.txt")
        sandbox.files.remove("d", recursive=True)
        list(sandbox.files.watch_dir("/workspace", timeout=0.5))
        sandbox.run_code("x = 1", envs={"A": "b"}, timeout=30)
        context = sandbox.create_code_context(cwd="/workspace", envs={"B": "c"})
        sandbox.run_code("x", context=context)
        sandbox.list_code_contexts()
        sandbox.restart_code_context(context)
        sandbox.remove_code_context(context)
        sandbox.set_timeout(200)
        with pytest.raises(LifetimeExceedsPolicyError):
            sandbox.set_timeout(10**6)
        sandbox.get_info()
        client.list_sandboxes({"team": "ml"})
        with pytest.raises(SandboxNotFoundError):
            client.get_info("sbx-unknown0")
    problems: list[str] = []
    for request, body, response, content in recording.exchanges:
        path = request.url.raw_path.decode().split("?")[0]
        template = match_path(doc, httpx.URL(path).path)
        assert template is not None, path
        operation = doc["paths"][template][request.method.lower()]
        for param in _parameters(operation, "header"):
            if param.get("required"):
                assert param["name"] in request.headers, (template, param["name"])
            if param["name"] in request.headers:
                problems += validate(
                    _typed(request.headers[param["name"]], param),
                    param["schema"],
                    doc,
                    f"{template} header {param['name']}",
                )
        for param in _parameters(operation, "query"):
            if param["name"] in request.url.params:
                value = _typed(request.url.params[param["name"]], param)
                problems += validate(value, param["schema"], doc, f"{template} ?{param['name']}")
        if request.method == "POST" and template == "/v1/sandboxes":
            assert "Idempotency-Key" in request.headers  # the client always sends one
        media = (operation.get("requestBody") or {}).get("content", {})
        if "application/json" in media and body:
            problems += validate(
                json.loads(body),
                media["application/json"]["schema"],
                doc,
                f"{template} request body",
            )
        ctype = response.headers.get("content-type", "")
        parsed: Any = json.loads(content) if ctype.startswith("application/json") else content
        problems += check_response(
            doc,
            request.method,
            httpx.URL(path).path,
            response.status_code,
            parsed,
            ctype or "application/json",
        )
        assert "authorization" not in {k.lower() for k in response.headers}
    assert problems == []
    assert len(recording.exchanges) >= 11
