"""The activity keepalive is one object owned by the sandbox's data target (``KeptAlive``):
no request carries it; the transport of that sandbox's data plane (``transport.to(target)``)
sends the extension before a data-plane request when the target says it is due."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx

from k8s_agent_sandbox_awx.client.wire._dataplane import KeptAlive
from k8s_agent_sandbox_awx.client.wire._protocol import RequestSpec
from tests._support.scripted_broker import sandbox_obj


def test_the_data_target_owns_the_keepalive_and_its_transport_sends_it(
    make_client: Any, fake: Any
) -> None:
    extended: list[Any] = []

    @fake.route("PUT", "/v1/sandboxes/sbx-1/lifetime")
    def lifetime(request: httpx.Request) -> httpx.Response:
        extended.append(json.loads(request.content))
        return httpx.Response(200, json=sandbox_obj("sbx-1", "Ready", ready=True))

    @fake.route("POST", "/v1/sandboxes")
    def create(request: httpx.Request) -> httpx.Response:
        name = fake.default(request).json()["name"]
        fake.sandboxes[name]["expires_at"] = None  # no deadline known: an extension is due
        return httpx.Response(201, json=fake.sandboxes[name])

    assert "keepalive" not in {f.name for f in dataclasses.fields(RequestSpec)}
    client = make_client()
    kept = client.create_sandbox(keepalive_ttl_seconds=60)
    assert isinstance(kept._target, KeptAlive) and kept.files._api.target is kept._target
    assert kept.commands._transport is kept.files._transport is not client._transport
    assert kept.commands.run("echo hi").exit_code == 0  # /commands (404), then /execute
    paths = [f"{r.method} {r.url.path}" for r in fake.requests]
    first_data_plane = paths.index("POST /commands")
    assert paths[first_data_plane - 1] == "PUT /v1/sandboxes/sbx-1/lifetime"
    assert extended == [{"seconds": 60}]  # once: the second request is within the half window
    assert kept.refresh().name == "sbx-1" and len(extended) == 1  # the control plane: none
    plain = client.create_sandbox()
    assert not isinstance(plain._target, KeptAlive)
    assert plain.commands._transport is client._transport
