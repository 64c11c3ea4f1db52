"""Exact quotas across replicas (issue 26, item 5) on the real API server: racing creates of one
caller, split over two or three replicas, admit exactly ``min(max_sandboxes - held, racers)``;
every other is ``429 quota_exceeded`` saying what the caller holds once the race is decided,
and leaves nothing behind. The serialization point is the caller's quota ledger (a Lease, see
docs/broker/kubernetes.md#quotas): a replica killed between its reservation and its claim
blocks that slot only until the reservation lapses; a claim deleted or expired by someone else
frees its slot; a ledger deleted by someone else is rebuilt from the claims.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.broker.backends._interface import ClaimInvalid
from k8s_agent_sandbox_awx.broker.backends.kubernetes._quota import QUOTA
from tests._support._api import CLAIM, path
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import Replica, claims_in, replica_client, token_for

pytestmark = pytest.mark.slow

RACERS = 16
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{}/leases"


def race(replicas: list[Replica], token: str, racers: int = RACERS) -> list[httpx.Response]:
    """``racers`` creates at once (a barrier), spread round-robin over ``replicas``."""
    start = threading.Barrier(racers)
    targets = [replicas[i % len(replicas)] for i in range(racers)]
    with concurrent.futures.ThreadPoolExecutor(racers) as pool:
        return list(pool.map(lambda replica: _create(replica, token, start), targets))


def admitted(answers: list[httpx.Response], held: int, most: int = 2) -> set[str]:
    """The names the race admitted, after checking every answer: exactly ``most - held``
    201s; every other a 429 saying the caller holds ``most`` (the race decided)."""
    made = [a for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code != 201]
    assert len(made) == min(most - held, len(answers)), [a.text for a in refused][:3]
    for answer in refused:
        assert answer.status_code == 429, answer.text
        body = answer.json()
        assert body["code"] == "quota_exceeded"
        assert f"holds {most} live sandboxes" in body["detail"], body["detail"]
        assert f"(max_sandboxes = {most})" in body["detail"]
    return {a.json()["name"] for a in made}


def ledgers(kube: KubeAPIServer, namespace: str) -> list[dict[str, Any]]:
    return list(kube.get(LEASES.format(namespace))["items"])


def ledger_entries(kube: KubeAPIServer, namespace: str) -> set[str]:
    """The claim names in the namespace's one quota ledger."""
    [lease] = ledgers(kube, namespace)
    return set(json.loads(lease["metadata"]["annotations"][QUOTA]))


@pytest.mark.parametrize("replicas", [2, 3])
def test_racing_creates_admit_exactly_the_quota(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
    replicas: int,
) -> None:
    """16 racers over two or three replicas for a caller allowed two who holds none: two
    admitted, 14 refused saying the caller holds 2; after a delete (the caller holds one) 16
    more racers: one admitted; after deleting both, two again. Nothing a refused create made
    is left (claims, ledger)."""
    controller.pause()  # no pods: the claims stay Pending (they count as live)
    group = [replica_factory(max_sandboxes=2) for _ in range(replicas)]
    token = token_for(kube, namespace, *group)
    first = admitted(race(group, token), held=0)
    assert {c["metadata"]["name"] for c in claims_in(kube, namespace)} == first
    assert ledger_entries(kube, namespace) <= first
    gone = sorted(first)[0]
    with replica_client(group[-1], token) as client:
        assert client.delete(f"/v1/sandboxes/{gone}").status_code in (200, 202)
    second = admitted(race(group, token), held=1)
    live = {c["metadata"]["name"] for c in claims_in(kube, namespace)}
    assert live == (first - {gone}) | second and len(live) == 2
    assert ledger_entries(kube, namespace) <= live | {gone}
    with replica_client(group[0], token) as client:  # one after the race: still the quota
        again = client.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": "late"})
        assert again.status_code == 429 and "holds 2 live" in again.json()["detail"]
        for name in live:  # the caller holds none again: two more
            assert client.delete(f"/v1/sandboxes/{name}").status_code in (200, 202)
    third = admitted(race(group, token), held=0)
    assert {c["metadata"]["name"] for c in claims_in(kube, namespace)} == third


def test_a_replica_killed_mid_create_blocks_its_slots_only_until_the_reservations_lapse(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
) -> None:
    """Replica one reserves its slots, then dies before it makes any claim: its create, then
    16 racers over it and two other replicas. The others admit exactly what one left (the
    caller holds 2, counting one's reservations as being created); once the reservations
    lapse (set short here), racers fill exactly the slots they held. No claim of one's."""
    controller.pause()
    one, two, three = (replica_factory(max_sandboxes=2) for _ in range(3))
    for replica in (one, two, three):
        replica.backend.quota.reservation_seconds = 4.0  # (15 s)
    token = token_for(kube, namespace, one, two, three)
    reached: list[str] = []

    async def never_posts(_: Any, name: str, *__: Any) -> Any:
        reached.append(name)
        await asyncio.Event().wait()

    one.backend._post = never_posts  # type: ignore[method-assign]
    with concurrent.futures.ThreadPoolExecutor(RACERS + 1) as pool:
        doomed = pool.submit(race, [one], token, 1)
        kube.wait_for(lambda: reached, what="replica one's first reservation")
        start = threading.Barrier(RACERS)
        answers = [pool.submit(_create, r, token, start) for r in [one, two, three] * 5 + [two]]
        others = [a for i, a in enumerate(answers) if i % 3 or i == RACERS - 1]
        concurrent.futures.wait(others, 60)
        for answer in answers[::3][:5]:  # one's: refused, or reserved and hanging
            with contextlib.suppress(concurrent.futures.TimeoutError):
                answer.result(2)
        one.kill()
        with pytest.raises(httpx.TransportError):
            doomed.result(30)
    hung = len(reached)
    assert 1 <= hung <= 2
    decided = [a.result() for a in others]
    made = admitted(decided, held=hung)
    for answer in decided:  # one's reservations count as being created (and maybe others')
        if answer.status_code == 429:
            found = re.search(r"\((\d) of them still being created\)", answer.json()["detail"])
            assert found is not None and hung <= int(found[1]) <= 2, answer.json()["detail"]
    assert {c["metadata"]["name"] for c in claims_in(kube, namespace)} == made
    deadline = time.monotonic() + 30
    while len(claims_in(kube, namespace)) < 2:  # the reservations lapse: their slots are free
        assert time.monotonic() < deadline, "the dead replica's reservations never lapsed"
        held = len(claims_in(kube, namespace))
        made |= {a.json()["name"] for a in race([two, three], token) if a.status_code == 201}
        assert len(made) <= 2 and len(claims_in(kube, namespace)) >= held
        time.sleep(0.2)
    assert {c["metadata"]["name"] for c in claims_in(kube, namespace)} == made
    assert not set(reached) & made
    assert admitted(race([two, three], token), held=2) == set()


