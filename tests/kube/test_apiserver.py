"""The real kube-apiserver helper works, and the 1.20 facts the Kubernetes backend relies on.

Facts from the API server itself (kube-apiserver 1.20.2 built from Debian's source package,
etcd 3.4): TokenRequest and TokenReview (authentication.k8s.io/v1), the service-account
issuer's OIDC discovery (KEP-1393, beta and on by default in 1.20), CRDs with a status
subresource (apiextensions.k8s.io/v1), watches and their 410 Gone.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from typing import Any

import httpx
import jwt
import pytest

from tests._support.kube import (
    SERVICE_ACCOUNT_ISSUER_DISCOVERY,
    KubeAPIServer,
    KubeError,
    path_of,
)

pytestmark = pytest.mark.slow  # one API server per session: ~4 s to start

EXT = "extensions.agents.x-k8s.io/v1beta1"
RBAC = "/apis/rbac.authorization.k8s.io/v1"


def claims_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return path_of(EXT, "SandboxClaim", namespace=namespace, name=name, subresource=sub)


def claim(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": EXT,
        "kind": "SandboxClaim",
        "metadata": {"generateName": "claim-"},
        "spec": {"warmPoolRef": {"name": "python"}, **spec},
    }


def jwt_parts(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header and claims of a JWT, unverified."""
    header, payload = (
        json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
        for part in token.split(".")[:2]
    )
    return header, payload


def ready_condition(reason: str, status: str = "False") -> dict[str, Any]:
    return {
        "type": "Ready",
        "status": status,
        "reason": reason,
        "message": "",
        "lastTransitionTime": "2026-12-01T00:00:00Z",
    }


def test_the_server_is_1_20_over_https_with_the_test_ca(kube: KubeAPIServer) -> None:
    assert kube.get("/version")["gitVersion"] == "v1.20.2"
    assert kube.admin.get("/readyz").text == "ok"
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{kube.url}/readyz")  # the system's trust store does not know the test CA
    with kube.client("not-a-token") as stranger:
        assert stranger.get("/api/v1/namespaces").status_code == 401
    assert kube.start_seconds < 30


def test_namespace_and_service_account(kube: KubeAPIServer, namespace: str) -> None:
    account = kube.create_service_account(namespace, "broker")
    assert account["metadata"]["namespace"] == namespace
    assert (
        kube.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/broker")["metadata"]["uid"]
        == account["metadata"]["uid"]
    )
    assert kube.get(f"/api/v1/namespaces/{namespace}")["status"]["phase"] == "Active"


def test_token_request_gives_a_projected_token_with_the_real_claims(
    kube: KubeAPIServer, namespace: str
) -> None:
    account = kube.create_service_account(namespace, "agent")
    before = int(time.time())
    token = kube.token_request(namespace, "agent", "https://broker.test", expiration=600)
    header, claims = jwt_parts(token)
    assert header["alg"] == "RS256" and header["kid"]
    assert claims["iss"] == kube.issuer
    assert claims["sub"] == f"system:serviceaccount:{namespace}:agent"
    assert claims["aud"] == ["https://broker.test"]  # a list, even for one audience
    assert claims["kubernetes.io"] == {
        "namespace": namespace,
        "serviceaccount": {"name": "agent", "uid": account["metadata"]["uid"]},
    }
    assert claims["exp"] - claims["iat"] == 600
    assert claims["nbf"] == claims["iat"] and before - 5 <= claims["iat"] <= time.time() + 5
    assert "jti" not in claims  # 1.20 has none; newer servers add one
    with pytest.raises(KubeError, match="less than 10 minutes") as refused:
        kube.token_request(namespace, "agent", "https://broker.test", expiration=599)
    assert refused.value.status_code == 422


