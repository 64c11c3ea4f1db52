"""A sandbox's lifetime: PUT /v1/sandboxes/{name}/lifetime, the policy cap, the deadlines."""

from __future__ import annotations

import os
import re
import time
from datetime import datetime
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker

POLICY_CAP = 600  # the kubernetes policy of tests/broker/conftest.py


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _extend(api: Any, name: str, body: Any) -> httpx.Response:
    resp: httpx.Response = api.http.put(f"/v1/sandboxes/{name}/lifetime", json=body)
    return resp


def test_extend_lengthens_and_shortens(alice: Any) -> None:
    sandbox = alice.ready(lifetime_seconds=60)
    name = sandbox["name"]
    assert _ts(sandbox["expires_at"]) - _ts(sandbox["created_at"]) == 60
    before = time.time()
    longer = _extend(alice, name, {"seconds": 300})
    assert longer.status_code == 200, longer.text
    assert longer.json()["name"] == name
    assert int(before) + 300 <= _ts(longer.json()["expires_at"]) <= time.time() + 300
    again = _extend(alice, name, {"seconds": 300})  # idempotent: the same deadline, give or take
    assert abs(_ts(again.json()["expires_at"]) - _ts(longer.json()["expires_at"])) <= 1
    shorter = _extend(alice, name, {"seconds": 30})
    assert _ts(shorter.json()["expires_at"]) <= time.time() + 30
    got = alice.http.get(f"/v1/sandboxes/{name}").json()
    assert got["expires_at"] == shorter.json()["expires_at"]
    assert got["phase"] == "Ready"


def test_a_shortened_sandbox_is_deleted_on_time(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready()
    name = sandbox["name"]
    pid = broker.runtime_pid(name)
    assert pid is not None
    resp = _extend(alice, name, {"seconds": 2})
    assert resp.status_code == 200
    deadline = _ts(resp.json()["expires_at"])
    claim = next(c for c in broker.claims() if c["metadata"]["name"] == name)
    assert _ts(claim["spec"]["lifecycle"]["shutdownTime"]) == deadline
    assert alice.http.get(f"/v1/sandboxes/{name}").status_code == 200  # not before its time
    while alice.http.get(f"/v1/sandboxes/{name}").status_code == 200:
        assert time.time() < deadline + 5, "the broker did not delete the expired sandbox"
        time.sleep(0.1)
    assert time.time() >= deadline - 1
    assert alice.http.get(f"/v1/sandboxes/{name}").json()["code"] == "not_found"
    assert name not in [s["name"] for s in alice.http.get("/v1/sandboxes").json()["items"]]
    (manifest,) = [c for c in broker.claims(include_deleted=True) if c["metadata"]["name"] == name]
    assert manifest["status"]["conditions"][0]["reason"] == "Expired"
    with pytest.raises(ProcessLookupError):  # its runtime was stopped and reaped
        os.kill(pid, 0)
    out = alice.run(sandbox, "echo gone")
    assert out.status_code == 404


def test_expiry_at_create_still_applies(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready(lifetime_seconds=1)
    name = sandbox["name"]
    started = time.time()
    while alice.http.get(f"/v1/sandboxes/{name}").status_code == 200:
        assert time.time() < started + 6, "the broker did not delete the expired sandbox"
        time.sleep(0.1)


def test_the_cap_counts_from_creation(alice: Any) -> None:
    created = alice.create(lifetime_seconds=60).json()
    name = created["name"]
    assert _extend(alice, name, {"seconds": POLICY_CAP - 30}).status_code == 200
    resp = _extend(alice, name, {"seconds": POLICY_CAP})
    assert resp.status_code == 403
    body = resp.json()
    assert body["code"] == "lifetime_exceeds_policy"
    assert f"{POLICY_CAP} s from its creation" in body["detail"]
    assert "s are left" in body["detail"]
    # the refusal changed nothing
    got = alice.http.get(f"/v1/sandboxes/{name}").json()
    assert _ts(got["expires_at"]) - _ts(got["created_at"]) <= POLICY_CAP


def test_the_cap_refusal_labels_both_times(alice: Any) -> None:
    """The refusal said "from its creation (<the cap's time>)", which read as the creation
    time: it names the creation time and the cap's end, each labelled (issue 23)."""
    created = alice.create(lifetime_seconds=60).json()
    detail = _extend(alice, created["name"], {"seconds": POLICY_CAP}).json()["detail"]
    match = re.search(r"\(created (\S+)\), so it ends at the latest at (\S+);", detail)
    assert match, detail
    assert _ts(match[1]) == pytest.approx(_ts(created["created_at"]), abs=1)
    assert _ts(match[2]) == pytest.approx(_ts(created["created_at"]) + POLICY_CAP, abs=1)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"seconds": 0},
        {"seconds": -5},
        {"seconds": "5"},
        {"seconds": True},
        {"seconds": 1.5},
        {"seconds": 5, "extra": 1},
        [5],
    ],
)
def test_bad_bodies(alice: Any, body: Any) -> None:
    name = alice.create().json()["name"]
    resp = _extend(alice, name, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == "invalid_request"
    assert "seconds" in resp.json()["detail"]


def test_only_the_owner_extends(broker: LocalBroker, alice: Any, bob: Any, api: Any) -> None:
    name = alice.create(lifetime_seconds=60).json()["name"]
    resp = _extend(bob, name, {"seconds": 1})
    assert resp.status_code == 404
    assert resp.json()["code"] == "not_found"
    resp = _extend(api(None), name, {"seconds": 1})
    assert resp.status_code == 401
    assert _extend(alice, "sbx-missing", {"seconds": 1}).json()["code"] == "not_found"
    assert _extend(alice, "Bad_Name", {"seconds": 1}).json()["code"] == "invalid_path"
    got = alice.http.get(f"/v1/sandboxes/{name}").json()
    assert _ts(got["expires_at"]) - _ts(got["created_at"]) == 60
    assert alice.http.post(f"/v1/sandboxes/{name}/lifetime", json={"seconds": 1}).status_code == 404


def test_started_at(broker: LocalBroker, alice: Any) -> None:
    broker.set_readiness_delay(1.0)
    try:
        created = alice.create().json()
        assert created["started_at"] is None
        ready = alice.http.get(
            f"/v1/sandboxes/{created['name']}", params={"wait": "ready", "timeout": 20}
        ).json()
    finally:
        broker.set_readiness_delay(0.0)
    assert ready["phase"] == "Ready"
    assert _ts(ready["started_at"]) >= _ts(ready["created_at"])
