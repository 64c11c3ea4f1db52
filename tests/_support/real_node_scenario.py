"""docs/broker/deploy.md, followed on a real node: run as
``python -m tests._support.real_node_scenario REPORT`` inside the namespaces that
``real_node.run_in_namespace`` makes (tests/kube/test_real_node.py does). It writes what it saw
to REPORT (JSON) and exits 0; a step that fails writes the error and the node's logs, exits 1.

The steps are the guide's own commands, with kubectl (``kubectl apply --server-side -k
deploy/broker`` and the rest): the namespaces, the broker's TLS Secret and the client's CA
ConfigMap, the router token, the broker (two replicas of the broker image, from the unmodified
manifests), the example warm pools (pods of the runtime image), ``/readyz`` through the
broker's Service, then the example client Job, whose log must be ``42``. Then a caller of the
scenario's own (a TokenRequest token of ``team-a/sandbox-user``) uses the SDK through the
Service against the pods the real kubelet runs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Final

import httpx

from k8s_agent_sandbox_awx.broker.backends.local._owned_dirs import (
    owned_temp_dir,
    sweep_dead_owners,
)
from tests._support._oci import find_image
from tests._support.controller import StandInController
from tests._support.deploy import REPO_ROOT
from tests._support.kube import KubeAPIServer, find_kube_tools
from tests._support.real_node import (
    NODE_IP,
    WORKDIR_PREFIX,
    Node,
    api_server_address,
    find_node_tools,
    prepare_namespace,
    sweep_leftovers,
)
from tests._support.stand_in_router import StandInRouter

BROKER_IMAGE: Final = "registry.example.com/agent-sandbox-awx/broker:0.0.0"
RUNTIME_IMAGE: Final = "registry.example.com/agent-sandbox-awx/runtime:0.0.0"
BROKER_NS: Final = "agent-sandbox-broker"
BROKER_URL: Final = f"https://sandbox-broker.{BROKER_NS}.svc"
ROUTER_NS: Final = "agent-sandbox-system"


class Kubectl:
    """kubectl with the admin's kubeconfig, from the repository's root (as the guide); where
    no kubectl is installed, ``_kubectl_in_python`` carries out the same commands (the
    subset this scenario uses) through the API, and the report says so."""

    def __init__(self, kube: KubeAPIServer, kubeconfig: Path, workdir: Path,
                 log: list[dict[str, Any]]) -> None:  # fmt: skip
        self.kube, self.kubeconfig, self.workdir, self.log = kube, kubeconfig, workdir, log
        # AGENT_SANDBOX_TEST_KUBECTL: another kubectl, or "" for the stand-in
        self.binary = os.environ.get("AGENT_SANDBOX_TEST_KUBECTL", shutil.which("kubectl") or "")

    def __call__(self, *args: str, timeout: float = 240) -> str:
        started = time.perf_counter()
        if not self.binary:
            rc, out, err = _kubectl_in_python(self.kube, list(args))
        else:
            argv = [self.binary, f"--kubeconfig={self.kubeconfig}",
                    f"--cache-dir={self.workdir / 'kube-cache'}", *args]  # fmt: skip
            done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=timeout, check=False)  # fmt: skip
            rc, out, err = done.returncode, done.stdout, done.stderr
        self.log.append({"command": "kubectl " + " ".join(args), "rc": rc,
                         "by": self.binary or "python", "stdout": out[-2000:],
                         "seconds": round(time.perf_counter() - started, 2),
                         "stderr": err[-2000:]})  # fmt: skip
        if rc != 0:
            raise RuntimeError(
                f"kubectl {' '.join(args)} failed ({rc}):\n{out[-2000:]}{err[-3000:]}"
            )
        return out


def _kubectl_in_python(kube: KubeAPIServer, args: list[str]) -> tuple[int, str, str]:
    """The commands of this scenario, as kubectl carries them out (no kubectl here)."""
    import yaml  # type: ignore[import-untyped]

    from tests._support.deploy import render

    namespace = args[args.index("-n") + 1] if "-n" in args else None
    words = [a for i, a in enumerate(args) if a != "-n" and (i == 0 or args[i - 1] != "-n")]
    flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)
    verb, *rest = [w for w in words if not w.startswith("-")]
    if verb == "kustomize":
        return 0, yaml.safe_dump_all(render(REPO_ROOT / rest[0])), ""
    if verb == "apply":
        source = args[args.index("-f") + 1] if "-f" in args else args[args.index("-k") + 1]
        path = Path(source) if Path(source).is_absolute() else REPO_ROOT / source
        objects = render(path) if "-k" in args else list(yaml.safe_load_all(path.read_text()))
        for obj in objects:
            _server_side_apply(kube, obj)
        return 0, "".join(f"{o['kind'].lower()}/{o['metadata']['name']} serverside-applied\n"
                          for o in objects), ""  # fmt: skip
    if verb == "create":
        return 0, _create(kube, namespace, rest, flags), ""
    if verb in ("rollout", "wait"):
        _wait_until(kube, namespace, verb, rest[-1], float(flags["timeout"].rstrip("s")))
        return 0, f"{rest[-1]} done\n", ""
    if verb == "logs":
        selector = args[args.index("-l") + 1] if "-l" in args else f"job-name={rest[0][4:]}"
        return 0, _logs(kube, namespace, selector, "--prefix" in args), ""
    return 1, "", f"this stand-in for kubectl knows no {args!r}"


def _server_side_apply(kube: KubeAPIServer, obj: dict[str, Any]) -> None:
    from tests._support.kube import path_of_obj

    kube.request("PATCH", path_of_obj(obj), params={"fieldManager": "kubectl"},
                 content=json.dumps(obj),
                 headers={"Content-Type": "application/apply-patch+yaml"})  # fmt: skip


def _create(kube: KubeAPIServer, namespace: str | None, rest: list[str],
            flags: dict[str, str]) -> str:  # fmt: skip
    import base64

    def b64(path: str) -> str:
        return base64.b64encode(Path(path).read_bytes()).decode()

    kind, *names = rest
    meta = {"name": names[-1]}
    if kind == "namespace":
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": meta})
        return f"namespace/{names[-1]} created\n"
    key, _, source = flags.get("from-file", "=").partition("=")
    if kind == "configmap":
        body = {"kind": "ConfigMap", "data": {key: Path(source).read_text()}}
    elif names[0] == "tls":
        body = {"kind": "Secret", "type": "kubernetes.io/tls",
                "data": {"tls.crt": b64(flags["cert"]), "tls.key": b64(flags["key"])}}  # fmt: skip
    else:
        body = {"kind": "Secret", "type": "Opaque", "data": {key: b64(source)}}
    kube.create({"apiVersion": "v1", "metadata": meta, **body}, namespace)
    return f"{kind}/{names[-1]} created\n"


def _wait_until(kube: KubeAPIServer, namespace: str | None, verb: str, target: str,
                timeout: float) -> None:  # fmt: skip
    kind, _, name = target.partition("/")
    group = "apps" if kind == "deployment" else "batch"
    url = f"/apis/{group}/v1/namespaces/{namespace}/{kind}s/{name}"

    def done() -> bool:
        obj = kube.get(url)
        status, spec = obj.get("status") or {}, obj.get("spec") or {}
        if verb == "rollout":
            want = spec.get("replicas", 1)
            return bool(status.get("observedGeneration", 0) >= obj["metadata"]["generation"]
                        and status.get("updatedReplicas") == want
                        and status.get("availableReplicas") == want)  # fmt: skip
        return any(c.get("type") == "Complete" and c.get("status") == "True"
                   for c in status.get("conditions") or [])  # fmt: skip

    kube.wait_for(done, what=f"{verb} {target}", timeout=timeout)


def _logs(kube: KubeAPIServer, namespace: str | None, selector: str, prefix: bool) -> str:
    pods = kube.admin.get(f"/api/v1/namespaces/{namespace}/pods",
                          params={"labelSelector": selector}).json()["items"]  # fmt: skip
    out = []
    for pod in pods:
        name = pod["metadata"]["name"]
        for container in pod["spec"]["containers"]:
            text = kube.admin.get(f"/api/v1/namespaces/{namespace}/pods/{name}/log",
                                  params={"container": container["name"]}).text  # fmt: skip
            tag = f"[pod/{name}/{container['name']}] " if prefix else ""
            out += [tag + line + "\n" for line in text.splitlines()]
    return "".join(out)


def _secrets(kubectl: Kubectl, workdir: Path, router_token: Path) -> Path:
    """Steps 3 and 4: the broker's certificate and the client's CA, the router token (the
    router's own, ``router_token``). Returns the CA file."""
    import trustme

    authority = trustme.CA()
    cert = authority.issue_cert(f"sandbox-broker.{BROKER_NS}.svc",
                                f"sandbox-broker.{BROKER_NS}.svc.cluster.local")  # fmt: skip
    tls_crt, tls_key, ca_crt = workdir / "tls.crt", workdir / "tls.key", workdir / "ca.crt"
    cert.cert_chain_pems[0].write_to_path(str(tls_crt))
    cert.private_key_pem.write_to_path(str(tls_key))
    authority.cert_pem.write_to_path(str(ca_crt))
    kubectl("-n", BROKER_NS, "create", "secret", "tls", "sandbox-broker-tls",
            f"--cert={tls_crt}", f"--key={tls_key}")  # fmt: skip
    kubectl("-n", "team-a", "create", "configmap", "sandbox-broker-ca",
            f"--from-file=ca.crt={ca_crt}")  # fmt: skip
    kubectl("-n", BROKER_NS, "create", "secret", "generic", "sandbox-broker-router-token",
            f"--from-file=token={router_token}")  # fmt: skip
    return ca_crt


def _router_service(kube: KubeAPIServer, router: StandInRouter) -> None:
    """Upstream's router as the broker's ConfigMap expects it (``sandbox-router-svc`` in
    ``agent-sandbox-system``, port 8080): a Service whose endpoint is the stand-in router
    beside the node."""
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ROUTER_NS}})
    kube.create({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "sandbox-router-svc"},
        "spec": {"ports": [{"name": "http", "port": 8080, "targetPort": router.port}]},
    }, ROUTER_NS)  # fmt: skip
    kube.create({
        "apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "sandbox-router-svc"},
        "subsets": [{"addresses": [{"ip": NODE_IP}],
                     "ports": [{"name": "http", "port": router.port}]}],
    }, ROUTER_NS)  # fmt: skip


