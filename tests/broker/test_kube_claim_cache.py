"""What the Kubernetes backend's claim cache keeps and answers (issue 29): a claim's state parsed
once per version of the claim, yet always that version's and as of now (an expired claim is
Terminating although the cache saw it Ready), no ``managedFields`` kept, and a route's checked
pod IP worked out once per list of IPs (a refused address refused every time). No API server:
the cache is fed the objects its list and watch would deliver."""

from __future__ import annotations

import asyncio
import copy
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from k8s_agent_sandbox_awx.broker.backends._interface import PENDING, READY, TERMINATING, Unroutable
from k8s_agent_sandbox_awx.broker.backends.kubernetes import _informer, _routes
from k8s_agent_sandbox_awx.broker.backends.kubernetes._api import KubeClient
from k8s_agent_sandbox_awx.broker.backends.kubernetes._claims import state_of
from k8s_agent_sandbox_awx.broker.backends.kubernetes._informer import ClaimCache
from k8s_agent_sandbox_awx.broker.backends.kubernetes._routes import Routes, RouteSettings

P = "broker.agent-sandbox-awx.io/"


def _rfc3339(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def claim(name: str = "sbx-one", *, ready: bool = True, ips: tuple[str, ...] = ("10.0.0.7",),
          expires: float | None = None, version: str = "1") -> dict[str, Any]:  # fmt: skip
    now = time.time()
    return {
        "metadata": {
            "name": name, "namespace": "team-a", "uid": "u-" + name, "resourceVersion": version,
            "creationTimestamp": _rfc3339(now - 60),
            "labels": {P + "owner": "0" * 40,
                       "app.kubernetes.io/managed-by": "agent-sandbox-awx-broker"},
            "annotations": {P + "issuer": "https://issuer", P + "subject": "alice",
                            P + "provider": "kubernetes", P + "template": "python",
                            P + "scopes": "commands"},
            "managedFields": [{"manager": "agent-sandbox-awx-broker", "operation": "Update",
                               "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {}}}],
        },
        "spec": {"warmPoolRef": {"name": "python"}, "lifecycle": {
            "shutdownTime": _rfc3339(expires if expires is not None else now + 3600),
            "shutdownPolicy": "Delete"}},
        "status": {
            "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                            "reason": "SandboxReady" if ready else "Pending",
                            "lastTransitionTime": _rfc3339(now - 30)}],
            "sandbox": {"name": name, "podIPs": list(ips)},
        },
    }  # fmt: skip


@pytest.fixture
def cache() -> ClaimCache:
    return ClaimCache(cast(KubeClient, None), ["team-a"])


def test_a_cached_claim_is_parsed_once_per_version(cache: ClaimCache) -> None:
    cache._put(claim())
    held = cache.get("team-a", "sbx-one")
    assert held is not None
    first = cache.state(held)
    assert first.phase == READY and first.pod_ips == ("10.0.0.7",)
    assert cache.state(held) is first  # the same version: not parsed again
    cache._put(claim(ready=False, ips=(), version="2"))  # its next version (a watch event)
    newer = cache.get("team-a", "sbx-one")
    assert newer is not None
    assert cache.state(newer).phase == PENDING and cache.state(newer).pod_ips == ()
    assert cache.state(held).phase == READY  # an object the cache no longer holds: parsed


def test_an_expired_claim_is_terminating_although_the_cache_saw_it_ready(
    cache: ClaimCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = time.time()
    cache._put(claim(expires=now + 30))
    held = cache.get("team-a", "sbx-one")
    assert held is not None
    assert cache.state(held).phase == READY
    monkeypatch.setattr(_informer, "time", SimpleNamespace(time=lambda: now + 31))  # its own
    late = cache.state(held)
    assert late.phase == TERMINATING and late.reason == "Expired"
    assert cache.state(held).phase == TERMINATING  # never memoized back to Ready


def test_a_removed_claim_is_not_answered_from_the_memo(cache: ClaimCache) -> None:
    cache._put(claim())
    held = cache.get("team-a", "sbx-one")
    assert held is not None
    cache.state(held)
    cache._remove(("team-a", "sbx-one"))
    assert cache.get("team-a", "sbx-one") is None
    assert cache._states == {}


def test_the_cache_keeps_no_managed_fields_and_the_same_state(cache: ClaimCache) -> None:
    obj = claim()
    original = copy.deepcopy(obj)
    cache._put(obj)
    held = cache.get("team-a", "sbx-one")
    assert held is not None and "managedFields" not in held["metadata"]
    expected, got = state_of(original), cache.state(held)
    assert got == expected


def test_a_routes_checked_pod_ip_follows_the_claims_ips() -> None:
    routes = Routes(RouteSettings(data_plane="pod"))
    try:
        cache = ClaimCache(cast(KubeClient, None), ["team-a"])
        cache._put(claim(ips=("fd00::7", "10.0.0.7")))
        held = cache.get("team-a", "sbx-one")
        assert held is not None
        assert routes.route(cache.state(held), 8888).host == "10.0.0.7"
        assert routes.route(cache.state(held), 8888).host == "10.0.0.7"
        cache._put(claim(ips=("10.0.0.9",), version="2"))  # a new pod
        moved = cache.get("team-a", "sbx-one")
        assert moved is not None
        assert routes.route(cache.state(moved), 8888).host == "10.0.0.9"
        cache._put(claim(ips=("127.0.0.5",), version="3"))  # refused, every time
        loop = cache.get("team-a", "sbx-one")
        assert loop is not None
        for _ in range(2):
            with pytest.raises(Unroutable, match="loopback"):
                routes.route(cache.state(loop), 8888)
        cache._put(claim(ips=(), version="4"))
        gone = cache.get("team-a", "sbx-one")
        assert gone is not None
        with pytest.raises(Unroutable, match="no pod IP yet"):
            routes.route(cache.state(gone), 8888)
    finally:
        asyncio.run(routes.close())


def test_each_pod_has_a_pool_of_its_own_and_a_gone_pods_pool_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One pool per pod runtime (a pool shared by every pod costs each request a scan of all
    its connections); a pool no claim leads to any more, once idle, is closed by ``prune``."""

    async def run() -> None:
        routes = Routes(RouteSettings(data_plane="pod"))
        cache = ClaimCache(cast(KubeClient, None), ["team-a"])
        for name, ip in (("sbx-one", "10.0.0.7"), ("sbx-two", "10.0.0.8")):
            cache._put(claim(name, ips=(ip,)))
        one, two = (cache.get("team-a", n) for n in ("sbx-one", "sbx-two"))
        assert one is not None and two is not None
        first = routes.route(cache.state(one), 8888)
        assert routes.route(cache.state(one), 8888).client is first.client  # kept
        other = routes.route(cache.state(two), 8888)
        assert other.client is not first.client
        assert routes.route(cache.state(one), 3000).client is routes.ports_http  # a port's
        now = time.monotonic()
        # the module's clock only: a patch of time.monotonic held every timer the process's event
        # loops armed meanwhile (the session broker's Date for 61 s; tests/testing/
        # test_local_broker_clocks.py)
        monkeypatch.setattr(_routes, "time", SimpleNamespace(monotonic=lambda: now + 30))
        assert routes.prune([cache.state(one).pod_ips]) == 0  # sbx-two's pool: used 30 s ago
        monkeypatch.setattr(_routes, "time", SimpleNamespace(monotonic=lambda: now + 61))
        assert routes.prune([cache.state(one).pod_ips]) == 1  # now idle, and no claim's
        await asyncio.gather(*routes._closing)  # the close, in its own task
        assert other.client.is_closed and not first.client.is_closed
        again = routes.route(cache.state(two), 8888)  # its pod back: a new pool
        assert again.client is not other.client and not again.client.is_closed
        await routes.close()
        assert first.client.is_closed and again.client.is_closed

    asyncio.run(run())
