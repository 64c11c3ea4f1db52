"""``/readyz`` and the router (issue 26, item 17), on a real API server with the stand-in
router (tests/_support/stand_in_router.py).

Before: ``/readyz`` said ready while nothing listened at ``router_url``, and the first command
failed with ``502 sandbox_unreachable``. Now the router is asked (``GET /`` with the broker's
router credential and no sandbox header: upstream's router checks the token, then refuses it
``400``): a replica is not ready until the router answered once since
start (a wrong ``router_url`` or credential stops a rollout); after that, a router that does
not answer is named under ``degraded`` (the replica stays in its Service: every replica sees
the same router, and the control plane still serves) and in the metric
``agent_sandbox_broker_upstream_ready{upstream="router"}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import Sandbox
from k8s_agent_sandbox_awx.broker.backends.kubernetes import _router_probe
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import Replica, StandInRouter, sdk_environ

WATCHDOG = 60.0


def until(replica: Replica, condition: Callable[[int, dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + WATCHDOG
    while True:
        status, body = replica.readyz()
        if condition(status, body):
            return body
        assert time.monotonic() < deadline, (status, body)
        time.sleep(0.1)


def router_gauge(replica: Replica) -> float:
    pytest.importorskip("prometheus_client", reason="needs the [broker] extra")
    from k8s_agent_sandbox_awx.broker.observability._metrics import Metrics

    text = Metrics(backend=replica.backend).exposition().decode()
    [line] = [x for x in text.splitlines() if x.startswith("agent_sandbox_broker_upstream_ready")
              and 'upstream="router"' in x]  # fmt: skip
    return float(line.rsplit(" ", 1)[1])


def test_readyz_covers_the_router(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_router_probe, "PROBE_SECONDS", 0.3)
    monkeypatch.setattr(_router_probe, "RETRY_SECONDS", 0.3)
    token = tmp_path / "router-token"
    token.write_text("router-secret\n")
    router = StandInRouter(controller, token, allow_loopback_pod_ip=True)  # not listening yet
    replica = replica_factory(router=(router.url, token), ready=False)

    # nothing listens at router_url: not ready, saying so (once the API server side is ready)
    body = until(replica, lambda s, b: "kubernetes" not in b.get("not_ready", {"kubernetes": 1}))
    assert body["status"] == "not ready"
    assert f"nothing answers at the router at {router.url}" in body["not_ready"]["router"]
    assert "backend.kubernetes.router_url" in body["not_ready"]["router"]
    assert router_gauge(replica) == 0

    with router:  # the router is up: ready, and a command runs through it
        assert until(replica, lambda s, b: s == 200) == {"status": "ready"}
        assert router_gauge(replica) == 1
        environ = sdk_environ(kube, namespace, replica, tmp_path / "token")
        sandbox = Sandbox.create(environ=environ, timeout=600)
        assert sandbox.commands.run("echo via-router").stdout == "via-router\n"

    # the router went away after it had answered: degraded, still ready (the control plane
    # serves: the sandbox's status is read), the gauge 0
    body = until(replica, lambda s, b: "degraded" in b)
    assert body["status"] == "ready" and "router" in body["degraded"]
    assert router.url in body["degraded"]["router"]
    assert router_gauge(replica) == 0
    assert sandbox.get_info() is not None

    again = StandInRouter(controller, token, allow_loopback_pod_ip=True)
    again.port, again.url = router.port, router.url  # the same Service address, back
    with again:
        assert until(replica, lambda s, b: "degraded" not in b) == {"status": "ready"}
        assert router_gauge(replica) == 1
        sandbox.kill()


def test_a_router_that_refuses_the_brokers_credential_is_named(
    controller: StandInController,
    python_pool: str,
    replica_factory: Callable[..., Replica],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_router_probe, "RETRY_SECONDS", 0.3)
    router_side = tmp_path / "router-side-token"
    router_side.write_text("the-routers-own\n")
    ours = tmp_path / "router-token"
    ours.write_text("not-the-routers\n")
    with StandInRouter(controller, router_side, allow_loopback_pod_ip=True) as router:
        replica = replica_factory(router=(router.url, ours), ready=False)
        body = until(replica, lambda s, b: "router" in b.get("not_ready", {}) and
                     "refuses" in b["not_ready"]["router"])  # fmt: skip
        assert (
            "router_token_file must hold the router's ROUTER_AUTH_TOKEN"
            in (body["not_ready"]["router"])
        )
        assert "not-the-routers" not in str(body) and "the-routers-own" not in str(body)
        ours.write_text("the-routers-own\n")  # fixed: ready
        until(replica, lambda s, b: s == 200)