def _pods(kube: KubeAPIServer) -> list[dict[str, Any]]:
    found = []
    for pod in kube.get("/api/v1/pods").get("items") or []:
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        found.append({
            "namespace": pod["metadata"]["namespace"], "name": pod["metadata"]["name"],
            "node": spec.get("nodeName"), "phase": status.get("phase"),
            "ip": status.get("podIP"),
            "images": [c.get("image") for c in spec.get("containers") or []],
            "ready": any(c.get("type") == "Ready" and c.get("status") == "True"
                         for c in status.get("conditions") or []),
        })  # fmt: skip
    return found


def _apply_broker(kubectl: Kubectl, workdir: Path) -> None:
    """``kubectl apply --server-side -k deploy/broker``, on 1.20: the kustomization rendered
    by kubectl, its PodDisruptionBudget as policy/v1beta1 (policy/v1 is served from 1.21; the
    same fields for what it uses), applied by kubectl."""
    import yaml  # type: ignore[import-untyped]

    objects = list(yaml.safe_load_all(kubectl("kustomize", "deploy/broker")))
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) == ("policy/v1", "PodDisruptionBudget"):
            obj["apiVersion"] = "policy/v1beta1"
    rendered = workdir / "broker.yaml"
    rendered.write_text(yaml.safe_dump_all(objects))
    kubectl("apply", "--server-side", "-f", str(rendered))


