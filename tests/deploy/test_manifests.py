"""The manifests under deploy/ agree with each other, with the broker's configuration and with
what issue 22 asks of them (without an API server: tests/kube/test_deploy_manifests.py
applies them to one).

- The renderer the tests use (tests/_support/deploy.py) gives what ``kubectl kustomize``
  gives, for the base, each component and the examples (skipped where kubectl is missing).
- broker.toml in the ConfigMap uses only the configuration's keys (design of issue 21) and
  every path in it is one the Deployment mounts; ports, names, users and grace periods agree
  across the files.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any, Final

import pytest
import yaml  # type: ignore[import-untyped]

from tests._support.deploy import (
    BROKER,
    BROKER_CONTAINERFILE,
    COMPONENTS,
    EXAMPLES,
    RUNTIME_CONTAINERFILE,
    Containerfile,
    KustomizeError,
    component_dirs,
    describe,
    find,
    kubectl,
    kubectl_kustomize,
    object_id,
    render,
)

BASE: Final = render(BROKER)
EVERYTHING: Final = render(BROKER, component_dirs())
EXAMPLE_OBJECTS: Final = render(EXAMPLES)
CLIENT_OBJECTS: Final = render(EXAMPLES / "client")
CONFIG_MOUNT: Final = "/etc/agent-sandbox-broker/broker.toml"


def deployment() -> dict[str, Any]:
    return find(BASE, "Deployment", "sandbox-broker")


def pod_spec() -> dict[str, Any]:
    return dict(deployment()["spec"]["template"]["spec"])


def container() -> dict[str, Any]:
    [only] = pod_spec()["containers"]
    return dict(only)


def config() -> dict[str, Any]:
    text = find(BASE, "ConfigMap", "sandbox-broker-config")["data"]["broker.toml"]
    return tomllib.loads(text)


# ------------------------------------------------------------------------------ rendering


VARIANTS: Final = [
    ("base", BROKER, ()),
    *((f"+{c.name}", BROKER, (c,)) for c in component_dirs()),
    ("+all components", BROKER, tuple(component_dirs())),
    ("examples", EXAMPLES, ()),
    ("examples/client", EXAMPLES / "client", ()),
]


@pytest.mark.parametrize(("root", "components"), [v[1:] for v in VARIANTS],
                         ids=[v[0] for v in VARIANTS])  # fmt: skip
def test_the_renderer_renders_what_kubectl_kustomize_renders(
    root: Path, components: tuple[Path, ...]
) -> None:
    binary = kubectl()
    if binary is None:
        pytest.skip("kubectl (with kustomize) is not installed: the renderer is not cross-checked")
    ours = sorted(render(root, components), key=object_id)
    theirs = sorted(kubectl_kustomize(binary, root, components), key=object_id)
    assert ours == theirs


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: []\nnamePrefix: x-\n"
    )
    with pytest.raises(KustomizeError, match=r"\['namePrefix'\] not supported"):
        render(tmp_path)


def test_every_manifest_file_is_in_a_kustomization() -> None:
    """A file left out of the kustomizations would never be validated."""
    on_disk = set()
    for path in (*BROKER.rglob("*.yaml"), *EXAMPLES.rglob("*.yaml")):
        if path.name != "kustomization.yaml":
            on_disk |= {describe(d) for d in yaml.safe_load_all(path.read_text()) if d}
    rendered = [describe(o) for o in EVERYTHING + EXAMPLE_OBJECTS + CLIENT_OBJECTS]
    assert sorted(on_disk) == sorted(rendered)


def test_no_secret_is_in_the_manifests() -> None:
    """The TLS key and the router token are Secrets the operator creates (or cert-manager):
    never files in the repository."""
    everything = EVERYTHING + EXAMPLE_OBJECTS + CLIENT_OBJECTS
    assert [describe(o) for o in everything if o["kind"] == "Secret"] == []


# ------------------------------------------------------------------------------ the Deployment


def test_the_deployment_is_hardened_as_the_issue_asks() -> None:
    spec, broker = pod_spec(), container()
    assert deployment()["spec"]["replicas"] == 2
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert broker["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert set(broker["resources"]) == {"requests", "limits"}
    for kind in ("requests", "limits"):
        assert set(broker["resources"][kind]) == {"cpu", "memory"}
    assert spec["affinity"]["podAntiAffinity"]
    assert spec["topologySpreadConstraints"]
    pdb = find(BASE, "PodDisruptionBudget", "sandbox-broker")
    assert pdb["spec"]["selector"] == deployment()["spec"]["selector"]
    assert pdb["spec"]["minAvailable"] == 1


def test_the_probes_are_the_brokers_health_endpoints_over_https() -> None:
    broker = container()
    assert broker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https",
                                                   "scheme": "HTTPS"}  # fmt: skip
    assert broker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "https",
                                                  "scheme": "HTTPS"}  # fmt: skip
    port, _metrics = broker["ports"]
    assert port["name"] == "https"
    host, _, listen_port = config()["server"]["listen"].rpartition(":")
    assert (host, int(listen_port)) == ("[::]", port["containerPort"])  # IPv6 and IPv4
    service = find(BASE, "Service", "sandbox-broker")
    assert service["spec"]["selector"] == deployment()["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [
        {"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}
    ]


def test_the_only_writable_place_is_tmp() -> None:
    spec, broker = pod_spec(), container()
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = [m["mountPath"] for m in broker["volumeMounts"] if not m.get("readOnly")]
    assert writable == ["/tmp"]
    [tmp] = [m["name"] for m in broker["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in volumes[tmp]


def test_the_grace_period_outlasts_the_brokers_shutdown_grace() -> None:
    grace = config()["server"]["shutdown_grace_seconds"]
    assert pod_spec()["terminationGracePeriodSeconds"] >= grace + 10


def test_the_deployment_and_the_image_run_as_the_same_user() -> None:
    uid, _, gid = Containerfile(BROKER_CONTAINERFILE).last("USER").partition(":")
    context = pod_spec()["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"]) == (int(uid), int(gid))
    assert int(uid) != 0


def mounted_file(path: str) -> dict[str, Any]:
    """The volume a file of the container is on (the mount whose path contains it)."""
    spec, broker = pod_spec(), container()
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in broker["volumeMounts"]:
        if path == mount["mountPath"] or path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return {"mount": mount, "volume": volumes[mount["name"]]}
    raise AssertionError(f"{path}: no volume of the Deployment holds it")


def test_every_file_the_configuration_names_is_mounted() -> None:
    settings = config()
    [issuer] = settings["issuers"]
    kubernetes = settings["backend"]["kubernetes"]
    on = {key: mounted_file(path)["volume"] for key, path in {
        "config": CONFIG_MOUNT,
        "tls_cert_file": settings["server"]["tls_cert_file"],
        "tls_key_file": settings["server"]["tls_key_file"],
        "router_token_file": kubernetes["router_token_file"],
        "token_file": issuer["token_file"],
    }.items()}  # fmt: skip
    assert on["config"]["configMap"]["name"] == "sandbox-broker-config"
    assert mounted_file(CONFIG_MOUNT)["mount"]["subPath"] == "broker.toml"
    assert on["tls_cert_file"]["secret"]["secretName"] == "sandbox-broker-tls"
    assert on["tls_key_file"] == on["tls_cert_file"]
    assert on["router_token_file"]["secret"]["secretName"] == "sandbox-broker-router-token"
    [source] = on["token_file"]["projected"]["sources"]
    token = source["serviceAccountToken"]
    assert token["path"] == Path(issuer["token_file"]).name
    assert 600 <= token["expirationSeconds"] <= 3600  # short-lived (600 is the API's minimum)
    # the automounted ServiceAccount files (in-cluster connection, issuer CA)
    assert issuer["ca_file"] == "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    assert pod_spec().get("automountServiceAccountToken", True) is True
    assert pod_spec()["serviceAccountName"] == "sandbox-broker"


def test_the_image_runs_the_configuration_the_configmap_mounts() -> None:
    entrypoint = Containerfile(BROKER_CONTAINERFILE).exec_form("ENTRYPOINT")
    assert entrypoint[-2:] == ["--config", CONFIG_MOUNT]
    assert "command" not in container() and "args" not in container()


# ------------------------------------------------------------------------------ broker.toml

# The keys of the configuration file (design of issue 21, docs/broker/): a key outside these
# is refused by the broker at start.
SCHEMA: Final[dict[str, set[str]]] = {
    "": {"server", "issuers", "policies", "backend", "logging", "audit", "metrics"},
    "logging": {"format"},
    "audit": {"destination"},
    "metrics": {"listen"},
    "server": {"listen", "public_url", "tls_cert_file", "tls_key_file", "tls_reload_seconds",
               "protocols", "shutdown_grace_seconds", "log_level"},
    "issuers": {"name", "url", "provider", "audiences", "algorithms", "clock_skew_seconds",
                "discovery", "jwks_url", "jwks_cache_seconds", "jwks_min_refetch_seconds",
                "ca_file", "token_file", "verification", "attributes"},
    "policies": {"name", "issuer", "subject", "claims", "warm_pools", "namespace",
                 "max_sandboxes", "max_lifetime_seconds", "scopes"},
    "backend": {"kind", "kubernetes", "local"},
    "backend.kubernetes": {"connection", "kubeconfig_file", "context", "ready_timeout_seconds",
                           "data_plane", "router_url", "router_token_file", "router_ca_file",
                           "runtime_port", "allow_loopback_pod_ips", "pod_label_domains",
                           "router_pod_ip"},
}  # fmt: skip


def test_the_configuration_uses_only_the_configurations_keys() -> None:
    settings = config()
    assert set(settings) <= SCHEMA[""]
    assert set(settings["server"]) <= SCHEMA["server"]
    for issuer in settings["issuers"]:
        assert set(issuer) <= SCHEMA["issuers"]
    for policy in settings["policies"]:
        assert set(policy) <= SCHEMA["policies"]
    assert set(settings["backend"]) <= SCHEMA["backend"]
    for table in ("logging", "audit", "metrics"):
        assert set(settings[table]) <= SCHEMA[table]
    assert set(settings["backend"]["kubernetes"]) <= SCHEMA["backend.kubernetes"]
    assert settings["backend"]["kind"] == "kubernetes"
    assert "allow_loopback_pod_ips" not in settings["backend"]["kubernetes"]  # tests only


def test_the_brokers_own_loader_accepts_the_configuration(tmp_path: Path) -> None:
    """The broker's configuration loader (``broker/config``, issue 21) reads broker.toml with
    every rule; the files it names are the pod's, so they are not looked for here."""
    if importlib.util.find_spec("k8s_agent_sandbox_awx.broker.config") is None:
        pytest.skip("the broker's configuration loader has not landed on this branch yet")
    from k8s_agent_sandbox_awx.broker.config import load_config

    path = tmp_path / "broker.toml"
    path.write_text(find(BASE, "ConfigMap", "sandbox-broker-config")["data"]["broker.toml"])
    loaded = load_config(path, check_files=False)
    assert loaded.server.listen == config()["server"]["listen"]


