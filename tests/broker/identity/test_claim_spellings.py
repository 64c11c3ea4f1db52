"""A claim spelled two ways (issue 26, item 14): a key holding dots and a nested claim of the
same dotted name. A policy's ``claims`` read the literal key first while ``{caller.namespace}``
read only the nested claim, so one token was admitted by one value and placed by the other.
Now the verifier refuses a token holding a name twice with different values (both modes), and
a token of one spelling gives the policy and the attributes the same value.
The end-to-end case (admitted by team-a, placed in team-b): tests/broker/test_hostile_claims.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from k8s_agent_sandbox_awx.broker.identity._configured import configured_verifier
from k8s_agent_sandbox_awx.broker.identity._providers import (
    claim_at,
    kubernetes_attributes,
    spelled_twice,
)
from k8s_agent_sandbox_awx.broker.identity._rejection import TokenRejected
from k8s_agent_sandbox_awx.broker.identity._rules import PolicyRule, PolicySet
from tests._support.oidc_issuer import AUDIENCE, ScriptedIssuer
from tests.broker.identity.test_tokenreview import Reviewer, token, verifier_for


@pytest.mark.parametrize(
    ("claims", "doubled"),
    [
        (
            {"kubernetes.io.namespace": "a", "kubernetes.io": {"namespace": "b"}},
            "kubernetes.io.namespace",
        ),
        ({"kubernetes.io.namespace": "a", "kubernetes.io": {"namespace": "a"}}, None),
        ({"a.b": {"c": 1}, "a": {"b.c": 2}}, "a.b.c"),  # met across levels
        ({"a.b": {"c": 1}, "a": {"b": {"c": 1}}}, None),
        ({"a.b": 1, "a": {"b": {"c": 1}}}, "a.b"),  # a value and an object
        ({"a.b": [1], "a": {"b": [2]}}, "a.b"),
        ({"a": [{"b": 1}], "a.0.b": 2}, None),  # lists are not reached into
        ({"https://x.example/roles": ["r"], "sub": "s"}, None),
        ({"kubernetes.io": {"namespace": "a", "pod": {"name": "p"}}}, None),
    ],
)
def test_spelled_twice(claims: dict[str, Any], doubled: str | None) -> None:
    assert spelled_twice(claims) == doubled


def test_a_deep_token_is_walked_without_recursion() -> None:
    deep: dict[str, Any] = {"leaf": 1}
    for _ in range(5000):  # deeper than any token's JSON can be (the parser stops at ~1000)
        deep = {"x": deep}
    assert spelled_twice(deep) is None
    deep["x.x"] = 2
    assert spelled_twice(deep) == "x.x"


def test_one_spelling_gives_the_policy_and_the_attributes_the_same_value() -> None:
    literal = {"kubernetes.io.namespace": "team-a"}
    assert kubernetes_attributes(literal) == {"namespace": "team-a"}
    assert claim_at(literal, "kubernetes.io.namespace") == "team-a"
    nested = {"kubernetes.io": {"namespace": "team-b", "serviceaccount": {"name": "sa"},
                                "pod": {"name": "p"}}}  # fmt: skip
    assert kubernetes_attributes(nested) == {
        "namespace": "team-b", "service_account": "sa", "pod": "p",
    }  # fmt: skip


@pytest.mark.asyncio
async def test_the_verifier_refuses_a_claim_spelled_two_ways(issuer: ScriptedIssuer) -> None:
    """JWKS: an issuer-signed token; the policy set is never asked."""
    verifier = configured_verifier([issuer.settings(provider="kubernetes")], audience=AUDIENCE)
    both = issuer.token("system:serviceaccount:team-b:agent", **{
        "kubernetes.io.namespace": "team-a", "kubernetes.io": {"namespace": "team-b"},
    })  # fmt: skip
    with pytest.raises(TokenRejected) as info:
        await verifier.verify(f"Bearer {both}")
    assert info.value.code == "token_malformed"
    assert "'kubernetes.io.namespace' is spelled two ways" in info.value.detail
    assert info.value.identity == (issuer.url, "system:serviceaccount:team-b:agent")
    one = issuer.token("system:serviceaccount:team-b:agent",
                       **{"kubernetes.io.namespace": "team-a"})  # fmt: skip
    caller, _ = await verifier.verify(f"Bearer {one}")
    rules = PolicySet(
        [PolicyRule("team-a", "scripted", ("python",), "{caller.namespace}",
                    claims={"kubernetes.io.namespace": "team-a"})],
        [issuer.settings(provider="kubernetes")],
    )  # fmt: skip
    assert rules.policy_for(caller).namespace_for(caller) == "team-a"
    await verifier.aclose()


@pytest.mark.asyncio
async def test_tokenreview_refuses_it_before_any_review() -> None:
    reviewer = Reviewer()
    both = token(**{"kubernetes.io.namespace": "other", "exp": int(time.time()) + 600})
    with pytest.raises(TokenRejected) as info:
        await verifier_for(reviewer).verify(f"Bearer {both}")
    assert info.value.code == "token_malformed" and "spelled two ways" in info.value.detail
    assert reviewer.calls == []