def _deploy(kubectl: Kubectl, kube: KubeAPIServer, workdir: Path, router_token: Path,
            report: dict[str, Any]) -> Path:  # fmt: skip
    """The guide's steps 2 to 7; the CA file the clients trust."""
    kubectl("apply", "--server-side", "-f", "deploy/broker/namespace.yaml")
    kubectl("create", "namespace", "team-a")
    ca_crt = _secrets(kubectl, workdir, router_token)
    _apply_broker(kubectl, workdir)
    kubectl("-n", BROKER_NS, "rollout", "status", "deployment/sandbox-broker", "--timeout=240s")
    kubectl("apply", "--server-side", "-k", "deploy/examples")
    started = time.perf_counter()
    while time.perf_counter() - started < 180:  # the awx warm pool's two pods Ready
        pool = kube.get("/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/team-a/"
                        "sandboxwarmpools/awx-runtime-warmpool")  # fmt: skip
        if (pool.get("status") or {}).get("readyReplicas") == 2:
            break
        time.sleep(0.5)
    else:
        raise RuntimeError(f"the awx warm pool is not ready after 180 s: {pool.get('status')}")
    report["warm_pool_seconds"] = round(time.perf_counter() - started, 2)
    readyz = httpx.get(f"{BROKER_URL}/readyz", verify=str(ca_crt), timeout=10)
    report["readyz"] = {"status": readyz.status_code, "body": readyz.text[:500]}
    return ca_crt


