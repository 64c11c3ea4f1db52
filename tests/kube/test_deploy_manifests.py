"""Every manifest under deploy/ is accepted by a real API server, field for field, and the
broker's RBAC is minimal and sufficient (issue 22, "Manifests").

Each object of the rendered kustomization (deploy/broker, with every component of
deploy/broker/components), of deploy/examples and of deploy/examples/client is applied with
server-side apply in dry-run mode (``?dryRun=All``: admission and validation run, nothing is
stored), then what came back is compared with what was sent (``lost_fields``). What the API
server of our tests (1.20) checks: types, enums, required fields, names, and (server-side
apply's typed patch) a field not in the schema is refused. What it does not: a plain create or
client-side ``kubectl apply`` on 1.20 drops an unknown field silently (``fieldValidation=Strict``
arrived in 1.25), and a schema with ``x-kubernetes-preserve-unknown-fields`` keeps anything: the
stand-in CRD keeps a SandboxTemplate's pod spec as given (upstream's spells out core/v1's
PodSpec), so each template's pod is also created as a Pod (dry run) and compared field for
field. Limits on this server: policy/v1 PodDisruptionBudget is served from 1.21, so the PDB is
checked as policy/v1beta1 (the same fields for what it uses); cert-manager's CRDs are stand-ins
(tests/_support/deploy.py); NetworkPolicies are validated, not enforced (no network plugin);
nothing runs the Deployment (no kubelet, and no image is built here).

RBAC: the rendered roles and bindings are applied for real, relocated to fresh namespaces and
names (so that tests do not share grants), to the broker's ServiceAccount; its token comes
from TokenRequest; SelfSubjectRulesReview lists exactly what it may do, SelfSubjectAccessReview
and real requests check what it may not.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator, Mapping
from typing import Any, Final

import pytest

from tests._support.deploy import (
    BROKER,
    COMPONENTS,
    EXAMPLES,
    cert_manager_stand_in_crds,
    component_dirs,
    describe,
    find,
    lost_fields,
    render,
)
from tests._support.kube import KubeAPIServer, KubeError

pytestmark = pytest.mark.slow  # one API server per session: ~4 s to start

BROKER_NAMESPACE: Final = "agent-sandbox-broker"
SANDBOX_NAMESPACE: Final = "team-a"
SERVICE_ACCOUNT: Final = "sandbox-broker"
CLAIMS: Final = ("extensions.agents.x-k8s.io", "sandboxclaims")
SANDBOXES: Final = ("agents.x-k8s.io", "sandboxes")
LEASES: Final = ("coordination.k8s.io", "leases")
DISCOVERY_PATHS: Final = ("/.well-known/openid-configuration", "/openid/v1/jwks")

# (apiVersion, kind) -> (plural, namespaced) of every kind deploy/ holds
PLURALS: Final[Mapping[tuple[str, str], tuple[str, bool]]] = {
    ("v1", "Namespace"): ("namespaces", False),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Service"): ("services", True),
    ("v1", "Pod"): ("pods", True),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("batch/v1", "Job"): ("jobs", True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("policy/v1beta1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): ("clusterroles", False),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): ("clusterrolebindings", False),
    ("rbac.authorization.k8s.io/v1", "Role"): ("roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
    ("cert-manager.io/v1", "Certificate"): ("certificates", True),
    ("cert-manager.io/v1", "Issuer"): ("issuers", True),
    ("extensions.agents.x-k8s.io/v1beta1", "SandboxTemplate"): ("sandboxtemplates", True),
    ("extensions.agents.x-k8s.io/v1beta1", "SandboxWarmPool"): ("sandboxwarmpools", True),
}
# a version the manifests use -> the older one with the same fields that 1.20 serves
OLDER_VERSIONS: Final = {("policy/v1", "PodDisruptionBudget"): "policy/v1beta1"}


def rest_path(obj: Mapping[str, Any], *, collection: bool = False) -> str:
    key = (obj["apiVersion"], obj["kind"])
    if key not in PLURALS:
        raise AssertionError(f"{describe(obj)}: add {key} to PLURALS in {__file__}")
    plural, namespaced = PLURALS[key]
    meta = obj["metadata"]
    prefix = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
    if namespaced:
        prefix += f"/namespaces/{meta['namespace']}"
    return f"{prefix}/{plural}" if collection else f"{prefix}/{plural}/{meta['name']}"


def every_manifest() -> list[dict[str, Any]]:
    """The broker's kustomization with every component, then deploy/examples (the
    templates and pools, and the client)."""
    return render(BROKER, component_dirs()) + render(EXAMPLES) + render(EXAMPLES / "client")


MANIFESTS: Final = every_manifest()


# ------------------------------------------------------------------------------ dry runs


@pytest.fixture(scope="module")
def deploy_cluster(kube: KubeAPIServer) -> KubeAPIServer:
    """The session's API server with what the manifests presuppose: their namespaces (a
    dry-run object needs a real namespace), the ``default`` ServiceAccount of the sandboxes'
    namespace (no controller makes it here; a Pod needs it) and cert-manager's stand-in CRDs."""
    kube.apply(find(MANIFESTS, "Namespace", BROKER_NAMESPACE))
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SANDBOX_NAMESPACE}})
    kube.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}},
        SANDBOX_NAMESPACE,
    )
    for crd in cert_manager_stand_in_crds():
        kube.apply(crd)
    for crd in cert_manager_stand_in_crds():
        group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
        path = f"/apis/{group}/v1/{plural}"
        kube.wait_for(lambda p=path: kube.admin.get(p).status_code == 200, what=f"{path} served")
    return kube


