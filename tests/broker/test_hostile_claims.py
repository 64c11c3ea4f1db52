"""Hostile claims in signed tokens: a time claim that is no date (NaN, an infinity, 1e308, a
string...) is ``401 token_malformed`` on every route, never a 500; a claim spelled two ways
(literal ``"kubernetes.io.namespace"`` and nested) is refused, and a token of one spelling is
matched and placed by that same value. Real requests against the loopback broker of
tests/broker (and a ``broker serve`` replica), real signed tokens."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.broker_api import Api
from tests._support.broker_server import Pki
from tests._support.hostile_claims import TIME_CLAIMS
from tests._support.kube import free_ports
from tests._support.kube_broker import Replica
from tests._support.oidc_issuer import BackgroundIssuer

# what json.dumps can write of the fuzzing cases (tests/_support/hostile_claims.py has them all,
# 1e999 and the other raw literals included, for the verifier's own tests)
HOSTILE_TIMES: dict[str, Any] = {
    "NaN": math.nan,
    "Infinity": math.inf,
    "-Infinity": -math.inf,
    "1e308": 1e308,
    "a 400-digit integer": 10**400,
    "year 10000": 253402300800,
    "negative": -1,
    "a string": "1900000000",
    "true": True,
}


def requests_of(api: Api) -> dict[str, Callable[[], httpx.Response]]:
    """The requests a token reaches the claim rules on: whoami, both creates, the data plane."""
    data = {"X-Sandbox-ID": "sbx-any", "X-Sandbox-Namespace": "team-a"}
    return {
        "whoami": lambda: api.http.get("/v1/whoami"),
        "create": lambda: api.http.post("/v1/sandboxes", json={}),
        "rpc create": lambda: api.http.post("/rpc", json={"op": "create"}),
        "data plane": lambda: api.http.get("/commands", headers=data),
    }


@pytest.mark.parametrize("claim", TIME_CLAIMS)
def test_a_time_claim_that_is_no_date_is_401_everywhere(
    broker: LocalBroker, api: Callable[..., Api], claim: str
) -> None:
    """An issuer-signed token whose exp, nbf or iat is NaN, an infinity, 1e308, huge, negative
    or not a number: 401 token_malformed on every route, never a 500 with a traceback."""
    got = {}
    for case, value in HOSTILE_TIMES.items():
        client = api(broker.issue_kubernetes_token("team-a", "alice", claims={claim: value}))
        for route, send in requests_of(client).items():
            answer = send()
            if route == "rpc create":  # /rpc's errors are plain text, its reason says the rule
                rule = "NumericDate" in answer.text or "not JSON" in answer.text
                got[case, route] = (answer.status_code, "token_malformed" if rule else answer.text)
            else:
                got[case, route] = (answer.status_code, answer.json().get("code"))
    assert got == {key: (401, "token_malformed") for key in got}


# -- item 14: a policy decides on one claim and places by another ---------------------------


def spelled_config(path: Path, issuer: BackgroundIssuer, pki: Pki, port: int) -> Path:
    """``broker serve``'s configuration (local backend) trusting ``issuer`` as a Kubernetes
    issuer: team-a's ServiceAccounts (matched by their claim) in their own namespace."""
    path.write_text(f"""\
[server]
listen = "127.0.0.1:{port}"
public_url = "https://127.0.0.1:{port}"
tls_cert_file = "{pki.cert_file}"
tls_key_file = "{pki.key_file}"

[[issuers]]
name = "cluster"
url = "{issuer.url}"
provider = "kubernetes"
ca_file = "{issuer.ca_file}"

[[policies]]
name = "team-a"
issuer = "cluster"
claims = {{ "kubernetes.io.namespace" = "team-a" }}
warm_pools = ["python"]
namespace = "{{caller.namespace}}"

[backend]
kind = "local"

[backend.local]
templates = {{ python = "" }}
""")
    return path


@pytest.fixture
def spelled_broker(tmp_path: Path) -> Iterator[tuple[Replica, BackgroundIssuer, Pki]]:
    pki = Pki(tmp_path)
    pki.write(pki.issue())
    with BackgroundIssuer(tmp_path) as issuer:
        [port] = free_ports(1)
        replica = Replica(spelled_config(tmp_path / "broker.toml", issuer, pki, port))
        try:
            yield replica.start(), issuer, pki
        finally:
            replica.stop()


def test_a_claim_spelled_two_ways_is_refused_and_one_spelling_decides_and_places(
    spelled_broker: tuple[Replica, BackgroundIssuer, Pki],
) -> None:
    """A token carrying the literal claim ``"kubernetes.io.namespace": "team-a"`` and the
    nested ``kubernetes.io.namespace`` ``team-b`` was admitted by team-a's policy (which read
    the literal) and its sandbox placed in team-b (``{caller.namespace}`` read the nested one).
    Such a token is now 401 token_malformed naming the claim; a token of one spelling is matched
    and placed by that same value."""
    replica, issuer, pki = spelled_broker
    sub = "system:serviceaccount:team-b:agent"

    def create(**claims: Any) -> httpx.Response:
        token = issuer.token(sub, aud=replica.url, **claims)
        with httpx.Client(verify=pki.context(), timeout=30) as http:
            headers = {"Authorization": f"Bearer {token}"}
            return http.post(replica.url + "/v1/sandboxes", json={}, headers=headers)

    nested_b = {"kubernetes.io": {"namespace": "team-b", "serviceaccount": {"name": "agent"}}}
    both = create(**{"kubernetes.io.namespace": "team-a"}, **nested_b)
    assert both.status_code == 401, both.text
    assert both.json()["code"] == "token_malformed"
    assert "'kubernetes.io.namespace'" in both.json()["detail"], both.json()
    assert "spelled two ways" in both.json()["detail"]
    literal = create(**{"kubernetes.io.namespace": "team-a"})
    assert literal.status_code == 201, literal.text
    assert literal.json()["namespace"] == "team-a"  # matched by team-a, placed in team-a
    nested = create(**nested_b)
    assert (nested.status_code, nested.json()["code"]) == (403, "policy_denied")
    same = create(**{"kubernetes.io.namespace": "team-a"},
                  **{"kubernetes.io": {"namespace": "team-a"}})  # fmt: skip
    assert same.status_code == 201, same.text  # both spellings, one value: no doubt
    assert same.json()["namespace"] == "team-a"
