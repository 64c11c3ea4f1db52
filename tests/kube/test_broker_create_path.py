"""The API round trips of a create through the Kubernetes backend (issue 21's create -> ready
benchmark, bench/bench_kubernetes.py (a); issue 26's quota ledger): a create with a new
Idempotency-Key (the SDK sends one on every create) is the write of the caller's quota ledger
and the POST of the claim, nothing before them; the first create of a caller also reads the
ledger (there is none), lists the caller's claims and creates the ledger; a replica whose copy
of the ledger another replica changed reads it again (a 409, then a GET); a repeat still
replays the claim the first made, without the ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests._support._api import CLAIM, collection
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import Replica, replica_client, token_for

pytestmark = pytest.mark.slow


def record_calls(replica: Replica) -> list[str]:
    """The API calls the replica's backend makes from now on, in order: the verb and the
    resource (``create sandboxclaims``), a refused one with its status (``patch leases 409``)."""
    client = replica.backend.client
    request = client._request
    calls: list[str] = []

    async def recorded(call: Any) -> dict[str, Any]:
        what = f"{call.verb} {call.resource.plural}"
        try:
            answer = await request(call)
        except Exception as exc:
            calls.append(f"{what} {getattr(exc, 'status', '?')}")
            raise
        calls.append(what)
        return answer

    client._request = recorded  # type: ignore[method-assign]
    return calls


def create(on: Replica, token: str, key: str, **body: Any) -> Any:
    """``POST /v1/sandboxes`` of template ``python`` (and ``body``) on ``on``, with ``key``."""
    with replica_client(on, token) as client:
        return client.post(
            "/v1/sandboxes", json={"template": "python", **body}, headers={"Idempotency-Key": key}
        )


def test_a_create_with_a_new_key_is_the_ledgers_write_and_one_post(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
) -> None:
    replica, other = replica_factory(max_sandboxes=3), replica_factory(max_sandboxes=3)
    token = token_for(kube, namespace, replica, other)
    calls, elsewhere = record_calls(replica), record_calls(other)
    first = create(replica, token, "k1")
    assert first.status_code == 201, first.text
    # the caller's first create: no ledger yet; its claims listed once to make it
    assert calls == ["get leases 404", "list sandboxclaims", "create leases",
                     "create sandboxclaims"]  # fmt: skip
    del calls[:]
    second = create(replica, token, "k2")
    assert second.status_code == 201, second.text
    assert calls == ["patch leases", "create sandboxclaims"]  # no look-up before the POST
    third = create(other, token, "k3")  # a replica without a copy of the ledger reads it first
    assert third.status_code == 201, third.text
    assert elsewhere == ["get leases", "patch leases", "create sandboxclaims"]
    del calls[:]
    refused = create(replica, token, "k4")  # its copy is stale now, and the ledger full
    assert refused.status_code == 429, refused.text
    assert calls[:3] == ["patch leases 409", "get leases", "list sandboxclaims"]
    assert calls[3:] in ([], ["patch leases"])  # claims made marked so (0), once
    del calls[:]
    again = create(replica, token, "k1")
    assert again.status_code == 200, again.text
    assert again.headers["Idempotency-Replayed"] == "true"
    assert again.json()["name"] == first.json()["name"]
    assert not [c for c in calls if "leases" in c or c.startswith("list")]  # no quota counted
    other_body = create(replica, token, "k1", labels={"x": "1"})
    assert other_body.status_code == 409 and other_body.json()["code"] == "idempotency_conflict"
    items = kube.get(collection(CLAIM, namespace))["items"]
    names = {first.json()["name"], second.json()["name"], third.json()["name"]}
    assert {c["metadata"]["name"] for c in items} == names


def test_one_callers_concurrent_creates_on_one_replica_do_not_conflict(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
) -> None:
    """Six creates of one caller at once on one replica: each writes the ledger once, on the
    version the one before it wrote (the replica makes one reservation at a time per ledger),
    and posts its claim: no 409 and no re-read of the ledger between them (concurrent writes
    from one version lost to each other: 1.7 PATCHes and 0.95 GETs of the ledger per create
    with four threads, bench/bench_kube_scale.py)."""
    from concurrent.futures import ThreadPoolExecutor

    replica = replica_factory(max_sandboxes=10)
    token = token_for(kube, namespace, replica)
    calls = record_calls(replica)
    assert create(replica, token, "first").status_code == 201  # the ledger made
    del calls[:]
    with ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(lambda key: create(replica, token, key), [f"k{i}" for i in range(6)])
        )
    assert [a.status_code for a in answers] == [201] * 6, [a.text for a in answers]
    assert sorted(calls) == sorted(["patch leases"] * 6 + ["create sandboxclaims"] * 6), calls