def served(kube: KubeAPIServer, api_version: str) -> bool:
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return kube.admin.get(path).status_code == 200


def dry_run_apply(kube: KubeAPIServer, obj: Mapping[str, Any]) -> dict[str, Any]:
    """Server-side apply of ``obj`` with ``dryRun=All``: the object as it would be stored."""
    return kube.request(
        "PATCH",
        rest_path(obj),
        params={"dryRun": "All", "fieldManager": "deploy-manifests-test", "force": "true"},
        content=json.dumps(obj),
        headers={"Content-Type": "application/apply-patch+yaml"},
    )


def as_served(kube: KubeAPIServer, obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj``, or (when this server does not serve its version) the same object in the
    older version this server has (OLDER_VERSIONS), which the test says."""
    if served(kube, obj["apiVersion"]):
        return dict(obj)
    older = OLDER_VERSIONS.get((obj["apiVersion"], obj["kind"]))
    if older is None or not served(kube, older):
        raise AssertionError(f"{describe(obj)}: {obj['apiVersion']} is not served here")
    return {**obj, "apiVersion": older}


@pytest.mark.parametrize("manifest", MANIFESTS, ids=describe)
def test_every_manifest_passes_server_side_validation_field_for_field(
    deploy_cluster: KubeAPIServer, manifest: dict[str, Any]
) -> None:
    sent = as_served(deploy_cluster, manifest)
    returned = dry_run_apply(deploy_cluster, sent)
    assert lost_fields(sent, returned) == []


def template_pod(template: Mapping[str, Any]) -> dict[str, Any]:
    """The Pod a SandboxTemplate's pod template makes (its metadata and spec)."""
    pod_template = template["spec"]["podTemplate"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{template['metadata']['name']}-pod-check",
            "namespace": template["metadata"]["namespace"],
            **copy.deepcopy(pod_template.get("metadata") or {}),
        },
        "spec": copy.deepcopy(pod_template["spec"]),
    }


@pytest.mark.parametrize(
    "template",
    [m for m in MANIFESTS if m["kind"] == "SandboxTemplate"],
    ids=describe,
)
def test_each_templates_pod_is_a_valid_pod(
    deploy_cluster: KubeAPIServer, template: dict[str, Any]
) -> None:
    """The stand-in CRD keeps a pod spec as given (upstream's validates it as a core/v1
    PodSpec): the pod a template makes is checked as a Pod, field for field."""
    pod = template_pod(template)
    assert lost_fields(pod, create_dry_run(deploy_cluster, pod)) == []


