"""Two replicas of the Kubernetes-backed broker on one API server (tests/_support/kube_broker.py):
every fact is in the claims (and the callers' quota ledgers), so either answers for a sandbox
the other made, the quota holds exactly across both (tests/kube/test_broker_quota_race.py
races more), and a create whose replica died after making the claim is adopted by the
caller's retry (the same Idempotency-Key) on the other replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import Sandbox
from tests._support._api import CLAIM, path
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import Replica, claims_in, replica_client, sdk_environ, token_for

pytestmark = pytest.mark.slow

OWNER = "broker.agent-sandbox-awx.io/owner"


@pytest.fixture
def pair(replica_factory: Callable[..., Replica]) -> tuple[Replica, Replica]:
    """Two replicas of one configuration (each its own port and public URL)."""
    return replica_factory(max_sandboxes=2), replica_factory(max_sandboxes=2)


@pytest.mark.parametrize("protocol", ["v1", "rpc"])
def test_a_sandbox_made_on_one_replica_is_used_and_deleted_on_the_other(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    pair: tuple[Replica, Replica],
    tmp_path: Path,
    protocol: str,
) -> None:
    one, other = pair
    both = [one.url, other.url]
    env_one = sdk_environ(kube, namespace, one, tmp_path / "t1", protocol=protocol, audiences=both)
    env_other = sdk_environ(
        kube, namespace, other, tmp_path / "t2", protocol=protocol, audiences=both
    )
    made = Sandbox.create(environ=env_one, timeout=600)
    try:
        made.files.write("from-one.txt", b"written through replica one")
        there = Sandbox.connect(made.name, environ=env_other)
        try:
            assert there.files.read("from-one.txt") == b"written through replica one"
            result = there.commands.run("echo on-the-other")
            assert (result.stdout, result.exit_code) == ("on-the-other\n", 0)
            there.set_timeout(1200)
            claim = kube.get(path(CLAIM, namespace, made.name))
            shutdown = datetime.fromisoformat(claim["spec"]["lifecycle"]["shutdownTime"])
            assert 1190 <= shutdown.timestamp() - time.time() <= 1201
            seen = made.get_info()  # read through replica one
            assert seen.ready
            if protocol == "v1":  # (/rpc's status has no lifetime)
                assert seen.expires_at and datetime.fromisoformat(seen.expires_at) == shutdown
            there.kill()
        finally:
            there.close_connection()
        assert all(c["metadata"]["name"] != made.name for c in claims_in(kube, namespace))
        assert not made.is_running()  # replica one sees it gone too
    finally:
        made.kill()


def test_concurrent_creates_on_both_replicas_admit_exactly_the_maximum(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    pair: tuple[Replica, Replica],
) -> None:
    """Six creates at once, three on each replica, for a caller allowed two: two claims are
    made, every other create is 429 quota_exceeded naming the maximum (before issue 26 they
    could all be refused), and once they are all answered no create is admitted."""
    controller.pause()  # no pods: the claims stay Pending (they count as live)
    token = token_for(kube, namespace, *pair)
    start = threading.Barrier(6)

    def create(replica: Replica) -> httpx.Response:
        with replica_client(replica, token) as client:
            start.wait(10)
            return client.post(
                "/v1/sandboxes",
                json={"template": "python"},
                headers={"Idempotency-Key": str(uuid.uuid4())},
            )

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(create, [*pair, *pair, *pair]))
    made = [a for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code != 201]
    assert len(made) == 2
    for answer in refused:
        assert answer.status_code == 429, answer.text
        body = answer.json()
        assert body["code"] == "quota_exceeded" and "(max_sandboxes = 2)" in body["detail"]
    live = {c["metadata"]["name"] for c in claims_in(kube, namespace)}
    assert live == {a.json()["name"] for a in made}
    statuses = []
    for replica in [*pair, *pair]:  # one after the other: up to two in all, then 429
        with replica_client(replica, token) as client:
            key = {"Idempotency-Key": str(uuid.uuid4())}
            statuses.append(client.post("/v1/sandboxes", json={}, headers=key).status_code)
    assert statuses == [201] * (2 - len(made)) + [429] * (2 + len(made))
    assert len(claims_in(kube, namespace)) == 2


def test_a_create_whose_replica_died_is_adopted_by_the_retry_on_the_other(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    pair: tuple[Replica, Replica],
    tmp_path: Path,
) -> None:
    """Replica one makes the claim, then dies before it answers; the caller's retry with the
    same Idempotency-Key and body goes to replica two, which finds the claim (its name is the
    caller's and the key's), sees its owner and request digest match and replays it: one
    sandbox, usable (also when the retry's lookup missed the claim and its POST is told
    AlreadyExists); the same key with another body is a conflict."""
    one, other = pair
    token = token_for(kube, namespace, one, other)
    reached = threading.Event()

    async def never_answer(*_: Any) -> None:
        reached.set()
        await asyncio.Event().wait()

    post = one.backend._post

    async def post_then_never_answer(*args: Any) -> None:
        await post(*args)  # the claim is made; its answer never comes
        await never_answer()

    one.backend._post = post_then_never_answer  # type: ignore[method-assign]
    key, body = str(uuid.uuid4()), {"template": "python", "labels": {"run": "1"}}

    def first_attempt() -> httpx.Response:
        with replica_client(one, token) as client:
            return client.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": key})

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        attempt = pool.submit(first_attempt)
        assert reached.wait(30), "replica one did not make the claim"
        [claim] = claims_in(kube, namespace)
        assert claim["metadata"]["labels"]["run"] == "1"
        one.kill()
        with pytest.raises(httpx.TransportError):
            attempt.result(30)
    with replica_client(other, token) as client:
        again = client.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": key})
        assert again.status_code == 200, again.text
        assert again.headers["Idempotency-Replayed"] == "true"
        assert again.json()["name"] == claim["metadata"]["name"]

        async def saw_nothing(*_: Any, **__: Any) -> None:
            return None  # as when the other replica's POST lands just after this lookup

        other.backend.replay = saw_nothing  # type: ignore[method-assign]
        raced = client.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": key})
        assert raced.status_code == 200, raced.text  # the POST met AlreadyExists: replayed
        assert raced.json()["name"] == claim["metadata"]["name"]
        changed = {**body, "labels": {"run": "2"}}
        conflict = client.post("/v1/sandboxes", json=changed, headers={"Idempotency-Key": key})
        assert conflict.status_code == 409 and conflict.json()["code"] == "idempotency_conflict"
    assert [c["metadata"]["uid"] for c in claims_in(kube, namespace)] == [claim["metadata"]["uid"]]
    env = sdk_environ(kube, namespace, other, tmp_path / "token")
    adopted = Sandbox.connect(claim["metadata"]["name"], environ=env, ready_timeout=60)
    try:
        assert adopted.commands.run("echo adopted").stdout == "adopted\n"
    finally:
        adopted.kill()
    deadline = time.monotonic() + 20
    while claims_in(kube, namespace) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert claims_in(kube, namespace) == []
