"""Policies as rules (broker/identity/_rules.py): first match in order on issuer, subject glob
and claims; the Policy it grants; the refusal when none matches; the local broker's
per-issuer policy as a one-rule set. Claim shapes: /work/shared/reference/token-claims.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from k8s_agent_sandbox_awx.broker.identity._configured import configured_verifier
from k8s_agent_sandbox_awx.broker.identity._policy import Caller, Policy, caller_namespace
from k8s_agent_sandbox_awx.broker.identity._rules import (
    CALLER_NAMESPACE,
    IssuerPolicies,
    PolicyDenied,
    PolicyRule,
    PolicySet,
)
from k8s_agent_sandbox_awx.broker.identity._settings import IssuerSettings, SettingsError
from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.oidc_issuer import AUDIENCE, ScriptedIssuer

CLUSTER = IssuerSettings("cluster", "https://kubernetes.default.svc", "kubernetes")
GITLAB = IssuerSettings("gitlab", "https://gitlab.example.com", "gitlab")
GITHUB = IssuerSettings("github", "https://token.actions.githubusercontent.com", "github-actions")
ISSUERS = [CLUSTER, GITLAB, GITHUB]


def caller(issuer: IssuerSettings, sub: str, **claims: Any) -> Caller:
    return Caller(
        provider=issuer.provider,
        issuer=issuer.url,
        subject=sub,
        audience=AUDIENCE,
        expires_at=0,
        attributes={"namespace": claims["kubernetes.io"]["namespace"]}
        if "kubernetes.io" in claims
        else {},
        claims={"sub": sub, **claims},
    )


def rule(name: str, issuer: str = "gitlab", **fields: Any) -> PolicyRule:
    values: dict[str, Any] = {"warm_pools": ("python",), "namespace": "ci"}
    values.update(fields)
    return PolicyRule(name, issuer, **values)


def matched(rules: list[PolicyRule], who: Caller) -> str:
    return PolicySet(rules, ISSUERS).rule_for(who).name


def k8s(namespace: str, sa: str = "agent", **extra: Any) -> Caller:
    info: dict[str, Any] = {"namespace": namespace, "serviceaccount": {"name": sa, "uid": "u"}}
    info.update(extra)
    return caller(CLUSTER, f"system:serviceaccount:{namespace}:{sa}", **{"kubernetes.io": info})


def gitlab(project: str, ref: str = "main", protected: str = "true", **more: Any) -> Caller:
    sub = f"project_path:{project}:ref_type:branch:ref:{ref}"
    return caller(
        GITLAB, sub, project_path=project, ref=ref, ref_type="branch", ref_protected=protected,
        namespace_path=project.rsplit("/", 1)[0], **more,
    )  # fmt: skip


def github(repo: str, ref: str = "refs/heads/main", **more: Any) -> Caller:
    return caller(
        GITHUB, f"repo:{repo}:ref:{ref}", repository=repo, ref=ref,
        repository_owner=repo.split("/")[0], **more,
    )  # fmt: skip


# ------------------------------------------------------------------------------ matching


def test_the_issuer_binds_a_rule() -> None:
    rules = [rule("any-gitlab"), rule("any-cluster", "cluster")]
    assert matched(rules, gitlab("g/p")) == "any-gitlab"
    assert matched(rules, k8s("team-a")) == "any-cluster"
    with pytest.raises(PolicyDenied):
        matched(rules, github("o/r"))  # no rule names that issuer


def test_the_subject_is_an_fnmatch_glob() -> None:
    rules = [rule("team-a", "cluster", subject="system:serviceaccount:team-a:*")]
    assert matched(rules, k8s("team-a", "anyone")) == "team-a"
    with pytest.raises(PolicyDenied):
        matched(rules, k8s("team-b"))
    with pytest.raises(PolicyDenied):  # case-sensitive, everywhere
        matched([rule("x", "cluster", subject="SYSTEM:*")], k8s("team-a"))
    assert matched([rule("one", "cluster", subject="*:team-?:agent")], k8s("team-a")) == "one"


def test_claims_a_string_or_a_list_of_globs() -> None:
    by_project = rule("p", claims={"project_path": "group/*"})
    assert matched([by_project], gitlab("group/app")) == "p"
    with pytest.raises(PolicyDenied):
        matched([by_project], gitlab("other/app"))
    either = rule("e", claims={"project_path": ["a/x", "b/*"]})
    assert matched([either], gitlab("b/y")) == "e"
    with pytest.raises(PolicyDenied):
        matched([either], gitlab("a/y"))


def test_every_claim_must_match() -> None:
    protected_main = rule(
        "deploy", claims={"project_path": "g/app", "ref": "main", "ref_protected": "true"}
    )
    assert matched([protected_main], gitlab("g/app")) == "deploy"
    with pytest.raises(PolicyDenied):
        matched([protected_main], gitlab("g/app", protected="false"))
    with pytest.raises(PolicyDenied):
        matched([protected_main], gitlab("g/app", ref="feature"))


def test_a_dotted_key_reads_a_nested_claim() -> None:
    by_namespace = rule("ns", "cluster", claims={"kubernetes.io.namespace": "team-a"})
    assert matched([by_namespace], k8s("team-a")) == "ns"
    with pytest.raises(PolicyDenied):
        matched([by_namespace], k8s("team-b"))
    deep = rule("sa", "cluster", claims={"kubernetes.io.serviceaccount.name": "agent-*"})
    assert matched([deep], k8s("team-a", "agent-7")) == "sa"


def test_a_dotted_key_prefers_the_literal_key_with_dots() -> None:
    """The Kubernetes claim is named ``kubernetes.io``: ``kubernetes.io.namespace`` reads
    ``claims["kubernetes.io"]["namespace"]``, not ``claims["kubernetes"]["io"][...]``; a claim
    named by the whole dotted key is read first."""
    by_namespace = rule("ns", "cluster", claims={"kubernetes.io.namespace": "team-a"})
    sub = "system:serviceaccount:team-b:agent"
    nested = {"kubernetes": {"io": {"namespace": "team-a"}}}
    decoy = caller(CLUSTER, sub, **{"kubernetes.io": {"namespace": "team-b"}}, **nested)
    with pytest.raises(PolicyDenied):
        matched([by_namespace], decoy)
    info = {"namespace": "team-b"}
    whole = caller(CLUSTER, sub, **{"kubernetes.io.namespace": "team-a", "kubernetes.io": info})
    assert matched([by_namespace], whole) == "ns"


def test_an_absent_claim_never_matches_not_even_star() -> None:
    needs_pod = rule("pod", "cluster", claims={"kubernetes.io.pod.name": "*"})
    with pytest.raises(PolicyDenied):
        matched([needs_pod], k8s("team-a"))  # a token bound to no pod
    assert matched([needs_pod], k8s("team-a", pod={"name": "p-0", "uid": "u"})) == "pod"
    with pytest.raises(PolicyDenied):
        matched([rule("env", "github", claims={"environment": "*"})], github("o/r"))


def test_a_non_string_claim_is_compared_by_its_json_text() -> None:
    assert matched([rule("b", claims={"flag": "true"})], gitlab("g/p", flag=True)) == "b"
    with pytest.raises(PolicyDenied):
        matched([rule("b", claims={"flag": "True"})], gitlab("g/p", flag=True))
    assert matched([rule("n", claims={"project_id": "4?"})], gitlab("g/p", project_id=42)) == "n"
    groups = gitlab("g/p", groups=["a", "b"])
    assert matched([rule("l", claims={"groups": '[[]"a","b"]'})], groups)  # '[' is a glob set
    assert matched([rule("l", claims={"groups": '*"b"*'})], groups)
    obj = gitlab("g/p", obj={"b": 2, "a": 1})
    assert matched([rule("o", claims={"obj": '{"a":1,"b":2}'})], obj)  # keys sorted
    with pytest.raises(PolicyDenied):  # null is the text "null", not absent-and-matching
        matched([rule("z", claims={"environment": "prod"})], gitlab("g/p", environment=None))


def test_the_first_matching_rule_wins_in_order() -> None:
    rules = [
        rule("protected", claims={"ref_protected": "true"}, max_sandboxes=10),
        rule("everyone", max_sandboxes=1),
    ]
    assert matched(rules, gitlab("g/p")) == "protected"
    assert matched(rules, gitlab("g/p", protected="false")) == "everyone"
    assert matched(list(reversed(rules)), gitlab("g/p")) == "everyone"


def test_github_actions_shaped_claims() -> None:
    rules = [
        rule("release", "github", subject="repo:acme/*:ref:refs/tags/v*", warm_pools=("big",)),
        rule("main", "github", claims={"repository": "acme/app", "ref": "refs/heads/main"}),
        rule("org", "github", claims={"repository_owner": "acme"}, max_sandboxes=1),
    ]
    assert matched(rules, github("acme/app", "refs/tags/v1.2")) == "release"
    assert matched(rules, github("acme/app")) == "main"
    assert matched(rules, github("acme/lib")) == "org"
    with pytest.raises(PolicyDenied):
        matched(rules, github("evil/app"))


# ------------------------------------------------------------------------------ the policy


def test_the_policy_a_rule_grants() -> None:
    rules = PolicySet(
        [
            rule(
                "ci", warm_pools=["small", "big"], namespace="ci-sandboxes", max_sandboxes=2,
                max_lifetime_seconds=900, scopes=["commands"],
            ),
            rule("own", "cluster", namespace=CALLER_NAMESPACE),
        ],
        ISSUERS,
    )  # fmt: skip
    policy = rules.policy_for(gitlab("g/p"))
    assert policy.templates == ("small", "big") and policy.effective_default_template == "small"
    assert (policy.namespace, policy.max_sandboxes, policy.max_lifetime_seconds) == (
        "ci-sandboxes", 2, 900,
    )  # fmt: skip
    assert policy.scopes == ("commands",)
    own = rules.policy_for(k8s("team-z"))
    assert own.namespace is caller_namespace and own.namespace_for(k8s("team-z")) == "team-z"
    assert own.scopes == ("commands", "files")  # the default: every scope


def test_no_match_is_a_typed_refusal_naming_the_identity() -> None:
    with pytest.raises(PolicyDenied) as denied:
        PolicySet([rule("p", claims={"project_path": "g/app"})], ISSUERS).policy_for(
            gitlab("g/other", jti="secret-jti")
        )
    assert (denied.value.status, denied.value.code) == (403, "policy_denied")
    message = str(denied.value)
    assert "issuer 'gitlab' (https://gitlab.example.com)" in message
    assert "'project_path:g/other:ref_type:branch:ref:main'" in message
    assert "no policy admits" in message and "secret-jti" not in message


BAD_RULES: dict[str, tuple[dict[str, Any], str, str]] = {
    "unknown issuer": ({"issuer": "gitlab-old"}, "issuer", "no configured issuer"),
    "no pools": ({"warm_pools": []}, "policy", "at least one template"),
    "a string of pools": ({"warm_pools": "python"}, "warm_pools", "list of strings"),
    "bad scope": ({"scopes": ["commands", "ports"]}, "policy", "not scopes"),
    "bad namespace": ({"namespace": "Team_A"}, "policy", "DNS-1123 label"),
    "other placeholder": ({"namespace": "{caller.subject}"}, "namespace", "only placeholder"),
    "empty subject": ({"subject": ""}, "subject", "glob of the token's sub"),
    "empty glob list": ({"claims": {"ref": []}}, "claims.ref", "non-empty list of globs"),
    "a number glob": ({"claims": {"ref": 1}}, "claims.ref", "a glob"),
    "empty key part": ({"claims": {"kubernetes..io": "x"}}, "claims", "not a claim name"),
    "lifetime": ({"max_lifetime_seconds": 0}, "policy", "max_lifetime_seconds > 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_RULES))
def test_rule_rules(case: str) -> None:
    fields, field, words = BAD_RULES[case]
    issuer = fields.pop("issuer", "gitlab")
    with pytest.raises(SettingsError) as info:
        PolicySet([rule("bad", issuer, **fields)], ISSUERS)
    assert info.value.field == field and words in str(info.value), str(info.value)
    assert str(info.value).startswith("policy 'bad'")


def test_two_rules_with_one_name_are_refused() -> None:
    with pytest.raises(SettingsError, match="is used twice"):
        PolicySet([rule("same"), rule("same", "github")], ISSUERS)


# ------------------------------------------------------------------------------ the local broker


def test_the_local_broker_per_issuer_policy_is_a_one_rule_set() -> None:
    policy = Policy(templates=("python",), namespace="gitlab-ci", max_sandboxes=2)
    single = PolicySet.single(GITLAB.url, policy, name="gitlab")
    assert single.policy_for(gitlab("any/project")) is policy
    assert [r.name for r in single.rules] == ["gitlab"]
    with pytest.raises(PolicyDenied, match=r"issuer 'https://kubernetes\.default\.svc'"):
        single.policy_for(k8s("team-a"))


def test_issuer_policies_give_each_local_issuer_its_own_policy() -> None:
    with LocalBroker(warn=False) as broker:
        policies = IssuerPolicies(lambda: {i.url: i for i in broker.issuers.values()})
        for name, issuer in broker.issuers.items():
            who = Caller(issuer.provider, issuer.url, "s", broker.url, 0, {"namespace": "n"})
            assert policies.policy_for(who) is issuer.policy, name
        stranger = Caller("x", "https://stranger.test", "s", broker.url, 0)
        with pytest.raises(PolicyDenied, match="not trusted"):
            policies.policy_for(stranger)


# ------------------------------------------------------------------------------ end to end


@pytest.mark.asyncio
async def test_verified_gitlab_tokens_through_the_rules(issuer: ScriptedIssuer) -> None:
    settings = issuer.settings(name="gitlab", provider="gitlab")
    verifier = configured_verifier([settings], audience=AUDIENCE)
    rules = PolicySet(
        [
            rule("deploy", claims={"project_path": "g/app", "ref_protected": "true"},
                 namespace="deploy", max_sandboxes=1),
            rule("group", claims={"namespace_path": "g"}, namespace="group"),
        ],
        [settings],
    )  # fmt: skip

    async def policy(**claims: Mapping[str, Any] | str) -> Policy:
        caller, _ = await verifier.verify(f"Bearer {issuer.token('p', **claims)}")
        return rules.policy_for(caller)

    assert (await policy(project_path="g/app", ref_protected="true")).namespace == "deploy"
    assert (await policy(project_path="g/app", ref_protected="false", namespace_path="g")
            ).namespace == "group"  # fmt: skip
    with pytest.raises(PolicyDenied, match="issuer 'gitlab'"):
        await policy(project_path="fork/app", namespace_path="fork")
    await verifier.aclose()