def test_a_pod_bound_token_names_its_pod_and_dies_with_it(
    kube: KubeAPIServer, namespace: str
) -> None:
    """Offline JWKS verification cannot see a deleted pod; TokenReview does: within moments
    for a token it has not reviewed yet, but it caches a successful review for 10 s."""
    kube.create_service_account(namespace, "agent")
    pod = kube.create_pod(namespace, "agent-0", "agent")
    audience = "https://broker.test"
    seen = kube.token_request(namespace, "agent", audience, bound_pod=pod)
    # 1.20 puts no jti in a token: the same request in the same second gives the same token;
    # each of these (another lifetime each) is reviewed at most once, after the deletion
    unseen = [kube.token_request(namespace, "agent", audience, 601 + i, bound_pod=pod)
              for i in range(30)]  # fmt: skip
    assert len({seen, *unseen}) == 31
    assert jwt_parts(seen)[1]["kubernetes.io"]["pod"] == {
        "name": "agent-0",
        "uid": pod["metadata"]["uid"],
    }
    review = kube.token_review(seen, [audience])
    assert review["authenticated"] is True
    assert review["user"]["extra"] == {
        "authentication.kubernetes.io/pod-name": ["agent-0"],
        "authentication.kubernetes.io/pod-uid": [pod["metadata"]["uid"]],
    }
    kube.delete(f"/api/v1/namespaces/{namespace}/pods/agent-0?gracePeriodSeconds=0")
    deleted = time.monotonic()

    def refused(token: str) -> bool:
        review = kube.token_review(token, [audience])
        return review.get("authenticated") is not True and "invalidated" in review["error"]

    fresh = iter(unseen)
    kube.wait_for(lambda: refused(next(fresh)), what="a fresh review of the pod's token")
    assert time.monotonic() - deleted < 3  # the API server's pod informer caught up
    assert not refused(seen)  # still the cached answer
    kube.wait_for(lambda: refused(seen), what="the cached review expires", timeout=20)
    assert 5 < time.monotonic() - deleted < 15


def test_discovery_is_readable_with_a_service_account_token_not_anonymously(
    kube: KubeAPIServer, namespace: str
) -> None:
    """The broker reads the issuer's discovery document and keys with its own ServiceAccount
    token (audience: the API server's own) through the ClusterRole
    system:service-account-issuer-discovery."""
    kube.create_service_account(namespace, "broker")
    kube.bind_role((namespace, "broker"), SERVICE_ACCOUNT_ISSUER_DISCOVERY)
    token = kube.token_request(namespace, "broker")  # no audience: the API server's own
    assert jwt_parts(token)[1]["aud"] == [kube.api_audience]
    with kube.client(token) as broker:
        discovery = broker.get("/.well-known/openid-configuration")
        keys = broker.get("/openid/v1/jwks")
    assert discovery.status_code == 200, discovery.text
    assert discovery.json() == {
        "issuer": kube.issuer,
        "jwks_uri": f"{kube.issuer}/openid/v1/jwks",
        "response_types_supported": ["id_token"],
        "subject_types_supported": ["public"],
        "id_token_signing_alg_values_supported": ["RS256"],
    }
    assert keys.status_code == 200
    assert keys.headers["content-type"] == "application/jwk-set+json"
    [key] = keys.json()["keys"]
    assert key["kid"] == jwt_parts(token)[0]["kid"]
    assert {key["kty"], key["alg"], key["use"]} == {"RSA", "RS256", "sig"}
    with kube.client() as anonymous:
        for path in ("/.well-known/openid-configuration", "/openid/v1/jwks"):
            refused = anonymous.get(path)
            assert refused.status_code == 403, path
            assert "system:anonymous" in refused.json()["message"]