def _create(replica: Replica, token: str, start: threading.Barrier) -> httpx.Response:
    """One create with a new Idempotency-Key, sent once every racer waits at ``start``."""
    with replica_client(replica, token) as client:
        start.wait(30)
        key = {"Idempotency-Key": str(uuid.uuid4())}
        return client.post("/v1/sandboxes", json={"template": "python"}, headers=key)


def test_claims_deleted_or_expired_by_someone_else_free_their_slots(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
) -> None:
    """The caller fills its quota; an administrator deletes one claim and moves the other's
    shutdownTime into the past (the controller expires it): each frees a slot for the next
    create. A ledger deleted by someone else is rebuilt from the claims: the quota holds."""
    controller.pause()
    one, other = replica_factory(max_sandboxes=2), replica_factory(max_sandboxes=2)
    token = token_for(kube, namespace, one, other)

    def create(replica: Replica) -> httpx.Response:
        with replica_client(replica, token) as client:
            key = {"Idempotency-Key": str(uuid.uuid4())}
            return client.post("/v1/sandboxes", json={}, headers=key)

    first, second = create(one).json()["name"], create(other).json()["name"]
    assert create(one).status_code == 429
    kube.delete(path(CLAIM, namespace, first))  # by someone else
    replaced = create(other)
    assert replaced.status_code == 201, replaced.text
    past = {"spec": {"lifecycle": {"shutdownTime": "2020-01-01T00:00:00Z"}}}
    kube.merge_patch(path(CLAIM, namespace, second), past)  # expired
    again = create(one)
    assert again.status_code == 201, again.text
    assert create(other).status_code == 429
    [lease] = ledgers(kube, namespace)
    at = LEASES.format(namespace) + "/" + lease["metadata"]["name"]
    kube.delete(at)  # by someone else: rebuilt from the claims
    for replica in (one, other):
        refused = create(replica)
        assert refused.status_code == 429 and "holds 2 live" in refused.json()["detail"]
    kube.delete(path(CLAIM, namespace, again.json()["name"]))
    last = create(one)
    assert last.status_code == 201, last.text
    held = {replaced.json()["name"], last.json()["name"]}
    assert ledger_entries(kube, namespace) == held
    kube.merge_patch(at, {"metadata": {"annotations": {QUOTA: "not json"}}})
    for replica in (one, other):  # an unreadable ledger is rebuilt from the claims too
        refused = create(replica)
        assert refused.status_code == 429 and "holds 2 live" in refused.json()["detail"]
    assert ledger_entries(kube, namespace) == held
    assert {c["metadata"]["name"] for c in claims_in(kube, namespace)} >= held
    forever = json.dumps({"sbx-forged": 32503680000, **dict.fromkeys(held, 0)})
    kube.merge_patch(at, {"metadata": {"annotations": {QUOTA: forever}}})  # by someone else
    kube.delete(path(CLAIM, namespace, last.json()["name"]))
    kube.wait_for(lambda: len(claims_in(kube, namespace)) < 3, what="the claim gone")
    after = create(other)  # a reservation no broker writes holds no slot
    assert after.status_code == 201, after.text
    assert "sbx-forged" not in ledger_entries(kube, namespace)


def test_a_claim_the_api_server_refuses_releases_its_reservation(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
) -> None:
    """A create whose claim the API server refuses (400 invalid_request) leaves no
    reservation: the caller's one slot is free for the next create at once."""
    controller.pause()
    replica = replica_factory(max_sandboxes=1)
    token = token_for(kube, namespace, replica)
    post = replica.backend._post

    async def refused_once(*args: Any) -> Any:
        replica.backend._post = post  # type: ignore[method-assign]
        raise ClaimInvalid("the API server refused the claim: spec.env: Invalid value")

    replica.backend._post = refused_once  # type: ignore[method-assign]
    with replica_client(replica, token) as client:
        first = client.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": "one"})
        assert first.status_code == 400 and first.json()["code"] == "invalid_request"
        assert ledger_entries(kube, namespace) == set()
        second = client.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": "two"})
        assert second.status_code == 201, second.text
    assert ledger_entries(kube, namespace) == {second.json()["name"]}
