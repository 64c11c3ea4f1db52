"""Failure injection: 503 bursts, a dropped connection after a command ran, slow readiness."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker


def test_503_burst_on_the_data_plane(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready()
    broker.inject_unavailable(2, retry_after=3, scope="data")
    headers = alice.data_headers(sandbox)
    for _ in range(2):
        resp = alice.http.get("/", headers=headers)
        assert resp.status_code == 503
        assert resp.headers["Retry-After"] == "3"
        assert resp.json()["code"] == "unavailable"
    assert alice.http.get("/", headers=headers).status_code == 200


def test_503_burst_on_create_allocates_nothing(broker: LocalBroker, alice: Any) -> None:
    broker.inject_unavailable(1, retry_after=1, scope="control", path="/v1/sandboxes")
    resp = alice.create(idempotency_key="k-503")
    assert resp.status_code == 503
    assert broker.claims() == []
    assert alice.create(idempotency_key="k-503").status_code == 201
    assert len(broker.claims()) == 1


def test_healthz_is_never_unavailable(broker: LocalBroker, alice: Any) -> None:
    broker.inject_unavailable(1, scope="any")
    assert alice.http.get("/v1/healthz").status_code == 200
    broker.clear_faults()
    assert alice.http.get("/v1/whoami").status_code == 200


def test_dropped_connection_after_the_command_ran(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready()
    name = sandbox["name"]
    assert broker.execution_count(name) == 0
    broker.drop_connection_after_execute(1, sandbox=name)
    with pytest.raises(httpx.RemoteProtocolError):
        alice.run(sandbox, "touch ran-once.txt")
    assert broker.execution_count(name) == 1
    headers = alice.data_headers(sandbox)
    exists = alice.http.get("/exists/ran-once.txt", headers=headers)
    assert exists.json()["exists"] is True
    out = alice.run(sandbox, "true")
    assert out.json()["exit_code"] == 0
    assert broker.execution_count(name) == 2


def test_slow_readiness(broker: LocalBroker, alice: Any) -> None:
    broker.set_readiness_delay(0.5)
    name = alice.create().json()["name"]
    now = alice.http.get(f"/v1/sandboxes/{name}").json()
    assert now["phase"] == "Pending"
    waited = alice.http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 10}).json()
    assert waited["phase"] == "Ready"