def test_the_configuration_holds_no_inline_secret() -> None:
    def keys(value: Any, prefix: str = "") -> list[str]:
        if isinstance(value, dict):
            return [k for key, v in value.items() for k in keys(v, f"{prefix}{key}.")]
        if isinstance(value, list):
            return [k for item in value for k in keys(item, prefix)]
        return [prefix.rstrip(".")]

    secretish = ("token", "key", "secret", "password")
    inline = [k for k in keys(config()) if any(w in k.rsplit(".", 1)[-1] for w in secretish)]
    assert all(k.endswith("_file") for k in inline), inline


def test_the_public_url_is_the_service_and_the_certificate_and_the_audience() -> None:
    settings = config()
    host = urllib.parse.urlsplit(settings["server"]["public_url"]).hostname
    service = find(BASE, "Service", "sandbox-broker")["metadata"]
    assert host == f"{service['name']}.{service['namespace']}.svc"
    certificate = find(EVERYTHING, "Certificate", "sandbox-broker-tls")["spec"]
    assert host in certificate["dnsNames"]
    assert certificate["secretName"] == mounted_file(settings["server"]["tls_cert_file"])[
        "volume"]["secret"]["secretName"]  # fmt: skip
    assert settings["issuers"][0]["audiences"] == [settings["server"]["public_url"]]


