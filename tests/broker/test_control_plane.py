"""Control plane: whoami, create/get/list/delete, policy, idempotency, quota, lifetime."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import RESERVED_PREFIX, LocalBroker, Policy
from tests._support.programs import process_alive as _alive


def test_whoami_kubernetes(broker: LocalBroker, alice: Any) -> None:
    me = alice.http.get("/v1/whoami").json()
    assert me["provider"] == "kubernetes"
    assert me["issuer"] == broker.kubernetes.url
    assert me["subject"] == "system:serviceaccount:team-a:alice"
    assert me["audience"] == broker.url
    assert me["attributes"]["namespace"] == "team-a"
    assert me["attributes"]["service_account"] == "alice"
    assert me["policy"]["namespace"] == "team-a"
    assert me["policy"]["default_template"] == "python"
    assert me["policy"]["max_sandboxes"] == 3


def test_whoami_gitlab_provider_from_issuer(broker: LocalBroker, api: Any) -> None:
    token = broker.issue_gitlab_token("group/project", ref="feature-x")
    me = api(token).http.get("/v1/whoami").json()
    assert me["provider"] == "gitlab"
    assert me["subject"] == "project_path:group/project:ref_type:branch:ref:feature-x"
    assert me["attributes"]["project_path"] == "group/project"
    assert me["attributes"]["ref_protected"] == "false"
    assert me["policy"]["namespace"] == "gitlab-ci"


def test_provider_hint_is_ignored(broker: LocalBroker, api: Any) -> None:
    token = broker.issue_gitlab_token("group/project", claims={"provider": "kubernetes"})
    resp = api(token).http.get("/v1/whoami", headers={"X-Provider": "kubernetes"})
    assert resp.json()["provider"] == "gitlab"


def test_create_stamps_caller_and_shapes_claim(broker: LocalBroker, alice: Any) -> None:
    resp = alice.create(labels={"team": "ml"}, annotations={"note": "x"}, env={"FOO": "bar"})
    assert resp.status_code == 201, resp.text
    obj = resp.json()
    assert obj["phase"] == "Pending" or obj["phase"] == "Ready"
    assert obj["namespace"] == "team-a"
    assert obj["template"] == "python"
    assert obj["labels"] == {"team": "ml"}
    assert obj["owner"] == {
        "provider": "kubernetes",
        "issuer": broker.kubernetes.url,
        "subject": "system:serviceaccount:team-a:alice",
    }
    assert obj["router"] == {"sandbox_id": obj["name"], "namespace": "team-a", "port": 8888}
    stamps = obj["annotations"]
    assert stamps["note"] == "x"
    assert stamps[RESERVED_PREFIX + "issuer"] == broker.kubernetes.url
    assert stamps[RESERVED_PREFIX + "subject"] == "system:serviceaccount:team-a:alice"
    assert stamps[RESERVED_PREFIX + "provider"] == "kubernetes"
    assert stamps[RESERVED_PREFIX + "attr.namespace"] == "team-a"
    assert stamps[RESERVED_PREFIX + "attr.service_account"] == "alice"

    (claim,) = [c for c in broker.claims() if c["metadata"]["name"] == obj["name"]]
    assert claim["apiVersion"] == "extensions.agents.x-k8s.io/v1beta1"
    assert claim["kind"] == "SandboxClaim"
    assert claim["metadata"]["namespace"] == "team-a"
    assert claim["metadata"]["labels"]["team"] == "ml"
    assert claim["metadata"]["annotations"][RESERVED_PREFIX + "subject"].endswith(":alice")
    assert claim["spec"]["warmPoolRef"] == {"name": "python"}
    assert claim["spec"]["lifecycle"]["shutdownPolicy"] == "Delete"
    assert claim["spec"]["lifecycle"]["shutdownTime"] == obj["expires_at"]
    # the commands' environment, never the pod's (spec.env): issue 26.2, issue 28.2
    assert "env" not in claim["spec"]
    assert claim["metadata"]["annotations"][RESERVED_PREFIX + "env"] == '{"FOO":"bar"}'
    assert RESERVED_PREFIX + "env" not in stamps
    (condition,) = claim["status"]["conditions"]
    assert condition["type"] == "Ready"


def test_wait_ready_long_poll_and_env(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready(env={"GREETING": "hello"})
    out = alice.run(sandbox, "python3 -c 'import os; print(os.environ[\"GREETING\"])'").json()
    assert out["stdout"] == "hello\n"
    claim = next(c for c in broker.claims() if c["metadata"]["name"] == sandbox["name"])
    assert claim["status"]["conditions"][0]["status"] == "True"


def test_long_poll_returns_pending_at_timeout(broker: LocalBroker, alice: Any) -> None:
    broker.set_readiness_delay(1.0)
    name = alice.create().json()["name"]
    resp = alice.http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": "0.3"})
    assert resp.status_code == 200
    assert resp.json()["phase"] == "Pending"  # answered at the timeout, before readiness
    resp = alice.http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": "10"})
    assert resp.json()["phase"] == "Ready"


@pytest.mark.parametrize(
    "params", [{"wait": "done"}, {"wait": "ready", "timeout": "61"}, {"timeout": "abc"}]
)
def test_get_rejects_bad_query(alice: Any, params: dict[str, str]) -> None:
    name = alice.create().json()["name"]
    resp = alice.http.get(f"/v1/sandboxes/{name}", params=params)
    assert resp.status_code == 400
    assert resp.json()["code"] == "invalid_request"


def test_list_is_own_newest_first_with_selector(alice: Any, bob: Any) -> None:
    first = alice.create(labels={"k": "1"}).json()["name"]
    second = alice.create(labels={"k": "2"}).json()["name"]
    bob.create()
    items = alice.http.get("/v1/sandboxes").json()["items"]
    assert [i["name"] for i in items] == [second, first]
    selected = alice.http.get("/v1/sandboxes", params={"label_selector": "k=1"}).json()
    assert [i["name"] for i in selected["items"]] == [first]
    bad = alice.http.get("/v1/sandboxes", params={"label_selector": "k!=1"})
    assert bad.status_code == 400


def test_cross_tenant_control_plane_is_not_found(alice: Any, bob: Any) -> None:
    name = alice.create().json()["name"]
    assert bob.http.get(f"/v1/sandboxes/{name}").status_code == 404
    resp = bob.http.delete(f"/v1/sandboxes/{name}")
    assert resp.status_code == 404
    assert resp.json()["code"] == "not_found"
    assert alice.http.get(f"/v1/sandboxes/{name}").status_code == 200


def test_delete_then_gone(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready()
    name = sandbox["name"]
    pid = broker.runtime_pid(name)
    assert pid is not None
    resp = alice.http.delete(f"/v1/sandboxes/{name}")
    assert resp.status_code == 202
    assert resp.json()["phase"] == "Terminating"
    deadline = time.monotonic() + 10
    while alice.http.get(f"/v1/sandboxes/{name}").status_code != 404:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert alice.http.delete(f"/v1/sandboxes/{name}").status_code == 404
    assert not _alive(pid)


@pytest.mark.parametrize(
    ("field", "key"),
    [
        ("labels", RESERVED_PREFIX + "subject"),
        ("annotations", RESERVED_PREFIX + "issuer"),
        ("annotations", RESERVED_PREFIX + "anything"),
        # upstream's own prefix: its controller reads a claim's sandbox-name as a Sandbox to
        # adopt (issue 26, item 18); subdomains too, and any case
        ("annotations", "agents.x-k8s.io/sandbox-name"),
        ("labels", "agents.x-k8s.io/claim-uid"),
        ("annotations", "extensions.agents.x-k8s.io/anything"),
        ("annotations", "Agents.X-K8s.IO/sandbox-name"),
        ("annotations", "agents.x-k8s.io/created-by"),  # the label only is upstream client's
    ],
)
def test_forged_reserved_metadata_is_forbidden(
    broker: LocalBroker, alice: Any, field: str, key: str
) -> None:
    resp = alice.create(**{field: {key: "system:serviceaccount:kube-system:admin"}})
    assert resp.status_code == 403
    assert resp.json()["code"] == "reserved_metadata"
    assert key in resp.json()["detail"]
    assert "use another key" in resp.json()["detail"]
    assert broker.claims() == []


def test_upstreams_client_label_is_the_callers(broker: LocalBroker, alice: Any) -> None:
    """Upstream's client marks its claims with the label agents.x-k8s.io/created-by (the
    /rpc dialect sends it); a domain that only ends like upstream's is the caller's too."""
    labels = {"agents.x-k8s.io/created-by": "my-tool", "my-agents.x-k8s.io/x": "y"}
    resp = alice.create(labels=labels)
    assert resp.status_code == 201, resp.text
    assert resp.json()["labels"] == labels


@pytest.mark.parametrize(
    "body",
    [
        {"labels": {"bad key!": "x"}},
        {"labels": {"k": "not a valid value"}},
        {"labels": {"k": 1}},
        {"annotations": {"/no-name": "x"}},
        {"env": {"1BAD": "x"}},
        {"lifetime_seconds": 0},
        {"lifetime_seconds": "60"},
        {"template": ""},
        {"unknown": True},
    ],
)
def test_create_validation(alice: Any, body: dict[str, Any]) -> None:
    resp = alice.create(**body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == "invalid_request"


def test_create_over_the_lifetime_cap_is_refused_with_the_cap(alice: Any, broker: Any) -> None:
    resp = alice.create(lifetime_seconds=601)
    assert resp.status_code == 403, resp.text
    assert resp.json()["code"] == "lifetime_exceeds_policy"
    assert "600" in resp.json()["detail"]
    assert broker.claims() == []


def test_a_lifetime_marked_a_default_is_cut_at_the_cap(alice: Any, broker: Any) -> None:
    """Issue 22: the SDK's default lifetime (300 s) over a lower cap refused every zero-argument
    create. A lifetime the client marks as its default (``Prefer: clamp-lifetime``) is cut at
    the cap, and the answer says so; one the caller chose is refused as before."""
    clamp = {"Prefer": "clamp-lifetime"}
    resp = alice.http.post("/v1/sandboxes", json={"lifetime_seconds": 900}, headers=clamp)
    assert resp.status_code == 201, resp.text
    obj = resp.json()
    assert _ts(obj["expires_at"]) - _ts(obj["created_at"]) == 600
    assert resp.headers["Preference-Applied"] == "clamp-lifetime"
    under = alice.http.post("/v1/sandboxes", json={"lifetime_seconds": 60}, headers=clamp)
    assert under.status_code == 201 and "Preference-Applied" not in under.headers
    assert _ts(under.json()["expires_at"]) - _ts(under.json()["created_at"]) == 60
    other = {"Prefer": "respond-async, wait=10"}  # another preference: ignored, not a clamp
    refused = alice.http.post("/v1/sandboxes", json={"lifetime_seconds": 601}, headers=other)
    assert refused.status_code == 403 and refused.json()["code"] == "lifetime_exceeds_policy"
    assert len(broker.claims()) == 2


def test_create_bad_json_and_too_large(alice: Any) -> None:
    resp = alice.http.post(
        "/v1/sandboxes", content=b"{nope", headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 400
    assert resp.json()["code"] == "invalid_request"
    big = b'{"annotations": {"a": "' + b"x" * (1024 * 1024 + 10) + b'"}}'
    resp = alice.http.post("/v1/sandboxes", content=big)
    assert resp.status_code == 413
    assert resp.json()["code"] == "too_large"


def test_templates(alice: Any) -> None:
    resp = alice.create(template="restricted")
    assert resp.status_code == 403
    assert resp.json()["code"] == "template_not_allowed"
    resp = alice.create(template="does-not-exist")
    assert resp.status_code == 404
    assert resp.json()["code"] == "template_not_found"
    assert alice.create(template=None).json()["template"] == "python"


def test_lifetime_capped_and_defaulted(alice: Any) -> None:
    obj = alice.create().json()
    created = _ts(obj["created_at"])
    assert 599 <= _ts(obj["expires_at"]) - created <= 601
    obj = alice.create(lifetime_seconds=60).json()
    assert 59 <= _ts(obj["expires_at"]) - _ts(obj["created_at"]) <= 61


def test_quota(broker: LocalBroker, alice: Any, bob: Any) -> None:
    names = [alice.create().json()["name"] for _ in range(3)]
    resp = alice.create()
    assert resp.status_code == 429
    assert resp.json()["code"] == "quota_exceeded"
    assert "Retry-After" not in resp.headers
    assert bob.create().status_code == 201  # quota is per caller
    assert alice.http.delete(f"/v1/sandboxes/{names[0]}").status_code == 202
    assert alice.create().status_code == 201


def test_idempotent_create(broker: LocalBroker, alice: Any, bob: Any) -> None:
    key = str(uuid.uuid4())
    first = alice.create(idempotency_key=key, labels={"a": "1"})
    assert first.status_code == 201
    again = alice.create(idempotency_key=key, labels={"a": "1"})
    assert again.status_code == 200
    assert again.headers["Idempotency-Replayed"] == "true"
    assert again.json()["name"] == first.json()["name"]
    conflict = alice.create(idempotency_key=key, labels={"a": "2"})
    assert conflict.status_code == 409
    assert conflict.json()["code"] == "idempotency_conflict"
    other = bob.create(idempotency_key=key, labels={"a": "1"})  # keys are per caller
    assert other.status_code == 201
    assert other.json()["name"] != first.json()["name"]
    assert len(broker.claims()) == 2
    bad = alice.create(idempotency_key="\x7fbad")
    assert bad.status_code == 400
    assert bad.json()["code"] == "invalid_header"


def test_concurrent_idempotent_creates_allocate_once(broker: LocalBroker, alice: Any) -> None:
    key = str(uuid.uuid4())
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def create() -> None:
        resp = alice.create(idempotency_key=key)
        with lock:
            results.append(resp)

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in results) == [200] * 5 + [201]
    assert len({r.json()["name"] for r in results}) == 1
    assert len(broker.claims()) == 1


def test_lifetime_expiry_and_cleanup(broker: LocalBroker, api: Any) -> None:
    issuer = broker.add_issuer(
        f"short-{uuid.uuid4().hex[:6]}",
        policy=Policy(namespace="short", max_lifetime_seconds=1),
    )
    client = api(issuer.issue_token("short-lived"))
    sandbox = client.ready()
    pid = broker.runtime_pid(sandbox["name"])
    assert pid is not None
    deadline = time.monotonic() + 10
    while client.http.get(f"/v1/sandboxes/{sandbox['name']}").status_code != 404:
        assert time.monotonic() < deadline, "the sandbox did not expire"
        time.sleep(0.05)
    assert not _alive(pid)
    history = broker.claims(include_deleted=True)
    expired = next(c for c in history if c["metadata"]["name"] == sandbox["name"])
    assert expired["status"]["conditions"][0]["reason"] == "Expired"
    assert sandbox["name"] not in [c["metadata"]["name"] for c in broker.claims()]


def test_custom_issuer_policy_and_attributes(broker: LocalBroker, api: Any) -> None:
    issuer = broker.add_issuer(
        f"gha-{uuid.uuid4().hex[:6]}",
        provider="github-actions",
        algorithm="ES256",
        claims=lambda sub: {"repository": sub.split(":")[1], "ref": "refs/heads/main"},
        attributes=["repository", "ref"],
        policy=Policy(templates=("python",), namespace="ci", max_sandboxes=1),
    )
    assert issuer.jwks()["keys"][0]["alg"] == "ES256"
    client = api(issuer.issue_token("repo:org/repo:ref:refs/heads/main"))
    me = client.http.get("/v1/whoami").json()
    assert me["provider"] == "github-actions"
    assert me["attributes"] == {"repository": "org/repo", "ref": "refs/heads/main"}
    obj = client.create().json()
    assert obj["namespace"] == "ci"
    assert obj["annotations"][RESERVED_PREFIX + "attr.repository"] == "org/repo"
    assert client.create().json()["code"] == "quota_exceeded"


def _ts(value: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


@pytest.mark.parametrize("name", ["Bad_Name", "a" * 64])
def test_invalid_sandbox_name_is_invalid_path(alice: Any, name: str) -> None:
    for method in ("GET", "DELETE"):
        resp = alice.http.request(method, f"/v1/sandboxes/{name}")
        assert resp.status_code == 400
        assert resp.json()["code"] == "invalid_path"


def test_kubernetes_token_without_namespace_is_policy_denied(broker: LocalBroker, api: Any) -> None:
    token = broker.kubernetes.issue_token("system:serviceaccount:x:y")  # no kubernetes.io claim
    client = api(token)
    for resp in (client.http.get("/v1/whoami"), client.create()):
        assert resp.status_code == 403
        assert resp.json()["code"] == "policy_denied"


def test_a_refused_create_names_the_quota_its_value_and_the_count_in_both_dialects(
    broker: LocalBroker, alice: Any
) -> None:
    for _ in range(3):  # the session broker's kubernetes policy: max_sandboxes = 3
        assert alice.create().status_code == 201
    v1 = alice.create()
    rpc = alice.http.post("/rpc", json={"op": "create"})
    assert v1.status_code == rpc.status_code == 429
    for text in (v1.json()["detail"], rpc.text):
        assert "quota max_sandboxes exceeded" in text, text  # which quota
        assert "holds 3 live sandboxes" in text, text  # how many the caller holds
        assert "max_sandboxes = 3" in text and "policy 'kubernetes'" in text, text  # its value


def test_a_delete_acts_on_the_claim_the_broker_checked(alice: Any, broker: LocalBroker) -> None:
    """The local backend, as the Kubernetes one: a delete for another uid than the record's
    (the claim the owner check saw) deletes nothing."""
    import asyncio

    name = alice.create().json()["name"]
    store, loop = broker._require_store(), broker._loop
    assert loop is not None
    uid = store.sandboxes[name].state().uid

    def delete(with_uid: str) -> Any:
        coro = store.delete(name, uid=with_uid)
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    assert delete(f"{uid}-other") is None
    assert alice.http.get(f"/v1/sandboxes/{name}").json()["phase"] in ("Pending", "Ready")
    assert delete(uid) is not None
    gone = alice.http.get(f"/v1/sandboxes/{name}")
    assert gone.status_code == 404 or gone.json()["phase"] == "Terminating", gone.text


def test_racing_creates_admit_exactly_the_quota(broker: LocalBroker, alice: Any, api: Any) -> None:
    """The local backend's guarantee, as the Kubernetes one's (issue 26, item 5): 16 creates
    at once of a caller allowed 3 who holds 1 admit exactly 2; every other is 429 saying the
    caller holds 3, and leaves nothing behind; 8 at once with one Idempotency-Key make one."""
    import concurrent.futures

    assert alice.create().status_code == 201
    start = threading.Barrier(16)
    token = broker.issue_kubernetes_token("team-a", "alice")

    def create(key: str | None) -> httpx.Response:
        client = api(token)
        start.wait(30)
        return client.create(**({"idempotency_key": key} if key else {}))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(create, [str(uuid.uuid4()) for _ in range(8)] + [None] * 8))
    made = [a for a in answers if a.status_code == 201]
    assert len(made) == 2, [a.text for a in answers if a.status_code != 201][:2]
    for answer in answers:
        if answer.status_code != 201:
            assert answer.status_code == 429, answer.text
            assert "holds 3 live sandboxes, the maximum" in answer.json()["detail"]
    assert len(broker.claims()) == 3
    for name in [a.json()["name"] for a in made]:
        assert alice.http.delete(f"/v1/sandboxes/{name}").status_code == 202
    start = threading.Barrier(8)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        same = list(pool.map(create, ["one-key"] * 8))
    assert sorted(a.status_code for a in same) == [200] * 7 + [201], [a.text for a in same]
    assert len({a.json()["name"] for a in same}) == 1
