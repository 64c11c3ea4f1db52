"""The ``/rpc`` dialect of the local broker (the one deployed brokers speak), over real HTTPS.

Ops, status codes and plain-text errors, broker-generated claim names, status polling, terminal
conditions, scopes, extend and its cap, the claim <-> sandbox binding and the owner check on the
data plane, the same policy behind both dialects, and ``LocalBroker(protocols=...)``.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import RESERVED_PREFIX, LocalBroker, Policy

ECHO_RUNTIME = Path(__file__).with_name("echo_runtime.py")
CLAIM_NAME = re.compile(r"^broker-[a-z0-9]{10}$")


@pytest.fixture(scope="module")
def rpc_broker() -> Iterator[LocalBroker]:
    echo = [sys.executable, str(ECHO_RUNTIME), "--port", "{port}"]
    templates: dict[str, str | list[str] | None] = {
        "python": None,
        "restricted": None,
        "echo": echo,
        # binds late: the runtime only starts answering after a second and a half
        "slow": [
            "/bin/sh",
            "-c",
            f"sleep 1.5; exec {sys.executable} {ECHO_RUNTIME} --port {{port}}",
        ],
    }
    policy = Policy(
        templates=("python", "echo", "slow"),
        namespace=lambda caller: str(caller.attributes["namespace"]),
        max_sandboxes=3,
        max_lifetime_seconds=600,
    )
    with LocalBroker(
        templates=templates,
        kubernetes_policy=policy,
        warm_pools={"orphan-pool": "no-such-template", "echo-pool": "echo"},
        warn=False,
    ) as b:
        b.add_issuer(
            "limited",
            policy=Policy(templates=("python",), namespace="limited", scopes=("files",)),
        )
        yield b


@pytest.fixture(autouse=True)
def _reset_rpc_broker(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "rpc_broker" in request.fixturenames:
        request.getfixturevalue("rpc_broker").reset()


class Rpc:
    """An ``Api`` client (conftest) with the ``/rpc`` calls; v1 helpers are delegated."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self.http: httpx.Client = api.http
        self.token: str | None = api.token

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    def op(self, op: str, **fields: Any) -> httpx.Response:
        return self.http.post("/rpc", json={"op": op, **fields})

    def create_claim(self, **fields: Any) -> dict[str, Any]:
        resp = self.op("create", **fields)
        assert resp.status_code == 200, resp.text
        created: dict[str, Any] = resp.json()
        return created

    def status(self, claim: str) -> dict[str, Any]:
        resp = self.op("status", claim_name=claim)
        assert resp.status_code == 200, resp.text
        state: dict[str, Any] = resp.json()
        return state

    def wait(self, claim: str, until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + 20
        while True:
            state = self.status(claim)
            if until(state) or time.monotonic() > deadline:
                return state
            time.sleep(0.05)

    def ready_claim(self, **fields: Any) -> tuple[str, dict[str, Any]]:
        claim = self.create_claim(**fields)["claim_name"]
        state = self.wait(claim, lambda s: s["ready"])
        assert state["ready"], state
        return claim, state

    def headers_for(self, claim: str | None, state: dict[str, Any]) -> dict[str, str]:
        headers = {
            "X-Sandbox-ID": state["sandbox_name"],
            "X-Sandbox-Namespace": state["namespace"],
            "X-Sandbox-Port": "8888",
        }
        if claim is not None:
            headers["X-Sandbox-Claim-Name"] = claim
        return headers

    def execute(self, claim: str | None, state: dict[str, Any], command: str) -> httpx.Response:
        return self.http.post(
            "/execute", json={"command": command}, headers=self.headers_for(claim, state)
        )


@pytest.fixture
def rpc(rpc_broker: LocalBroker, api: Callable[..., Any]) -> Callable[..., Rpc]:
    """``rpc(token, other=None)``: an Rpc client of rpc_broker (or of ``other``)."""

    def make(token: str | None, other: LocalBroker | None = None) -> Rpc:
        return Rpc(api(token, other or rpc_broker))

    return make


@pytest.fixture
def ann(rpc_broker: LocalBroker, rpc: Callable[..., Rpc]) -> Rpc:
    return rpc(rpc_broker.issue_kubernetes_token("team-a", "ann"))


@pytest.fixture
def ben(rpc_broker: LocalBroker, rpc: Callable[..., Rpc]) -> Rpc:
    """Same provider and namespace as ann, another identity."""
    return rpc(rpc_broker.issue_kubernetes_token("team-a", "ben"))


def _rfc3339(seconds_from_now: float) -> str:
    return datetime.fromtimestamp(time.time() + seconds_from_now, UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _assert_plain(resp: httpx.Response, status: int, *words: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("text/plain"), resp.headers
    assert 0 < len(resp.text) <= 300
    assert not resp.text.lstrip().startswith("{"), resp.text
    for word in words:
        assert word in resp.text, resp.text


def _claim_manifest(broker: LocalBroker, claim: str) -> dict[str, Any]:
    (manifest,) = [c for c in broker.claims() if c["metadata"]["name"] == claim]
    return manifest


# -- create ------------------------------------------------------------------------------------
def test_create_generates_claim_names_and_pins_the_namespace(
    rpc_broker: LocalBroker, ann: Rpc
) -> None:
    first = ann.create_claim(
        warmpool="python-sandbox-warmpool",
        labels={"agents.x-k8s.io/created-by": "python-client", "team": "ml"},
        annotations={"note": "x"},
        pod_labels={"pod-label": "p"},
        pod_annotations={"pod.example.com/note": "y"},
        lifecycle={"shutdownTime": _rfc3339(120), "shutdownPolicy": "Delete"},
    )
    second = ann.create_claim()
    assert set(first) == {"claim_name", "namespace"}
    assert CLAIM_NAME.match(first["claim_name"]), first
    assert CLAIM_NAME.match(second["claim_name"]), second
    assert first["claim_name"] != second["claim_name"]
    assert first["namespace"] == second["namespace"] == "team-a"

    manifest = _claim_manifest(rpc_broker, first["claim_name"])
    assert manifest["kind"] == "SandboxClaim"
    assert manifest["metadata"]["namespace"] == "team-a"
    assert manifest["metadata"]["labels"]["team"] == "ml"
    assert manifest["spec"]["warmPoolRef"] == {"name": "python-sandbox-warmpool"}
    assert manifest["spec"]["additionalPodMetadata"] == {
        "labels": {"pod-label": "p"},
        "annotations": {"pod.example.com/note": "y"},
    }
    assert manifest["spec"]["lifecycle"]["shutdownPolicy"] == "Delete"
    assert abs(_epoch(manifest["spec"]["lifecycle"]["shutdownTime"]) - (time.time() + 120)) < 5
    stamps = manifest["metadata"]["annotations"]
    assert stamps["note"] == "x"
    assert stamps[RESERVED_PREFIX + "subject"] == "system:serviceaccount:team-a:ann"
    assert stamps[RESERVED_PREFIX + "issuer"] == rpc_broker.kubernetes.url
    assert stamps[RESERVED_PREFIX + "rpc-claim"] == first["claim_name"]
    # no warm pool: the policy's default template, which is a warm pool of its own name
    assert _claim_manifest(rpc_broker, second["claim_name"])["spec"]["warmPoolRef"] == {
        "name": "python"
    }


def test_rpc_sandbox_is_the_same_record_under_v1(rpc_broker: LocalBroker, ann: Rpc) -> None:
    claim, state = ann.ready_claim()
    listed = ann.http.get("/v1/sandboxes").json()["items"]
    (item,) = [i for i in listed if i["name"] == state["sandbox_name"]]
    assert item["annotations"][RESERVED_PREFIX + "rpc-claim"] == claim
    assert item["owner"]["subject"] == "system:serviceaccount:team-a:ann"
    # a v1 delete ends the claim too
    assert ann.http.delete(f"/v1/sandboxes/{item['name']}").status_code == 202
    _assert_plain(ann.op("status", claim_name=claim), 404, claim)


def test_quota_is_shared_by_both_dialects(ann: Rpc) -> None:
    assert ann.create().status_code == 201
    assert ann.create().status_code == 201
    ann.create_claim()
    _assert_plain(ann.op("create"), 429, "maximum")
    assert ann.create().json()["code"] == "quota_exceeded"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"template": "python"}, ["unknown create field", "template"]),
        ({"labels": {"team": "not ok!"}}, ["label", "team"]),
        ({"pod_labels": {"bad key!": "v"}}, ["pod label", "bad key!"]),
        ({"pod_annotations": "x"}, ["pod_annotations"]),
        ({"warmpool": "Not_A_Name"}, ["warmpool"]),
        ({"backend": "substrate"}, ["substrate", "kubernetes"]),
        ({"lifecycle": {"shutdownTime": "tomorrow"}}, ["RFC 3339"]),
        ({"lifecycle": {"shutdownTime": "2030-01-01T00:00:00"}}, ["RFC 3339", "zone"]),
        ({"lifecycle": {"shutdownTime": "2000-01-01T00:00:00Z"}}, ["past"]),
        ({"lifecycle": {"shutdownTime": "2999-01-01T00:00:00Z"}}, ["maximum lifetime of 600"]),
        (
            {"lifecycle": {"shutdownTime": "2030-01-01T00:00:00Z", "shutdownPolicy": "Retain"}},
            ["Retain"],
        ),
        ({"scopes": "files"}, ["scopes"]),
    ],
)
def test_create_validation_is_400_plain_text(
    ann: Rpc, fields: dict[str, Any], words: list[str]
) -> None:
    _assert_plain(ann.op("create", **fields), 400, *words)