def test_each_policy_namespace_has_the_brokers_role_and_its_warm_pools() -> None:
    pools = {(o["metadata"]["namespace"], o["metadata"]["name"]): o
             for o in EXAMPLE_OBJECTS if o["kind"] == "SandboxWarmPool"}  # fmt: skip
    templates = {(o["metadata"]["namespace"], o["metadata"]["name"])
                 for o in EXAMPLE_OBJECTS if o["kind"] == "SandboxTemplate"}  # fmt: skip
    bound = {o["metadata"]["namespace"] for o in BASE if o["kind"] == "RoleBinding"
             and o["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": "sandbox-broker"}}  # fmt: skip
    for policy in config()["policies"]:
        assert policy["namespace"] in bound, policy["name"]
        for pool in policy["warm_pools"]:
            found = pools[(policy["namespace"], pool)]
            assert (policy["namespace"], found["spec"]["sandboxTemplateRef"]["name"]) in templates


def test_tokenreview_is_granted_only_by_its_component() -> None:
    def grants_tokenreview(objects: list[dict[str, Any]]) -> bool:
        return any(
            "tokenreviews" in rule.get("resources", [])
            for o in objects if o["kind"] in ("Role", "ClusterRole")
            for rule in o["rules"]
        )  # fmt: skip

    assert not grants_tokenreview(BASE)
    assert grants_tokenreview(render(BROKER, [COMPONENTS / "tokenreview"]))
    assert all(i["verification"] == "jwks" for i in config()["issuers"])


