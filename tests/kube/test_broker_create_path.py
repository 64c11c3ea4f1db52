"""The API round trips of a create through the Kubernetes backend (issue 21's create -> ready
benchmark, bench/bench_kubernetes.py (a)): a create with a new Idempotency-Key (the SDK sends
one on every create) is the POST of the claim and the LIST that counts the quota, nothing
before them; a repeat of it still replays the claim the first made.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests._support._api import CLAIM, collection
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import Replica
from tests.kube.test_broker_replicas import raw, token_for

pytestmark = pytest.mark.slow


def record_calls(replica: Replica) -> list[str]:
    """The verbs of the API calls the replica's backend makes from now on, in order."""
    client = replica.backend.client
    request = client._request
    verbs: list[str] = []

    async def recorded(call: Any) -> dict[str, Any]:
        verbs.append(call.verb)
        return await request(call)

    client._request = recorded  # type: ignore[method-assign]
    return verbs


def test_a_create_with_a_new_key_is_one_post_and_the_quota_list(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
) -> None:
    replica = replica_factory(max_sandboxes=3)
    token = token_for(kube, namespace, replica)
    verbs = record_calls(replica)
    key, body = str(uuid.uuid4()), {"template": "python"}
    with raw(replica, token) as client:
        made = client.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": key})
        assert made.status_code == 201, made.text
        assert verbs == ["create", "list"]  # no look-up of the key before the POST
        name = made.json()["name"]
        del verbs[:]
        again = client.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": key})
        assert again.status_code == 200, again.text
        assert again.headers["Idempotency-Replayed"] == "true"
        assert again.json()["name"] == name
        assert "list" not in verbs  # a replay counts no quota
        other = client.post(
            "/v1/sandboxes", json={**body, "labels": {"x": "1"}}, headers={"Idempotency-Key": key}
        )
        assert other.status_code == 409 and other.json()["code"] == "idempotency_conflict"
    items = kube.get(collection(CLAIM, namespace))["items"]
    assert [c["metadata"]["name"] for c in items] == [name]
