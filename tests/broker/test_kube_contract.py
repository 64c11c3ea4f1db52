"""The Kubernetes backend against agent-sandbox's contract (issue 28): the router headers a route
carries (the claim's pod IP, IPv4 first), the methods a router takes, an IPv6 pod's WebSocket
URI, a warm-adopted claim's ``started_at``, and the pod labels the controller would refuse.
Upstream's code at kubernetes-sigs/agent-sandbox commit 2fd412d5 says each rule (cited below).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx.broker.backends._interface import READY, ClaimInvalid, Owner, Route
from k8s_agent_sandbox_awx.broker.backends.kubernetes._claims import KubeClaimState, state_of
from k8s_agent_sandbox_awx.broker.backends.kubernetes._pod_metadata import (
    DEFAULT_LABEL_DOMAINS,
    check_pod_metadata,
)
from k8s_agent_sandbox_awx.broker.backends.kubernetes._routes import (
    ROUTER_METHODS,
    Routes,
    RouteSettings,
    checked_pod_ip,
    preferred_pod_ip,
)
from k8s_agent_sandbox_awx.broker.dataplane._websocket import websocket_uri


def kube_state(**fields: Any) -> KubeClaimState:
    base: dict[str, Any] = dict(
        name="claim-1", namespace="team-a", template="python", owner=Owner("i", "s", "p"),
        labels={}, annotations={}, stamps={}, env={}, created_at=0.0, expires_at=1.0,
        phase=READY, reason=None, message=None, transition_at=0.0, started_at=0.0, bound=True,
        scopes=frozenset({"commands"}), uid="u", sandbox_name="python-x7k2p",
        pod_ips=("10.0.0.7",),
    )  # fmt: skip
    return KubeClaimState(**{**base, **fields})


@contextlib.contextmanager
def routes(**settings: Any) -> Iterator[Routes]:
    made = Routes(RouteSettings(**settings))
    try:
        yield made
    finally:
        asyncio.run(made.close())


# ------------------------------------------------------------------------------ pod IPs


@pytest.mark.parametrize(
    ("ips", "chosen"),
    [
        (["fd00::7", "10.0.0.7"], "10.0.0.7"),  # IPv6-first dual stack: IPv4 wins
        (["10.0.0.7", "fd00::7"], "10.0.0.7"),
        (["fd00::7"], "fd00::7"),  # IPv6 only
        (["FD00:0:0::7"], "fd00::7"),  # canonical form
        (["::ffff:10.0.0.9", "fd00::7"], "10.0.0.9"),  # IPv4-mapped counts as IPv4
        (["not-an-ip", " 10.0.0.8 "], "10.0.0.8"),
        (["garbage"], None),
        ([], None),
    ],
)
def test_the_pod_ip_is_chosen_as_upstreams_client_chooses_it(
    ips: list[str], chosen: str | None
) -> None:
    """``select_pod_ip`` (clients/python/.../k8s_agent_sandbox/utils.py): the first IPv4
    address, else the first valid one (was: ``podIPs[0]``, an IPv6 address first)."""
    assert preferred_pod_ip(ips) == chosen


def test_a_pod_route_on_ipv6_first_dual_stack_takes_the_ipv4_address() -> None:
    state = kube_state(pod_ips=("fd00::7", "10.0.0.7"))
    with routes(data_plane="pod") as made:
        assert made.route(state, 8888).host == "10.0.0.7"
    with routes(data_plane="pod") as made:
        assert made.route(kube_state(pod_ips=("fd00::7",)), 8888).host == "fd00::7"


def test_the_loopback_rule_applies_to_the_chosen_address() -> None:
    from k8s_agent_sandbox_awx.broker.backends._interface import Unroutable

    with pytest.raises(Unroutable, match="loopback, link-local"):
        checked_pod_ip(["fd00::7", "169.254.0.9"], "claim-1", False)
    assert checked_pod_ip(["127.0.0.9"], "claim-1", True) == "127.0.0.9"
    with pytest.raises(Unroutable, match="no usable pod IP"):
        checked_pod_ip(["nope"], "claim-1", True)


def test_a_websocket_uri_brackets_an_ipv6_pod_ip() -> None:
    """The WebSocket to a port of an IPv6 pod (was ``ws://fd00::7:3000/``, no host at all)."""
    with routes(data_plane="pod") as made:
        route = made.route(kube_state(pod_ips=("fd00::7",)), 3000)
        assert websocket_uri(route, b"/socket?x=1") == "ws://[fd00::7]:3000/socket?x=1"
        route = made.route(kube_state(), 3000)
        assert websocket_uri(route, b"/") == "ws://10.0.0.7:3000/"


def test_a_websocket_reaches_a_server_on_an_ipv6_address() -> None:
    """Not only the text: a WebSocket opened at that URI reaches a server on ``::1``."""
    websockets = pytest.importorskip("websockets.asyncio.server")
    from websockets.asyncio.client import connect

    async def main() -> str:
        async def echo(socket: Any) -> None:
            await socket.send("hello from ::1")

        async with websockets.serve(echo, "::1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            route = Route("::1", port, client=None)  # type: ignore[arg-type]
            async with connect(websocket_uri(route, b"/")) as socket:
                return str(await socket.recv())

    assert asyncio.run(main()) == "hello from ::1"


# ------------------------------------------------------------------------------ router


def test_a_router_route_carries_the_claims_pod_ip() -> None:
    """Upstream's router finds the pod by X-Sandbox-Pod-IP, else by the Sandbox's Service's
    DNS name, which warm-pool Sandboxes of a template without ``service: true`` lack
    (sandbox_router.py ``_resolve_target``): the route sends the claim's pod IP."""
    state = kube_state(pod_ips=("fd00::7", "10.0.0.7"))
    with routes(router_url="http://router:8080") as made:
        route = made.route(state, 8888)
        headers = dict(route.headers)
        assert headers[b"x-sandbox-id"] == b"python-x7k2p"
        assert headers[b"x-sandbox-pod-ip"] == b"10.0.0.7"
        assert route.methods == ROUTER_METHODS == {"GET", "POST", "PUT", "DELETE", "PATCH"}
        no_ip = made.route(kube_state(pod_ips=()), 8888)  # none yet: the router's DNS name
        assert b"x-sandbox-pod-ip" not in dict(no_ip.headers)
    with routes(router_url="http://router:8080", router_pod_ip=False) as made:
        assert b"x-sandbox-pod-ip" not in dict(made.route(state, 8888).headers)


def test_a_router_route_refuses_a_pod_ip_the_router_would_refuse() -> None:
    """A loopback pod IP would be the router's ``400 Invalid target IP address``: refused
    before sending, unless allowed (tests on one machine)."""
    from k8s_agent_sandbox_awx.broker.backends._interface import Unroutable

    state = kube_state(pod_ips=("127.0.0.9",))
    with routes(router_url="http://router:8080") as made, pytest.raises(Unroutable):
        made.route(state, 8888)
    with routes(router_url="http://router:8080", allow_loopback_pod_ips=True) as made:
        assert dict(made.route(state, 8888).headers)[b"x-sandbox-pod-ip"] == b"127.0.0.9"


def test_the_forward_drops_every_x_sandbox_header_of_the_caller() -> None:
    from k8s_agent_sandbox_awx.broker.dataplane._forward import forwarded_headers

    raw = [(b"X-Sandbox-Pod-IP", b"10.9.9.9"), (b"x-sandbox-pod-ip", b"10.9.9.8"),
           (b"X-SANDBOX-UID", b"u"), (b"accept", b"*/*")]  # fmt: skip
    assert forwarded_headers(raw) == [(b"accept", b"*/*")]


# ------------------------------------------------------------------------------ started_at


def claim(created: str, ready_since: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "sbx-1", "namespace": "team-a", "creationTimestamp": created,
                     "annotations": {"broker.agent-sandbox-awx.io/created-at": created}},
        "spec": {"warmPoolRef": {"name": "python"},
                 "lifecycle": {"shutdownTime": "2999-01-01T00:00:00Z"}},
        "status": {"sandbox": {"name": "python-x7k2p", "podIPs": ["10.0.0.7"]},
                   "conditions": [{"type": "Ready", "status": "True", "reason": "DependenciesReady",
                                   "lastTransitionTime": ready_since}]},
    }  # fmt: skip


def test_a_warm_adopted_claim_was_not_started_before_it_was_created() -> None:
    """The controller forwards the Sandbox's Ready condition to the claim
    (sandboxclaim_controller.go ``computeReadyCondition``): an adopted warm Sandbox brings the
    time it warmed up, before the claim existed. ``started_at`` is then the claim's creation
    (was: the warm-up time, earlier than ``created_at``)."""
    state = state_of(claim("2026-12-01T12:06:42Z", "2026-12-01T11:00:00Z"), now=0.0)
    assert state.started_at == state.created_at == state.server_created_at
    assert state.transition_at == state.created_at
    cold = state_of(claim("2026-12-01T12:06:42Z", "2026-12-01T12:06:45Z"), now=0.0)
    assert cold.started_at == cold.created_at + 3  # a cold start: its own Ready time


# ------------------------------------------------------------------------------ pod labels


@pytest.mark.parametrize(
    ("labels", "annotations", "message"),
    [
        ({"team": "a"}, {}, "pod label 'team' has no domain prefix"),
        ({"example.com/team": "a"}, {}, "pod label 'example.com/team' is in domain 'example.com'"),
        ({"app": "sandbox-router"}, {}, "pod label app=sandbox-router is refused"),
        ({}, {"kubernetes.io/x": "1"}, "pod annotation 'kubernetes.io/x' is in a system domain"),
        ({}, {"a.k8s.io/x": "1"}, "pod annotation 'a.k8s.io/x' is in a system domain"),
    ],
)
def test_pod_metadata_the_controller_would_refuse_is_refused_first(
    labels: dict[str, str], annotations: dict[str, str], message: str
) -> None:
    """``validateAdditionalPodMetadata`` (sandboxclaim_controller.go): it would fail the claim
    with ``InvalidMetadata`` after it exists; the create is refused first."""
    with pytest.raises(ClaimInvalid) as refused:
        check_pod_metadata({"labels": labels, "annotations": annotations}, DEFAULT_LABEL_DOMAINS)
    assert message in refused.value.detail
    if labels and "app" not in labels:
        assert "sandbox.users.io" in refused.value.detail
        assert "backend.kubernetes.pod_label_domains" in refused.value.detail


def test_pod_metadata_the_controller_accepts_passes() -> None:
    check_pod_metadata(
        {"labels": {"sandbox.users.io/team": "a", "x.SANDBOX.users.io/y": "b"},
         "annotations": {"example.com/a": "1",
                         "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}},
        DEFAULT_LABEL_DOMAINS,
    )  # fmt: skip
    check_pod_metadata({"labels": {"corp.example/team": "a"}}, ("corp.example",))
    with pytest.raises(ClaimInvalid):
        check_pod_metadata({"labels": {"sandbox.users.io/team": "a"}}, ("corp.example",))