# ------------------------------------------------------------------------------ network


def rule_ports(rule: dict[str, Any]) -> set[tuple[str, int]]:
    return {(p["protocol"], p["port"]) for p in rule["ports"]}


def test_the_network_policy_admits_clients_and_reaches_router_dns_and_api() -> None:
    policy = find(BASE, "NetworkPolicy", "sandbox-broker")["spec"]
    assert policy["podSelector"]["matchLabels"] == deployment()["spec"]["selector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    ingress, scrape = policy["ingress"]
    listen = int(config()["server"]["listen"].rpartition(":")[2])
    assert rule_ports(ingress) == {("TCP", listen)}
    metrics = int(config()["metrics"]["listen"].rpartition(":")[2])
    assert rule_ports(scrape) == {("TCP", metrics)}
    assert scrape["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    [clients] = ingress["from"]
    [expression] = clients["namespaceSelector"]["matchExpressions"]
    assert {p["namespace"] for p in config()["policies"]} <= set(expression["values"])
    dns, router, api = policy["egress"]
    assert rule_ports(dns) == {("UDP", 53), ("TCP", 53)}
    url = urllib.parse.urlsplit(config()["backend"]["kubernetes"]["router_url"])
    namespace = (url.hostname or "").split(".")[1]
    [to_router] = router["to"]
    assert to_router["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": namespace
    }
    assert to_router["podSelector"]["matchLabels"] == {"app": "sandbox-router"}
    assert rule_ports(router) == {("TCP", url.port)}
    assert rule_ports(api) == {("TCP", 443), ("TCP", 6443)}


def test_the_broker_is_observable_as_deployed() -> None:
    """The ConfigMap turns on the JSON logs, the audit log and the metrics listener (operate.md);
    the container declares the metrics port, which the broker's Service does not expose."""
    assert config()["logging"] == {"format": "json"}
    assert config()["audit"] == {"destination": "stdout"}
    metrics = int(config()["metrics"]["listen"].rpartition(":")[2])
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports["metrics"] == metrics
    assert ports["https"] != metrics
    service = find(BASE, "Service", "sandbox-broker")["spec"]
    assert metrics not in {p.get("targetPort") for p in service["ports"]}
    assert "metrics" not in {p.get("targetPort") for p in service["ports"]}


def test_the_pod_data_plane_component_opens_the_runtime_port_both_ways() -> None:
    added = render(BROKER, [COMPONENTS / "pod-data-plane"])[len(BASE) :]
    port = config()["backend"]["kubernetes"]["runtime_port"]
    ingress = find(added, "NetworkPolicy", "sandbox-broker-to-sandboxes")
    egress = find(added, "NetworkPolicy", "sandbox-broker-pod-data-plane")
    assert ingress["metadata"]["namespace"] in {p["namespace"] for p in config()["policies"]}
    assert rule_ports(ingress["spec"]["ingress"][0]) == {("TCP", port)}
    assert rule_ports(egress["spec"]["egress"][0]) == {("TCP", port)}
    [source] = ingress["spec"]["ingress"][0]["from"]
    assert source["podSelector"]["matchLabels"] == (deployment()["spec"]["selector"]["matchLabels"])


# ------------------------------------------------------------------------------ examples


def template(name: str) -> dict[str, Any]:
    return find(EXAMPLE_OBJECTS, "SandboxTemplate", name)


def test_our_runtimes_template_matches_its_image() -> None:
    """Port, base directory and workspace as deploy/runtime/Containerfile starts the
    runtime; probes on GET /; non-root; no credential mounted; a read-only root with a
    size-limited emptyDir at every place the runtime and its commands write (/workspace, the
    base directory /app, /tmp and HOME): nothing grows the node's container layer."""
    image = Containerfile(RUNTIME_CONTAINERFILE)
    spec = template("awx-runtime")["spec"]["podTemplate"]["spec"]
    [runtime] = spec["containers"]
    assert runtime["args"] == image.exec_form("CMD")
    port = int(runtime["args"][runtime["args"].index("--port") + 1])
    assert port == config()["backend"]["kubernetes"]["runtime_port"] == 8888
    assert [p["containerPort"] for p in runtime["ports"]] == [port]
    for probe in ("readinessProbe", "livenessProbe"):
        assert runtime[probe]["httpGet"] == {"path": "/", "port": port}
    env = {e["name"]: e["value"] for e in runtime["env"]}
    assert env == {"SANDBOX_WORKSPACE_DIR": image.env()["SANDBOX_WORKSPACE_DIR"]}
    assert runtime["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]] for m in runtime["volumeMounts"]}
    base_dir = runtime["args"][runtime["args"].index("--base-dir") + 1]
    writable = {env["SANDBOX_WORKSPACE_DIR"], base_dir, "/tmp", image.env()["HOME"]}
    assert set(mounted) == writable == {"/workspace", "/app", "/tmp", "/home/sandbox"}
    for path, volume in mounted.items():
        assert volume["emptyDir"]["sizeLimit"], f"{path}: an emptyDir with a sizeLimit"
    assert spec["automountServiceAccountToken"] is False
    uid = int(image.last("USER").partition(":")[0])
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == uid != 0
    assert runtime["securityContext"]["allowPrivilegeEscalation"] is False


def test_upstreams_template_is_shaped_like_upstreams_example() -> None:
    spec = template("python-runtime")["spec"]["podTemplate"]["spec"]
    [runtime] = spec["containers"]
    assert "python-runtime-sandbox" in runtime["image"]
    assert runtime["ports"] == [{"containerPort": 8888, "protocol": "TCP"}]
    assert runtime["readinessProbe"]["httpGet"] == {"path": "/", "port": 8888}
    assert spec["automountServiceAccountToken"] is False


def test_the_example_client_calls_the_broker_as_a_policy_admits() -> None:
    """Its token's audience is the broker's URL, at the SDK's default projected path; its
    identity matches a policy's subject; its template is a warm pool that policy allows; its
    CA bundle is mounted; the API server's token is not mounted."""
    job = find(CLIENT_OBJECTS, "Job", "sandbox-hello")
    spec = job["spec"]["template"]["spec"]
    [client] = spec["containers"]
    env = {e["name"]: e["value"] for e in client["env"]}
    settings = config()
    assert env["AGENT_SANDBOX_BROKER_URL"] == settings["server"]["public_url"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in client["volumeMounts"]}
    [source] = mounts["/var/run/secrets/tokens"]["projected"]["sources"]
    token = source["serviceAccountToken"]
    assert token["audience"] in settings["issuers"][0]["audiences"]
    assert token["path"] == "agent-sandbox-token"  # docs/credentials.md: kubernetes-projected
    ca = Path(env["AGENT_SANDBOX_CA_BUNDLE"])
    assert mounts[str(ca.parent)]["configMap"]["name"] == "sandbox-broker-ca"
    assert spec["automountServiceAccountToken"] is False
    subject = f"system:serviceaccount:{job['metadata']['namespace']}:{spec['serviceAccountName']}"
    [policy] = [p for p in settings["policies"] if fnmatch.fnmatchcase(subject, p["subject"])]
    assert env["AGENT_SANDBOX_TEMPLATE"] in policy["warm_pools"]
    find(CLIENT_OBJECTS, "ServiceAccount", spec["serviceAccountName"])