def test_1_20_binds_discovery_to_every_service_account_by_default(kube: KubeAPIServer) -> None:
    """Fact for the docs: the default ClusterRoleBinding grants the discovery role to the
    group system:serviceaccounts (a cluster may have removed it: the broker's RBAC binds the
    role to the broker's ServiceAccount itself)."""
    role = kube.get(f"{RBAC}/clusterroles/{SERVICE_ACCOUNT_ISSUER_DISCOVERY}")
    assert role["rules"] == [
        {
            "verbs": ["get"],
            "nonResourceURLs": ["/.well-known/openid-configuration", "/openid/v1/jwks"],
        }
    ]
    binding = kube.get(f"{RBAC}/clusterrolebindings/{SERVICE_ACCOUNT_ISSUER_DISCOVERY}")
    assert binding["subjects"] == [
        {"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "system:serviceaccounts"}
    ]


def test_a_token_request_jwt_verifies_with_pyjwt_against_the_jwks(
    kube: KubeAPIServer, namespace: str
) -> None:
    kube.create_service_account(namespace, "agent")
    kube.create_service_account(namespace, "broker")
    with kube.client(kube.token_request(namespace, "broker")) as broker:
        jwks = broker.get("/openid/v1/jwks").json()
    keys = jwt.PyJWKSet.from_dict(jwks)
    token = kube.token_request(namespace, "agent", "https://broker.test")
    key = next(k for k in keys.keys if k.key_id == jwt.get_unverified_header(token)["kid"])
    claims = jwt.decode(
        token, key, algorithms=["RS256"], audience="https://broker.test", issuer=kube.issuer
    )
    assert claims["sub"] == f"system:serviceaccount:{namespace}:agent"
    with pytest.raises(jwt.InvalidAudienceError):
        jwt.decode(token, key, algorithms=["RS256"], audience="https://other.test")
    forged = token[:-8] + ("AAAAAAAA" if not token.endswith("AAAAAAAA") else "BBBBBBBB")
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(forged, key, algorithms=["RS256"], audience="https://broker.test")


def test_token_review(kube: KubeAPIServer, namespace: str) -> None:
    """Without spec.audiences TokenReview checks the API server's own audience; with them,
    status.audiences says which matched."""
    kube.create_service_account(namespace, "agent")
    own = kube.token_review(kube.token_request(namespace, "agent"))
    assert own["authenticated"] is True
    assert own["user"]["username"] == f"system:serviceaccount:{namespace}:agent"
    assert set(own["user"]["groups"]) == {
        "system:serviceaccounts",
        f"system:serviceaccounts:{namespace}",
        "system:authenticated",
    }
    assert own["audiences"] == [kube.api_audience]
    broker_token = kube.token_request(namespace, "agent", "https://broker.test")
    assert kube.token_review(broker_token).get("authenticated") is not True
    matched = kube.token_review(broker_token, ["https://other.test", "https://broker.test"])
    assert matched["authenticated"] is True and matched["audiences"] == ["https://broker.test"]
    assert kube.token_review("e30.e30.e30").get("authenticated") is not True


def test_bind_role_grants_exactly_its_rules(kube: KubeAPIServer, namespace: str) -> None:
    kube.create_service_account(namespace, "broker")
    kube.create(claim(), namespace)
    with kube.client(kube.token_request(namespace, "broker")) as broker:
        assert broker.get(claims_path(namespace)).status_code == 403
        kube.bind_role(
            (namespace, "broker"),
            "claims-reader",
            namespace=namespace,
            rules=[{"apiGroups": ["extensions.agents.x-k8s.io"], "resources": ["sandboxclaims"],
                    "verbs": ["get", "list"]}],
        )  # fmt: skip
        listed = kube.wait_for(
            lambda: broker.get(claims_path(namespace)).status_code == 200, what="RBAC applied"
        )
        assert listed
        assert broker.post(claims_path(namespace), json=claim()).status_code == 403
        other = kube.create_namespace()
        assert broker.get(claims_path(other)).status_code == 403


def test_a_sandbox_claim_with_generate_name_and_its_status_subresource(
    kube: KubeAPIServer, namespace: str
) -> None:
    created = kube.create(claim(lifecycle={"shutdownTime": "2030-01-01T00:00:00Z"}), namespace)
    name = created["metadata"]["name"]
    assert name.startswith("claim-") and len(name) == len("claim-") + 5
    assert created["spec"]["lifecycle"]["shutdownPolicy"] == "Retain"  # the schema's default
    assert "status" not in created
    status = {
        "conditions": [ready_condition("DependenciesReady", "True")],
        "sandbox": {"name": "python-abcde", "podIPs": ["127.0.0.5"]},
    }
    # the main resource ignores status, the status subresource ignores spec
    ignored = kube.merge_patch(claims_path(namespace, name), {"status": status})
    assert "status" not in ignored
    written = kube.merge_patch(
        claims_path(namespace, name, "status"),
        {"status": status, "spec": {"warmPoolRef": {"name": "changed"}}},
    )
    assert written["status"] == status
    assert written["spec"]["warmPoolRef"] == {"name": "python"}
    # the lifecycle can be patched (nothing makes the spec immutable)
    patched = kube.merge_patch(
        claims_path(namespace, name), {"spec": {"lifecycle": {"shutdownPolicy": "Delete"}}}
    )
    assert patched["spec"]["lifecycle"]["shutdownPolicy"] == "Delete"
    assert patched["status"] == status
    bad = {"status": {"conditions": [ready_condition("not a reason!")]}}
    with pytest.raises(KubeError, match="reason") as refused:
        kube.merge_patch(claims_path(namespace, name, "status"), bad)
    assert refused.value.status_code == 422


def test_an_empty_string_is_a_valid_value(kube: KubeAPIServer, namespace: str) -> None:
    """Upstream's controller writes conditions with ``message: ""``. A 1.20 server built with
    Go >= 1.16 took every empty string in a custom resource for null (kubernetes#99804, fixed
    in 1.21): .ci/kube-tools patches the vendored OpenAPI validator."""
    created = kube.create(claim(env=[{"name": "EMPTY", "value": ""}]), namespace)
    assert created["spec"]["env"] == [{"name": "EMPTY", "value": ""}]
    status = {"conditions": [ready_condition("DependenciesNotReady")]}
    assert status["conditions"][0]["message"] == ""
    path = claims_path(namespace, created["metadata"]["name"], "status")
    assert kube.merge_patch(path, {"status": status})["status"] == status
    with pytest.raises(KubeError, match="must be of type string") as refused:
        kube.merge_patch(path, {"status": {"sandbox": {"name": 5}}})
    assert refused.value.status_code == 422


def test_a_watch_delivers_added_and_modified(kube: KubeAPIServer, namespace: str) -> None:
    since = kube.get(claims_path(namespace))["metadata"]["resourceVersion"]
    first = kube.create(claim(), namespace)["metadata"]["name"]
    second = kube.create(claim(), namespace)["metadata"]["name"]
    kube.merge_patch(
        claims_path(namespace, first, "status"),
        {"status": {"conditions": [ready_condition("DependenciesNotReady")]}},
    )
    seen: list[tuple[str, str]] = []
    with kube.watch(claims_path(namespace), resource_version=since, timeout_seconds=5) as events:
        for event in events:
            seen.append((event["type"], event["object"]["metadata"]["name"]))
            if event["type"] == "MODIFIED":
                assert event["object"]["status"]["conditions"][0]["reason"] == (
                    "DependenciesNotReady"
                )
                break
    assert seen == [("ADDED", first), ("ADDED", second), ("MODIFIED", first)]
    # one claim only: a field selector on metadata.name
    one: list[str] = []
    selected = {"fieldSelector": f"metadata.name={second}"}
    with kube.watch(
        claims_path(namespace), resource_version=since, timeout_seconds=1, params=selected
    ) as events:
        one.extend(event["type"] for event in events)
    assert one == ["ADDED"]


def test_a_watch_from_a_too_old_resource_version_gets_410_gone(
    kube: KubeAPIServer, namespace: str
) -> None:
    """1.20 answers 200 and sends one ERROR event whose object is a Status with code 410
    (reason Expired), then ends the stream: the watcher must list again."""
    kube.create(claim(), namespace)
    with kube.watch(claims_path(namespace), resource_version="1", timeout_seconds=5) as events:
        received = list(events)
    [error] = received
    assert error["type"] == "ERROR"
    assert error["object"]["kind"] == "Status"
    assert error["object"]["code"] == 410
    assert error["object"]["reason"] == "Expired"
    assert error["object"]["message"].startswith("too old resource version: 1 (")


def test_a_field_typo_is_pruned_and_invalid_values_are_refused(
    kube: KubeAPIServer, namespace: str
) -> None:
    """Server-side validation of the stand-in CRDs (1.20's messages name a list's items
    without their index: ``spec.env.value``). 1.20 prunes an unknown field silently,
    even with ``fieldValidation=Strict`` (strict validation came in 1.25): the backend must
    compare what it sent with what came back to catch a typo."""
    typo = claim(lifecycle={"shutdownTme": "2030-01-01T00:00:00Z"})
    typo["spec"]["warmPoolRefs"] = {"name": "x"}
    answer = kube.admin.post(
        claims_path(namespace), params={"fieldValidation": "Strict"}, json=typo
    )
    assert answer.status_code == 201 and "warning" not in answer.headers
    assert answer.json()["spec"] == {
        "warmPoolRef": {"name": "python"},
        "lifecycle": {"shutdownPolicy": "Retain"},
    }

    def refused(obj: dict[str, Any], message: str) -> None:
        path = path_of(obj["apiVersion"], obj["kind"], namespace=namespace)
        response = kube.admin.post(path, json=obj)
        assert response.status_code == 422, (obj, response.text)
        assert response.json()["reason"] == "Invalid"
        assert message in response.json()["message"], response.json()["message"]

    no_ref = claim()
    no_ref["spec"] = {"warmPoolRf": {"name": "python"}}
    refused(no_ref, "spec.warmPoolRef: Required value")
    refused(
        claim(lifecycle={"shutdownPolicy": "Forever"}),
        'spec.lifecycle.shutdownPolicy: Unsupported value: "Forever"',
    )
    refused(claim(lifecycle={"ttlSecondsAfterFinished": -1}), "greater than or equal to 0")
    refused(claim(env=[{"name": "A"}]), "spec.env.value: Required value")
    refused(claim(lifecycle={"shutdownTime": "tomorrow"}), "spec.lifecycle.shutdownTime")
    pool = {"apiVersion": EXT, "kind": "SandboxWarmPool", "metadata": {"name": "p"},
            "spec": {"sandboxTemplateRef": {"name": "python"}, "replicas": "two"}}  # fmt: skip
    refused(pool, "spec.replicas: Invalid value")
    unnamed = {"containers": [{"image": "python"}]}
    template = {"apiVersion": EXT, "kind": "SandboxTemplate", "metadata": {"name": "t"},
                "spec": {"podTemplate": {"spec": unnamed}}}  # fmt: skip
    refused(template, "spec.podTemplate.spec.containers.name: Required value")
    template["spec"] = {"podTemplate": {"spec": {"containers": [{"name": "main"}]}},
                        "envVarsInjectionPolicy": "Sometimes"}  # fmt: skip
    refused(template, "spec.envVarsInjectionPolicy: Unsupported value")


def test_the_other_kinds_take_upstreams_shape(kube: KubeAPIServer, namespace: str) -> None:
    template = kube.apply({
        "apiVersion": EXT, "kind": "SandboxTemplate", "metadata": {"name": "python"},
        "spec": {"podTemplate": {
            "metadata": {"labels": {"app": "sandbox"}},
            "spec": {"containers": [{"name": "main", "image": "python:3.12",
                                     "ports": [{"containerPort": 8888}]}]},
        }},
    }, namespace)  # fmt: skip
    assert template["spec"]["networkPolicyManagement"] == "Managed"
    assert template["spec"]["envVarsInjectionPolicy"] == "Disallowed"
    # the pod spec is kept as given beyond the fields the stand-in models (see the CRD file)
    assert template["spec"]["podTemplate"]["spec"]["containers"][0]["ports"] == [
        {"containerPort": 8888}
    ]
    pool = kube.apply({
        "apiVersion": EXT, "kind": "SandboxWarmPool", "metadata": {"name": "python"},
        "spec": {"sandboxTemplateRef": {"name": "python"}},
    }, namespace)  # fmt: skip
    assert pool["spec"]["replicas"] == 1
    scale = kube.get(path_of(EXT, "SandboxWarmPool", namespace=namespace, name="python",
                             subresource="scale"))  # fmt: skip
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
    sandbox = kube.create({
        "apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
        "metadata": {"name": "python-abcde"},
        "spec": {"podTemplate": {"spec": {"containers": [{"name": "main"}]}}},
    }, namespace)  # fmt: skip
    assert sandbox["spec"]["operatingMode"] == "Running"
    status = {"podIPs": ["127.0.0.5"], "serviceFQDN": "python-abcde.ns.svc.cluster.local",
              "conditions": [ready_condition("DependenciesReady", "True")]}  # fmt: skip
    path = path_of("agents.x-k8s.io/v1beta1", "Sandbox", namespace=namespace,
                   name="python-abcde", subresource="status")  # fmt: skip
    assert kube.merge_patch(path, {"status": status})["status"] == status
    with pytest.raises(KubeError) as no_status:  # upstream's SandboxTemplate has none
        kube.get(path_of(EXT, "SandboxTemplate", namespace=namespace, name="python",
                         subresource="status"))  # fmt: skip
    assert no_status.value.status_code == 404


def test_restart_the_server_is_ready_again_and_an_old_watch_gets_410(
    kube: KubeAPIServer, namespace: str
) -> None:
    name = kube.create(claim(), namespace)["metadata"]["name"]
    since = kube.get(claims_path(namespace))["metadata"]["resourceVersion"]
    kube.create(claim(), namespace)
    took = kube.restart()
    assert took < 30
    assert kube.admin.get("/readyz").status_code == 200
    assert kube.get(claims_path(namespace, name))["metadata"]["name"] == name  # etcd kept it
    with kube.watch(claims_path(namespace), resource_version=since, timeout_seconds=5) as events:
        [error] = list(events)
    assert error["type"] == "ERROR" and error["object"]["code"] == 410


def test_a_restart_from_a_thread_that_then_ends_leaves_the_server_running(
    kube: KubeAPIServer,
) -> None:
    """PR_SET_PDEATHSIG fires when the thread that forked ends: an API server restarted from a
    worker thread (``asyncio.to_thread``, a thread pool shut down with its event loop) must
    not die with that thread."""
    worker = threading.Thread(target=kube.restart, kwargs={"crash": True})
    worker.start()
    worker.join()
    time.sleep(0.5)  # the signal, had it been armed, comes at once
    assert kube.admin.get("/readyz").status_code == 200
    with kube.client(kube.admin_token) as fresh:  # a new connection: a living process
        assert fresh.get("/version").json()["gitVersion"] == "v1.20.2"