def _client_job(kubectl: Kubectl, report: dict[str, Any]) -> None:
    """Step 8: the example client Job, then its log."""
    kubectl("apply", "--server-side", "-k", "deploy/examples/client")
    kubectl("-n", "team-a", "wait", "--for=condition=complete", "job/sandbox-hello",
            "--timeout=180s", timeout=200)  # fmt: skip
    report["job_log"] = kubectl("-n", "team-a", "logs", "job/sandbox-hello")


def _sdk_session(kube: KubeAPIServer, ca_crt: Path, workdir: Path, report: dict[str, Any]) -> None:
    """A caller of the scenario's own, with the SDK, through the broker's Service."""
    from k8s_agent_sandbox_awx import KubernetesAuth, Sandbox

    token = kube.token_request("team-a", "sandbox-user", BROKER_URL)
    token_file = workdir / "caller-token"
    token_file.write_text(token)
    os.environ.update(AGENT_SANDBOX_BROKER_URL=BROKER_URL, AGENT_SANDBOX_CA_BUNDLE=str(ca_crt),
                      AGENT_SANDBOX_TEMPLATE="awx-runtime-warmpool")  # fmt: skip
    seen: dict[str, Any] = {}
    with Sandbox.create(auth=KubernetesAuth(str(token_file))) as sandbox:
        seen["claim"] = sandbox.sandbox_id
        result = sandbox.commands.run("id -u; id -g; pwd; echo $HOME")
        seen["identity"] = result.stdout.split()
        denied = sandbox.commands.run("touch /etc/awx-probe 2>&1; echo rc=$?")
        seen["write_outside"] = denied.stdout.strip()
        sandbox.files.write("/workspace/hello.txt", b"from the real node\n")
        seen["file"] = sandbox.files.read("/workspace/hello.txt")
    report["sdk"] = {k: v.decode() if isinstance(v, bytes) else v for k, v in seen.items()}