def test_reserved_metadata_is_403(ann: Rpc) -> None:
    _assert_plain(ann.op("create", pod_labels={RESERVED_PREFIX + "x": "y"}), 403, "reserved")


@pytest.mark.parametrize(
    ("field", "key"),
    [
        ("annotations", "agents.x-k8s.io/sandbox-name"),
        ("labels", "agents.x-k8s.io/claim-uid"),
        ("pod_labels", "agents.x-k8s.io/sandbox-name-hash"),
        ("pod_labels", "agents.x-k8s.io/created-by"),
        ("pod_annotations", "agents.x-k8s.io/pod-name"),
    ],
)
def test_upstreams_prefix_is_reserved(ann: Rpc, field: str, key: str) -> None:
    """Upstream's controller reads agents.x-k8s.io/ keys (a claim's sandbox-name is a
    Sandbox to adopt): a caller may set only upstream client's created-by claim label."""
    _assert_plain(ann.op("create", **{field: {key: "x"}}), 403, "reserved", key)
    made = ann.create_claim(labels={"agents.x-k8s.io/created-by": "python-client"})
    assert made["claim_name"].startswith("broker-")


def test_policy_forbidden_warm_pool_is_403(ann: Rpc) -> None:
    _assert_plain(ann.op("create", warmpool="restricted"), 403, "restricted", "allowed")


