"""The broker's stamps on a claim, written in one place (``broker/backends/_stamps.py``): the
claims logic writes them, each backend keeps and reads back the same keys."""

from __future__ import annotations

from k8s_agent_sandbox_awx.broker.backends import _stamps
from k8s_agent_sandbox_awx.broker.backends._interface import ClaimRequest, Owner
from k8s_agent_sandbox_awx.broker.backends.kubernetes._claims import claim_object, state_of
from k8s_agent_sandbox_awx.broker.control._claims import stamps
from k8s_agent_sandbox_awx.broker.identity._policy import RESERVED_PREFIX, Caller

CALLER = Caller(
    provider="kubernetes",
    issuer="https://issuer.example",
    subject="system:serviceaccount:team-a:alice",
    audience="https://broker.example",
    expires_at=0,
    attributes={"namespace": "team-a", "groups": ["a", "b"]},
)


def test_the_reserved_prefix_is_one_prefix() -> None:
    """Written twice (identity/ refuses it in what callers send, backends/ stamps with it: the
    layers below the broker cannot import each other): the two must be the same."""
    assert _stamps.RESERVED_PREFIX == RESERVED_PREFIX
    keys = [getattr(_stamps, n) for n in _stamps.__all__ if n.isupper() and "MANAGED" not in n]
    assert keys and all(key.startswith(RESERVED_PREFIX) for key in keys), keys


def test_the_stamps_name_the_caller_and_read_back_as_its_owner() -> None:
    made = stamps(CALLER, 0.0, {_stamps.RPC_CLAIM: "broker-x"})
    assert made == {
        RESERVED_PREFIX + "issuer": "https://issuer.example",
        RESERVED_PREFIX + "subject": "system:serviceaccount:team-a:alice",
        RESERVED_PREFIX + "provider": "kubernetes",
        RESERVED_PREFIX + "created-at": "1970-01-01T00:00:00Z",
        RESERVED_PREFIX + "attr.namespace": "team-a",
        RESERVED_PREFIX + "attr.groups": '["a", "b"]',
        RESERVED_PREFIX + "rpc-claim": "broker-x",
    }
    owner = Owner(CALLER.issuer, CALLER.subject, CALLER.provider)
    assert _stamps.stamped_owner(made) == owner
    assert _stamps.stamped_owner({}) == Owner("", "", "")


def test_a_kubernetes_claim_keeps_the_stamps_and_its_owner() -> None:
    owner = Owner(CALLER.issuer, CALLER.subject, CALLER.provider)
    made = stamps(CALLER, 0.0)
    request = ClaimRequest(
        owner=owner,
        namespace="team-a",
        template="python",
        labels={},
        annotations={},
        stamps=made,
        env={},
        created_at=0.0,
        lifetime_seconds=60.0,
        scopes=frozenset({"commands"}),
        max_live=1,
    )
    obj = claim_object(request, "sbx-1")
    assert obj["metadata"]["labels"][_stamps.MANAGED_BY_LABEL] == _stamps.MANAGED_BY
    state = state_of(obj)
    assert state.owner == owner
    template = RESERVED_PREFIX + "template"  # the Kubernetes backend's own, shown too
    assert dict(state.stamps) == {**made, _stamps.SCOPES: "commands", template: "python"}