def test_a_misspelt_field_fails(deploy_cluster: KubeAPIServer) -> None:
    """The checks above can fail. A misspelt field, of a built-in kind or of a custom
    resource: server-side apply refuses it ("field not declared in schema"); sent by a plain
    create (the path of ``kubectl create``, and of client-side ``kubectl apply`` for a new
    object), 1.20 drops it silently and ``lost_fields`` names it."""
    deployment = copy.deepcopy(find(MANIFESTS, "Deployment", "sandbox-broker"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"]["readOnlyRootFileSystem"] = True  # for readOnlyRootFilesystem
    pool = copy.deepcopy(find(MANIFESTS, "SandboxWarmPool", "awx-runtime-warmpool"))
    pool["spec"]["replica"] = 3  # for replicas
    for obj, field in ((deployment, "readOnlyRootFileSystem"), (pool, "replica")):
        with pytest.raises(KubeError, match=f"{field}: field not declared in schema"):
            dry_run_apply(deploy_cluster, obj)
    lost = [lost_fields(obj, create_dry_run(deploy_cluster, obj)) for obj in (deployment, pool)]
    assert lost == [
        [
            "spec.template.spec.containers[0].securityContext.readOnlyRootFileSystem: "
            "dropped by the API server (unknown field?)"
        ],
        ["spec.replica: dropped by the API server (unknown field?)"],
    ]
    template = copy.deepcopy(find(MANIFESTS, "SandboxTemplate", "awx-runtime"))
    container = template["spec"]["podTemplate"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    dry_run_apply(deploy_cluster, template)  # the pod spec's fields are kept as given...
    pod = template_pod(template)  # ...and the Pod check finds the typo
    assert lost_fields(pod, create_dry_run(deploy_cluster, pod)) == [
        "spec.containers[0].readinesProbe: dropped by the API server (unknown field?)"
    ]


def create_dry_run(kube: KubeAPIServer, obj: Mapping[str, Any]) -> dict[str, Any]:
    """A plain create of ``obj`` with ``dryRun=All``: the object as it would be stored."""
    return kube.request("POST", rest_path(obj, collection=True), params={"dryRun": "All"}, json=obj)


def test_a_wrong_value_is_refused(deploy_cluster: KubeAPIServer) -> None:
    """What 1.20 does refuse: a bad type or enum value (422 Invalid)."""
    policy = copy.deepcopy(find(MANIFESTS, "NetworkPolicy", "sandbox-broker"))
    policy["spec"]["ingress"][0]["ports"][0]["protocol"] = "TPC"
    with pytest.raises(KubeError) as refused:
        dry_run_apply(deploy_cluster, policy)
    assert refused.value.status_code == 422, refused.value


# ------------------------------------------------------------------------------ RBAC


def relocate(objects: list[dict[str, Any]], names: Mapping[str, str]) -> list[dict[str, Any]]:
    """The RBAC objects (and the ServiceAccount) of ``objects``, with every namespace in
    ``names`` renamed and cluster-scoped names given the suffix ``names[""]``."""
    suffix, moved = names[""], []
    for obj in copy.deepcopy(objects):
        if obj["kind"] not in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                               "Role", "RoleBinding"):  # fmt: skip
            continue
        meta = obj["metadata"]
        if "namespace" in meta:
            meta["namespace"] = names[meta["namespace"]]
        else:
            meta["name"] += suffix
        for subject in obj.get("subjects", []):
            subject["namespace"] = names[subject["namespace"]]
        ref = obj.get("roleRef", {})
        if ref.get("kind") == "ClusterRole" and not ref["name"].startswith("system:"):
            ref["name"] += suffix
        moved.append(obj)
    return moved


class Broker:
    """The broker's ServiceAccount, its grants applied for real in fresh namespaces."""

    def __init__(self, kube: KubeAPIServer) -> None:
        self.kube = kube
        self.namespace = kube.create_namespace()
        self.sandboxes = kube.create_namespace()  # plays team-a
        self.elsewhere = kube.create_namespace()  # a namespace no policy names
        self.names = {BROKER_NAMESPACE: self.namespace, SANDBOX_NAMESPACE: self.sandboxes,
                      "": f"-{self.namespace}"}  # fmt: skip
        self.token = ""

    def grant(self, *components: str) -> None:
        objects = relocate(render(BROKER, [COMPONENTS / c for c in components]), self.names)
        for obj in objects:
            self.kube.apply(obj)
        self.token = self.kube.token_request(self.namespace, SERVICE_ACCOUNT)
        self._wait_for_bindings(objects)

    def _wait_for_bindings(self, objects: list[dict[str, Any]]) -> None:
        """Wait until the API server's authorizer sees every binding applied: it decides from
        caches its watches fill, a moment after the write (CI saw a grant not yet in force).
        One rule of each binding's role is asked for until it is allowed (10 s at most)."""
        roles = {(o["kind"], o["metadata"]["name"]): o for o in objects if "rules" in o}
        for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
            ref = binding["roleRef"]
            role = roles.get((ref["kind"], ref["name"]))
            rules = (role or {}).get("rules", [])
            named = [r for r in rules if r.get("resources") and not r.get("resourceNames")]
            rule = named[0] if named else None
            if rule is None:
                continue
            namespace = binding["metadata"].get("namespace", "")
            resource, _, sub = rule["resources"][0].partition("/")
            asked = (rule["verbs"][0], rule["apiGroups"][0], resource, namespace, sub)
            deadline = time.monotonic() + 10
            while not self.may(*asked):
                assert time.monotonic() < deadline, f"{binding['metadata']} not in force: {asked}"
                time.sleep(0.05)

    def may(self, verb: str, group: str, resource: str, namespace: str = "",
            subresource: str = "") -> bool:  # fmt: skip
        attributes = {"verb": verb, "group": group, "resource": resource,
                      "namespace": namespace, "subresource": subresource}  # fmt: skip
        return self._review("selfsubjectaccessreviews", {"resourceAttributes": attributes})

    def may_read(self, path: str) -> bool:
        return self._review(
            "selfsubjectaccessreviews", {"nonResourceAttributes": {"verb": "get", "path": path}}
        )

    def _review(self, kind: str, spec: Mapping[str, Any]) -> bool:
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": spec}  # fmt: skip
        with self.kube.client(self.token) as client:
            answer = client.post(f"/apis/authorization.k8s.io/v1/{kind}", json=body)
        assert answer.status_code == 201, answer.text
        return bool(answer.json()["status"]["allowed"])

    def rules(self, namespace: str) -> set[tuple[str, str, str]]:
        """(group, resource, verb) the token may use in ``namespace``, from
        SelfSubjectRulesReview, minus the self-reviews every user may create."""
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
                "spec": {"namespace": namespace}}  # fmt: skip
        with self.kube.client(self.token) as client:
            answer = client.post("/apis/authorization.k8s.io/v1/selfsubjectrulesreviews", json=body)
        assert answer.status_code == 201, answer.text
        status = answer.json()["status"]
        assert not status.get("incomplete"), status
        return {
            (group, resource, verb)
            for rule in status["resourceRules"]
            for group in rule.get("apiGroups", [])
            for resource in rule.get("resources", [])
            for verb in rule["verbs"]
            if group != "authorization.k8s.io"
        }


@pytest.fixture
def broker(kube: KubeAPIServer) -> Iterator[Broker]:
    yield Broker(kube)


EXPECTED_RULES: Final = {
    *((*CLAIMS, verb) for verb in ("get", "list", "watch", "create", "delete", "patch")),
    *((*SANDBOXES, verb) for verb in ("get", "list", "watch")),
    *((*LEASES, verb) for verb in ("get", "create", "patch")),  # the quota ledgers
}


def test_the_broker_may_do_exactly_what_the_docs_list(broker: Broker) -> None:
    broker.grant()
    assert broker.rules(broker.sandboxes) == EXPECTED_RULES
    assert broker.rules(broker.namespace) == set()  # its own namespace: nothing
    assert broker.rules(broker.elsewhere) == set()  # a namespace no policy names: nothing


@pytest.mark.parametrize(
    ("verb", "group", "resource", "subresource"),
    [
        ("update", *CLAIMS, ""),
        ("deletecollection", *CLAIMS, ""),
        ("patch", *CLAIMS, "status"),
        ("update", *CLAIMS, "status"),
        ("create", *SANDBOXES, ""),
        ("patch", *SANDBOXES, ""),
        ("delete", *SANDBOXES, ""),
        ("get", "extensions.agents.x-k8s.io", "sandboxtemplates", ""),
        ("list", "extensions.agents.x-k8s.io", "sandboxwarmpools", ""),
        ("get", "", "secrets", ""),
        ("list", "", "secrets", ""),
        ("get", "", "pods", ""),
        ("create", "", "pods", "exec"),
        ("create", "", "serviceaccounts", "token"),
        ("get", "", "configmaps", ""),
        ("list", *LEASES, ""),  # the ledgers are read by name
        ("delete", *LEASES, ""),
        ("update", *LEASES, ""),
    ],
)
def test_what_the_broker_may_not_do(
    broker: Broker, verb: str, group: str, resource: str, subresource: str
) -> None:
    broker.grant()
    assert broker.may("get", *CLAIMS, broker.sandboxes)  # the grants are in place
    for namespace in (broker.sandboxes, broker.namespace):
        assert not broker.may(verb, group, resource, namespace, subresource)


def test_the_broker_works_only_in_the_namespaces_its_policies_name(broker: Broker) -> None:
    broker.grant()
    assert broker.may("create", *CLAIMS, broker.sandboxes)
    assert not broker.may("create", *CLAIMS, broker.elsewhere)
    assert not broker.may("list", *CLAIMS)  # cluster-wide
    assert not broker.may("watch", *SANDBOXES)


def test_real_requests_are_allowed_and_refused_as_reviewed(broker: Broker) -> None:
    """Not only the reviews: the API server lets the broker's token create (dry run) and
    patch a claim, and refuses an update and a Secret, with 403 Forbidden naming it."""
    broker.grant()
    claim = {"apiVersion": "extensions.agents.x-k8s.io/v1beta1", "kind": "SandboxClaim",
             "metadata": {"name": "rbac-check"},
             "spec": {"warmPoolRef": {"name": "awx-runtime-warmpool"}}}  # fmt: skip
    claims = f"/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/{broker.sandboxes}/sandboxclaims"
    with broker.kube.client(broker.token) as client:
        assert client.post(claims, json=claim).status_code == 201
        listed = client.get(claims)
        assert listed.status_code == 200
        patched = client.patch(
            f"{claims}/rbac-check",
            content=json.dumps({"spec": {"lifecycle": {"shutdownPolicy": "Delete"}}}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert patched.status_code == 200, patched.text
        update = client.put(f"{claims}/rbac-check", json=patched.json())
        secrets = client.get(f"/api/v1/namespaces/{broker.namespace}/secrets")
        elsewhere = client.post(claims.replace(broker.sandboxes, broker.elsewhere), json=claim)
        assert client.delete(f"{claims}/rbac-check").status_code == 200
    for refused in (update, secrets, elsewhere):
        assert refused.status_code == 403, refused.text
        assert refused.json()["reason"] == "Forbidden"
        assert f"system:serviceaccount:{broker.namespace}:{SERVICE_ACCOUNT}" in refused.text


def test_the_broker_reads_the_clusters_jwks_through_its_own_binding(broker: Broker) -> None:
    """The discovery document and the JWKS: allowed with the broker's token, and by the
    manifests' binding alone (a cluster may have removed the default binding to all
    ServiceAccounts: a SubjectAccessReview for the broker's user without its groups)."""
    broker.grant()
    with broker.kube.client(broker.token) as client:
        for path in DISCOVERY_PATHS:
            assert client.get(path).status_code == 200, path
    user = f"system:serviceaccount:{broker.namespace}:{SERVICE_ACCOUNT}"
    for path in DISCOVERY_PATHS:
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {"user": user, "groups": [],
                           "nonResourceAttributes": {"verb": "get", "path": path}}}  # fmt: skip
        answer = broker.kube.request(
            "POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", json=review
        )
        assert answer["status"]["allowed"], (path, answer["status"])


def test_tokenreview_only_with_its_component(broker: Broker) -> None:
    broker.grant()
    assert not broker.may("create", "authentication.k8s.io", "tokenreviews")
    broker.grant("tokenreview")
    assert broker.may("create", "authentication.k8s.io", "tokenreviews")
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
              "spec": {"token": broker.token}}  # fmt: skip
    with broker.kube.client(broker.token) as client:
        answer = client.post("/apis/authentication.k8s.io/v1/tokenreviews", json=review)
    assert answer.status_code == 201, answer.text
    assert answer.json()["status"]["authenticated"] is True
    assert broker.rules(broker.sandboxes) == EXPECTED_RULES | {
        ("authentication.k8s.io", "tokenreviews", "create")
    }


def test_all_namespaces_component_grants_the_same_verbs_everywhere(broker: Broker) -> None:
    broker.grant("all-namespaces")
    assert broker.may("list", *CLAIMS)  # cluster-wide, for the informer of every namespace
    assert broker.rules(broker.elsewhere) == EXPECTED_RULES
    assert not broker.may("update", *CLAIMS, broker.elsewhere)