def test_lifetime_just_past_the_cap_is_clamped(rpc_broker: LocalBroker, ann: Rpc) -> None:
    just_past = datetime.fromtimestamp(time.time() + 601.5, UTC).isoformat()  # fractional
    claim = ann.create_claim(lifecycle={"shutdownTime": just_past})["claim_name"]
    manifest = _claim_manifest(rpc_broker, claim)
    created = _epoch(manifest["metadata"]["creationTimestamp"])  # whole seconds, as shutdown
    assert _epoch(manifest["spec"]["lifecycle"]["shutdownTime"]) == created + 600


def test_a_lifetime_marked_a_default_is_cut_at_the_cap(rpc_broker: LocalBroker, ann: Rpc) -> None:
    """Issue 22: a shutdown time past the cap that the client marks as its default
    (``Prefer: clamp-lifetime``) is cut at the cap; unmarked, it is refused (400) as before."""
    body = {"op": "create", "lifecycle": {"shutdownTime": _rfc3339(900)}}
    resp = ann.http.post("/rpc", json=body, headers={"Prefer": "clamp-lifetime"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["Preference-Applied"] == "clamp-lifetime"
    manifest = _claim_manifest(rpc_broker, resp.json()["claim_name"])
    created = _epoch(manifest["metadata"]["creationTimestamp"])
    assert _epoch(manifest["spec"]["lifecycle"]["shutdownTime"]) == created + 600
    _assert_plain(ann.http.post("/rpc", json=body), 400, "600")


# -- status ------------------------------------------------------------------------------------
def test_status_polling_until_bound_then_ready(rpc_broker: LocalBroker, ann: Rpc) -> None:
    rpc_broker.set_readiness_delay(1.0)
    claim = ann.create_claim(warmpool="slow")["claim_name"]
    first = ann.status(claim)
    assert first["sandbox_name"] is None, first
    assert first["ready"] is False
    assert first["namespace"] == "team-a"
    (condition,) = first["conditions"]
    assert condition == {
        "type": "Ready",
        "status": "False",
        "reason": "SandboxNotReady",
        "message": condition["message"],
    }
    bound = ann.wait(claim, lambda s: s["sandbox_name"] is not None)
    assert bound["sandbox_name"] is not None
    assert bound["ready"] is False  # bound, still within the readiness delay
    ready = ann.wait(claim, lambda s: s["ready"])
    assert ready["ready"] is True
    assert ready["sandbox_name"] == bound["sandbox_name"]
    assert not CLAIM_NAME.match(ready["sandbox_name"])  # a sandbox name, not the claim's
    assert ready["conditions"][0]["status"] == "True"
    assert ready["conditions"][0]["reason"] == "SandboxReady"


def test_unknown_warm_pool_is_warm_pool_not_found(ann: Rpc) -> None:
    claim = ann.create_claim(warmpool="no-such-pool")["claim_name"]
    state = ann.status(claim)
    assert state["sandbox_name"] is None
    assert state["ready"] is False
    (condition,) = state["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "Ready",
        "False",
        "WarmPoolNotFound",
    )
    assert "no-such-pool" in condition["message"]


def test_warm_pool_without_template_is_template_not_found(ann: Rpc) -> None:
    claim = ann.create_claim(warmpool="orphan-pool")["claim_name"]
    (condition,) = ann.status(claim)["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "Ready",
        "False",
        "TemplateNotFound",
    )
    assert "no-such-template" in condition["message"]


def test_startup_crash_is_reason_crashed(rpc_broker: LocalBroker, ann: Rpc) -> None:
    rpc_broker.crash_next_start()
    claim = ann.create_claim()["claim_name"]
    state = ann.wait(claim, lambda s: s["conditions"][0]["reason"] != "SandboxNotReady")
    (condition,) = state["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "Ready",
        "False",
        "crashed",
    )
    assert state["ready"] is False
    # the fault was used up: the next claim starts
    ann.ready_claim()


def test_dead_runtime_reports_crashed(rpc_broker: LocalBroker, ann: Rpc) -> None:
    claim, state = ann.ready_claim()
    pid = rpc_broker.runtime_pid(state["sandbox_name"])
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    after = ann.wait(claim, lambda s: not s["ready"])
    assert after["conditions"][0]["reason"] == "crashed"
    assert "RuntimeExited" in after["conditions"][0]["message"]


def test_status_of_missing_and_foreign_claims(ann: Rpc, ben: Rpc) -> None:
    _assert_plain(ann.op("status", claim_name="broker-nosuchclaim"), 404, "broker-nosuchclaim")
    claim = ann.create_claim()["claim_name"]
    _assert_plain(ben.op("status", claim_name=claim), 403, "owner")
    _assert_plain(ann.op("status"), 400, "claim_name")
    _assert_plain(ann.op("status", claim_name="Bad Name"), 400, "claim_name")


def test_a_claim_in_another_namespace_is_not_disclosed(
    rpc_broker: LocalBroker, ann: Rpc, rpc: Callable[..., Rpc]
) -> None:
    """Issue 23: a caller whose policy pins another namespace learns nothing of a claim there:
    every op answers as for a claim that does not exist (status and extend 404 with the same
    text, delete 204 and the claim stays), as the Kubernetes backend does and as v1 does for
    another caller's sandbox; the local broker answered 403 "belongs to another identity"."""
    carl = rpc(rpc_broker.issue_kubernetes_token("team-b", "carl"))
    claim = ann.create_claim()["claim_name"]
    deadline = _claim_manifest(rpc_broker, claim)["spec"]["lifecycle"]
    absent = "broker-nosuchclaim"
    for op, fields in (("status", {}), ("extend", {"lifecycle": {"shutdownTime": _rfc3339(60)}})):
        theirs = carl.op(op, claim_name=claim, **fields)
        nothing = carl.op(op, claim_name=absent, **fields)
        _assert_plain(theirs, 404)
        assert theirs.text == nothing.text.replace(absent, claim), (theirs.text, nothing.text)
        assert "owner" not in theirs.text and "identity" not in theirs.text
    assert carl.op("delete", claim_name=claim).status_code == 204
    assert ann.status(claim)["namespace"] == "team-a"  # still there, its deadline unmoved
    assert _claim_manifest(rpc_broker, claim)["spec"]["lifecycle"] == deadline
    v1 = carl.http.get(f"/v1/sandboxes/{_claim_manifest(rpc_broker, claim)['metadata']['name']}")
    assert v1.status_code == 404  # the v1 rule it follows


# -- delete ------------------------------------------------------------------------------------
def test_delete_is_204_also_for_an_absent_claim(rpc_broker: LocalBroker, ann: Rpc) -> None:
    claim, state = ann.ready_claim()
    resp = ann.op("delete", claim_name=claim, request_purpose="create_cleanup")
    assert resp.status_code == 204
    assert resp.content == b""
    _assert_plain(ann.op("status", claim_name=claim), 404)
    assert ann.op("delete", claim_name=claim).status_code == 204  # again: absent now
    assert ann.op("delete", claim_name="broker-neverexisted").status_code == 204
    deadline = time.monotonic() + 10
    while any(s["name"] == state["sandbox_name"] for s in rpc_broker.sandboxes()):
        assert time.monotonic() < deadline, "the deleted sandbox is still there"
        time.sleep(0.05)


def test_delete_of_a_foreign_claim_is_403(ann: Rpc, ben: Rpc) -> None:
    claim = ann.create_claim()["claim_name"]
    _assert_plain(ben.op("delete", claim_name=claim), 403, "owner")
    assert ann.status(claim)["namespace"] == "team-a"  # still there
    _assert_plain(ann.op("delete", claim_name=claim, request_purpose=["x"]), 400)


# -- extend ------------------------------------------------------------------------------------
def test_extend_moves_the_deadline_capped_from_creation(rpc_broker: LocalBroker, ann: Rpc) -> None:
    claim = ann.create_claim(lifecycle={"shutdownTime": _rfc3339(60)})["claim_name"]
    manifest = _claim_manifest(rpc_broker, claim)
    created = _epoch(manifest["metadata"]["creationTimestamp"])
    target = _rfc3339(300)
    resp = ann.op("extend", claim_name=claim, lifecycle={"shutdownTime": target})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "claim_name": claim,
        "namespace": "team-a",
        "shutdown_time": target,
        "capped": False,
    }
    assert _claim_manifest(rpc_broker, claim)["spec"]["lifecycle"]["shutdownTime"] == target
    # past the policy's 600 s from creation: capped there
    resp = ann.op("extend", claim_name=claim, lifecycle={"shutdownTime": _rfc3339(5000)})
    assert resp.status_code == 200, resp.text
    assert resp.json()["capped"] is True
    assert abs(_epoch(resp.json()["shutdown_time"]) - (created + 600)) <= 1
    # shortening is allowed
    resp = ann.op("extend", claim_name=claim, lifecycle={"shutdownTime": _rfc3339(30)})
    assert resp.json()["capped"] is False
    assert _epoch(resp.json()["shutdown_time"]) < created + 60


def test_extend_errors(ann: Rpc, ben: Rpc) -> None:
    later = {"shutdownTime": _rfc3339(60)}
    _assert_plain(ann.op("extend", claim_name="broker-nosuchclaim", lifecycle=later), 404)
    claim = ann.create_claim()["claim_name"]
    _assert_plain(ben.op("extend", claim_name=claim, lifecycle=later), 403, "owner")
    _assert_plain(ann.op("extend", claim_name=claim), 400, "lifecycle")
    past = {"shutdownTime": _rfc3339(-5)}
    _assert_plain(ann.op("extend", claim_name=claim, lifecycle=past), 400, "future", "delete")


def test_shortened_claim_expires_on_time(ann: Rpc) -> None:
    claim, _ = ann.ready_claim()
    resp = ann.op("extend", claim_name=claim, lifecycle={"shutdownTime": _rfc3339(2)})
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 15
    while ann.op("status", claim_name=claim).status_code == 200:
        assert time.monotonic() < deadline, "the claim outlived its shutdown time"
        time.sleep(0.1)
    _assert_plain(ann.op("status", claim_name=claim), 404)


# -- the request itself --------------------------------------------------------------------------
def test_authentication_is_401_plain_text(rpc_broker: LocalBroker, rpc: Callable[..., Rpc]) -> None:
    anonymous = rpc(None)
    resp = anonymous.op("status", claim_name="broker-x")
    _assert_plain(resp, 401)
    assert resp.headers["www-authenticate"].startswith("Bearer")
    token = rpc_broker.issue_kubernetes_token("team-a", "ann", audience="https://elsewhere")
    resp = rpc(token).op("create")
    _assert_plain(resp, 401)
    assert token not in resp.text


@pytest.mark.parametrize(
    ("body", "status", "word"),
    [
        ({}, 400, "op"),
        ({"op": 7}, 400, "op"),
        ({"op": "list"}, 400, "create, status, delete, extend"),
        ({"op": "snapshot_create"}, 400, "snapshot"),
        (["op", "create"], 400, "op"),
    ],
)
def test_bad_requests_are_400_plain_text(ann: Rpc, body: Any, status: int, word: str) -> None:
    _assert_plain(ann.http.post("/rpc", json=body), status, word)


def test_invalid_json_and_wrong_method(ann: Rpc) -> None:
    _assert_plain(
        ann.http.post("/rpc", content=b"{", headers={"Content-Type": "application/json"}),
        400,
        "JSON",
    )
    resp = ann.http.get("/rpc")
    _assert_plain(resp, 405, "POST")
    assert resp.headers["allow"] == "POST"


def test_unavailable_is_503_plain_text_with_retry_after(rpc_broker: LocalBroker, ann: Rpc) -> None:
    rpc_broker.inject_unavailable(scope="control", retry_after=2)
    resp = ann.op("create")
    _assert_plain(resp, 503, "unavailable")
    assert resp.headers["retry-after"] == "2"
    ann.create_claim()


# -- scopes ------------------------------------------------------------------------------------
def test_requested_scopes_are_granted_and_enforced(ann: Rpc) -> None:
    claim, state = ann.ready_claim(scopes=["files", "not-a-scope"])
    resp = ann.execute(claim, state, "echo hi")
    assert resp.status_code == 403, resp.text
    assert resp.json()["code"] == "scope_denied"
    listing = ann.http.get("/list/", headers=ann.headers_for(claim, state))
    assert listing.status_code == 200, listing.text
    assert ann.http.get("/", headers=ann.headers_for(claim, state)).status_code == 200


def test_no_grantable_scope_is_403(ann: Rpc) -> None:
    _assert_plain(ann.op("create", scopes=["admin"]), 403, "admin", "allowed")


def test_policy_scopes_bound_both_dialects(
    rpc_broker: LocalBroker, rpc: Callable[..., Rpc]
) -> None:
    limited = rpc(rpc_broker.issuers["limited"].issue_token("robot"))
    _assert_plain(limited.op("create", scopes=["commands"]), 403, "commands", "files")
    claim, state = limited.ready_claim(scopes=["commands", "files"])  # gets files only
    assert limited.execute(claim, state, "true").json()["code"] == "scope_denied"
    # the same policy behind /v1: its sandboxes get the policy's scopes
    sandbox = limited.ready()
    resp = limited.run(sandbox, "true")
    assert resp.status_code == 403
    assert resp.json()["code"] == "scope_denied"
    assert limited.http.get("/list/", headers=limited.data_headers(sandbox)).status_code == 200


def test_unknown_policy_scope_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Policy\.scopes"):
        Policy(scopes=("commands", "admin"))


# -- data plane ----------------------------------------------------------------------------------
def test_execute_through_the_broker_with_the_claim_header(ann: Rpc) -> None:
    claim, state = ann.ready_claim()
    resp = ann.execute(claim, state, "echo hello-rpc")
    assert resp.status_code == 200, resp.text
    assert resp.json()["stdout"] == "hello-rpc\n"


def test_the_test_helpers_take_a_claim_name_for_its_sandbox(
    rpc_broker: LocalBroker, ann: Rpc
) -> None:
    """Under /rpc the client's ``Sandbox.name`` is the claim: the broker's helpers that name a
    sandbox accept it (so one end-to-end test serves both dialects)."""
    claim, state = ann.ready_claim()
    assert rpc_broker.sandbox_name(claim) == state["sandbox_name"]
    assert rpc_broker.sandbox_name("sbx-other") == "sbx-other"  # not a claim: as it is
    assert ann.execute(claim, state, "true").status_code == 200
    assert rpc_broker.execution_count(claim) == rpc_broker.execution_count(state["sandbox_name"])
    assert rpc_broker.execution_count(claim) == 1
    assert rpc_broker.runtime_pid(claim) == rpc_broker.runtime_pid(state["sandbox_name"])
    assert rpc_broker.runtime_pid(claim) is not None
    rpc_broker.inject_unavailable(1, retry_after=0, sandbox=claim)  # the claim's sandbox only
    assert ann.execute(claim, state, "true").status_code == 503


def test_claim_header_is_required_and_must_be_bound(ann: Rpc) -> None:
    claim, state = ann.ready_claim()
    other, other_state = ann.ready_claim()
    resp = ann.execute(None, state, "touch should-not-exist")
    assert resp.status_code == 403
    assert resp.json()["code"] == "claim_required"
    assert "X-Sandbox-Claim-Name" in resp.json()["detail"]
    resp = ann.execute(other, state, "touch should-not-exist")  # her claim, another sandbox
    assert resp.status_code == 403
    assert resp.json()["code"] == "claim_mismatch"
    assert other in resp.json()["detail"] and state["sandbox_name"] in resp.json()["detail"]
    resp = ann.execute("broker-nosuchclaim", state, "touch should-not-exist")
    assert resp.status_code == 403
    assert resp.json()["code"] == "claim_mismatch"
    listing = ann.http.get("/list/", headers=ann.headers_for(claim, state))
    assert listing.json() == []
    assert ann.execute(other, other_state, "true").status_code == 200


def test_data_plane_owner_check(ann: Rpc, ben: Rpc) -> None:
    claim, state = ann.ready_claim()
    resp = ben.execute(claim, state, "touch should-not-exist")  # her claim and sandbox
    assert resp.status_code == 403
    assert resp.json()["code"] == "not_owner"
    own, _ = ben.ready_claim()
    resp = ben.execute(own, state, "touch should-not-exist")  # his claim, her sandbox
    assert resp.status_code == 403
    assert resp.json()["code"] == "not_owner"
    assert ann.http.get("/list/", headers=ann.headers_for(claim, state)).json() == []


def test_v1_sandbox_claim_header_must_name_it(ann: Rpc) -> None:
    sandbox = ann.ready()
    assert ann.run(sandbox, "true").status_code == 200  # v1: no claim header needed
    resp = ann.http.post(
        "/execute",
        json={"command": "true"},
        headers=ann.data_headers(sandbox, **{"X-Sandbox-Claim-Name": "broker-someother"}),
    )
    assert resp.status_code == 403
    assert resp.json()["code"] == "claim_mismatch"
    resp = ann.http.post(
        "/execute",
        json={"command": "true"},
        headers=ann.data_headers(sandbox, **{"X-Sandbox-Claim-Name": sandbox["name"]}),
    )
    assert resp.status_code == 200, resp.text


def test_claim_header_is_not_forwarded(ann: Rpc) -> None:
    claim, state = ann.ready_claim(warmpool="echo-pool")
    seen = ann.http.get("/anything", headers=ann.headers_for(claim, state)).json()
    assert not any(name.startswith("x-sandbox-") for name in seen["headers"])
    assert ann.token is not None and ann.token not in str(seen)


# -- protocols= ------------------------------------------------------------------------------------
def test_rpc_only_broker_answers_404_on_v1(rpc: Callable[..., Rpc]) -> None:
    with LocalBroker(protocols=("rpc",), warn=False) as only:
        assert only.protocols == ("rpc",)
        client = rpc(only.issue_kubernetes_token("team-a", "ann"), only)
        try:
            for method, path in (
                ("GET", "/v1/healthz"),
                ("GET", "/v1/whoami"),
                ("GET", "/v1/sandboxes"),
                ("POST", "/v1/sandboxes"),
            ):
                resp = client.http.request(method, path)
                assert resp.status_code == 404, (path, resp.text)
                assert "rpc" in resp.json()["detail"]
            claim, state = client.ready_claim()
            assert client.execute(claim, state, "echo only-rpc").json()["stdout"] == "only-rpc\n"
        finally:
            client.http.close()


def test_v1_only_broker_answers_404_on_rpc(rpc: Callable[..., Rpc]) -> None:
    with LocalBroker(protocols=("v1",), warn=False) as only:
        client = rpc(only.issue_kubernetes_token("team-a", "ann"), only)
        try:
            resp = client.op("create")
            assert resp.status_code == 404, resp.text
            assert "v1" in resp.json()["detail"]
            sandbox = client.ready()
            assert client.run(sandbox, "echo only-v1").json()["stdout"] == "only-v1\n"
            # the claim header's rule for a v1 sandbox holds here too
            headers = client.data_headers(sandbox, **{"X-Sandbox-Claim-Name": "broker-other"})
            resp = client.http.post("/execute", json={"command": "true"}, headers=headers)
            assert resp.status_code == 403
            assert resp.json()["code"] == "claim_mismatch"
        finally:
            client.http.close()


def test_default_broker_serves_both(rpc_broker: LocalBroker, ann: Rpc) -> None:
    assert rpc_broker.protocols == ("v1", "rpc")
    assert ann.http.get("/v1/healthz").status_code == 200
    ann.create_claim()


@pytest.mark.parametrize("protocols", [(), ("v2",), "rpc", ("rpc", "grpc")])
def test_invalid_protocols_are_refused(protocols: Any) -> None:
    with pytest.raises(ValueError, match="protocols="):
        LocalBroker(protocols=protocols, warn=False)