def _afterwards(kubectl: Kubectl, kube: KubeAPIServer, report: dict[str, Any],
                secret_values: list[str]) -> None:  # fmt: skip
    """Nothing outlives its caller: no claim left, and the real garbage collector removed the
    claimed Sandboxes' pods; the brokers' logs name the caller and hold no token."""
    base = "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/team-a"
    started = time.perf_counter()
    while time.perf_counter() - started < 60:
        claims = kube.get(f"{base}/sandboxclaims").get("items") or []
        listed = kube.get("/apis/agents.x-k8s.io/v1beta1/namespaces/team-a/sandboxes")
        sandboxes = {s["metadata"]["name"] for s in listed.get("items") or []}
        orphans = [
            p["metadata"]["name"] for p in kube.get("/api/v1/namespaces/team-a/pods")["items"]
            for owner in p["metadata"].get("ownerReferences") or []
            if owner.get("kind") == "Sandbox" and owner["name"] not in sandboxes
        ]  # fmt: skip
        if not claims and not orphans:
            break
        time.sleep(0.5)
    report["left_claims"] = [c["metadata"]["name"] for c in claims]
    report["orphan_pods"] = orphans
    report["cleanup_seconds"] = round(time.perf_counter() - started, 2)
    logs = kubectl("-n", BROKER_NS, "logs", "-l", "app.kubernetes.io/name=sandbox-broker",
                   "--tail=-1", "--prefix")  # fmt: skip
    report["broker_log_lines"] = len(logs.splitlines())
    report["broker_logs_name_caller"] = "system:serviceaccount:team-a:sandbox-user" in logs
    report["broker_logs_hold_a_token"] = any(value in logs for value in secret_values)
    report["broker_pods_logging"] = sorted({line.split("]", 1)[0] for line in logs.splitlines()
                                            if line.startswith("[")})  # fmt: skip


def run(report: dict[str, Any]) -> None:
    report["swept"] = sweep_leftovers()  # a killed run's shims and containers
    sweep_dead_owners(WORKDIR_PREFIX)
    workdir = Path(owned_temp_dir(WORKDIR_PREFIX))
    report["workdir"] = str(workdir)  # the test removes it, once the namespaces are gone
    os.chmod(workdir, 0o755)
    prepare_namespace(workdir)
    kube_tools, node_tools = find_kube_tools(), find_node_tools()
    broker, runtime = find_image("broker"), find_image("runtime")
    address = api_server_address()
    with KubeAPIServer(kube_tools, workdir=workdir / "api", address=address) as kube:
        node = Node(kube, node_tools, workdir / "node")
        (workdir / "node").mkdir()
        report["node_logs"] = lambda: node.logs()
        with node:
            report["import_seconds"] = [
                round(node.import_image(broker.rootfs, dict(broker.config), BROKER_IMAGE), 2),
                round(node.import_image(runtime.rootfs, dict(runtime.config), RUNTIME_IMAGE), 2),
            ]
            kubectl = Kubectl(kube, node.admin_kubeconfig, workdir,
                              report.setdefault("kubectl", []))  # fmt: skip
            controller = StandInController(kube, real_node=True)
            token_dir = workdir / "router"
            token_dir.mkdir()
            with controller:
                token_file = token_dir / "token"
                token_file.write_text(secrets.token_urlsafe(32))  # ROUTER_AUTH_TOKEN
                with StandInRouter(controller, token_file, host=NODE_IP) as router:
                    _router_service(kube, router)
                    ca_crt = _deploy(kubectl, kube, workdir, token_file, report)
                    _client_job(kubectl, report)
                    _sdk_session(kube, ca_crt, workdir, report)
                    report["router_requests"] = len(router.seen)
                    secret_values = [token_file.read_text().strip(),
                                     (workdir / "caller-token").read_text().strip()]  # fmt: skip
                    _afterwards(kubectl, kube, report, secret_values)
                report["pods"] = _pods(kube)
                report["controller_errors"] = controller.errors
                # the stand-ins' state at the end (a refresh that failed once, under load,
                # was tried again: kept in *_errors for the report, not a failure)
                report["proxy_failing"], report["dns_failing"] = (
                    node.proxy.failing,
                    node.dns.failing,
                )
                report["proxy_errors"], report["dns_errors"] = node.proxy.errors, node.dns.errors


def main() -> int:
    out = Path(sys.argv[1])
    report: dict[str, Any] = {"started": time.time(), "pid": os.getpid()}
    code = 0
    try:
        run(report)
    except BaseException as exc:
        report["error"] = "".join(traceback.format_exception(exc))
        code = 1
    logs = report.pop("node_logs", None)
    if code and logs is not None:
        report["logs"] = logs()
    report["seconds"] = round(time.time() - report.pop("started"), 1)
    out.write_text(json.dumps(report, indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
