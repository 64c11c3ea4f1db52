"""The two images, built by CI (.ci/images) and run as real containers (runc, tests/_support/
_oci.py) as the manifests run them (issue 28, items 5, 6 and 7b).

- The runtime image under the example template's pod spec (deploy/examples/awx-runtime.yaml,
  read, not copied), with a read-only root, under an arbitrary uid whose group is 0 (as
  OpenShift runs pods): a sandbox writes to its emptyDirs (/app, /workspace, /tmp, HOME) and
  nowhere else; without the emptyDir at /app, a write there is a 403 that names the read-only
  file system, not a 500; with a writable root and no volumes, the image's own folders are
  writable by any uid of group 0; its default command listens on IPv4 and IPv6.
- What the images install is exactly deploy/image-constraints.txt's versions, nothing unpinned.
- The broker image as deploy/broker/deployment.yaml runs it (its volumes, securityContext and a
  read-only root): the ConfigMap's broker.toml and the Secrets as mounted files, the pod's
  ServiceAccount as a kubelet mounts it (``connection = "in-cluster"``), serving an SDK's
  sandbox whose pod is a container of the runtime image.

Each pod shares the host's network namespace here and binds an address of its own
(``127.0.0.N``), except the dual-stack test, whose container has a network namespace of its own.
"""

from __future__ import annotations

import contextlib
import copy
import re
import shutil
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

from tests._support import _oci, _pod_containers
from tests._support.broker_server import Pki
from tests._support.controller import StandInController
from tests._support.deploy import BROKER, REPO_ROOT, find, render
from tests._support.kube import KubeAPIServer, free_ports
from tests._support.kube_broker import BrokerIdentity

ANY_UID: Final = 1000650000
"""An arbitrary uid with no passwd entry in the image (OpenShift's range)."""


def image(name: str) -> _oci.Image:
    try:
        return _oci.find_image(name)
    except _oci.ImagesMissing as exc:
        if _oci.images_required():
            pytest.fail(f"{_oci.ENV_REQUIRE} is set, and {exc}", pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def runtime_image() -> _oci.Image:
    return image("runtime")


@pytest.fixture(scope="module")
def broker_image() -> _oci.Image:
    return image("broker")


def free_address() -> str:
    """A loopback address of its own with port 8888 free (like a pod IP)."""
    from tests._support._kubelet import _Addresses

    return _Addresses(8888).take()


def as_any_uid(spec: dict[str, Any]) -> dict[str, Any]:
    """The pod spec under an arbitrary uid with group 0 (and an fsGroup of its range)."""
    spec = copy.deepcopy(spec)
    spec["securityContext"].update(runAsUser=ANY_UID, runAsGroup=0, fsGroup=ANY_UID)
    return spec


@contextlib.contextmanager
def runtime_pod(
    img: _oci.Image, spec: dict[str, Any], folder: Path
) -> Iterator[tuple[httpx.Client, _oci.Container]]:
    """The pod's runtime container, started as the stand-in kubelet starts it, until it
    answers ``GET /``; stopped at the end."""
    [container] = spec["containers"]
    address = free_address()
    started = _pod_containers.start(img, spec, container, folder, name="pod", ip=address)
    try:
        with httpx.Client(base_url=f"http://{address}:8888", timeout=30) as client:
            wait_until_serving(client, started)
            yield client, started
    finally:
        started.stop()


def wait_until_serving(client: httpx.Client, container: _oci.Container) -> None:
    deadline = time.monotonic() + 30
    while True:
        assert container.poll() is None, f"the container exited: {container.log.read_text()}"
        with contextlib.suppress(httpx.TransportError):
            if client.get("/").status_code == 200:
                return
        assert time.monotonic() < deadline, f"no answer: {container.log.read_text()}"
        time.sleep(0.02)


def run(client: httpx.Client, script: str) -> tuple[str, str, int]:
    """stdout, stderr and exit code of ``sh -c script`` through the runtime."""
    done = client.post("/execute", json={"command": f"sh -c '{script}'"})
    assert done.status_code == 200, done.text
    body = done.json()
    return body["stdout"], body["stderr"], body["exit_code"]


def write(client: httpx.Client, path: str, data: bytes = b"x") -> httpx.Response:
    return client.post("/fs/write", data={"path": path}, files={"file": ("f", data)})


# ------------------------------------------------------------------------------ runtime


def test_the_runtime_image_runs_the_example_pod_under_any_uid_of_group_0(
    runtime_image: _oci.Image, tmp_path: Path
) -> None:
    """The example template's pod (read-only root, its emptyDirs) under an arbitrary uid of
    group 0: commands write /app, /workspace, /tmp and HOME, and nothing of the image."""
    spec = as_any_uid(_pod_containers.example_pod_spec())
    with runtime_pod(runtime_image, spec, tmp_path) as (client, _):
        out, _, code = run(client, "id -u; id -g; echo $HOME; pwd")
        assert code == 0 and out.split() == [str(ANY_UID), "0", "/home/sandbox", "/app"]
        for place in ("/app", "/workspace", "/tmp", "$HOME"):
            out, err, code = run(client, f"echo hi > {place}/made && cat {place}/made")
            assert (code, out) == (0, "hi\n"), f"{place}: {err}"
        for place in ("/etc", "/opt/venv/bin", "/", "/usr/local"):
            _, err, code = run(client, f"echo hi > {place}/made")
            assert code != 0 and "Read-only file system" in err, place
        assert write(client, "/app/notes/a.txt").status_code == 200
        assert write(client, "/workspace/b.txt").status_code == 200
        out, _, _ = run(client, "stat -c %u /app/notes/a.txt")
        assert out.strip() == str(ANY_UID)


def test_without_an_emptydir_at_app_a_write_there_is_refused_with_a_4xx(
    runtime_image: _oci.Image, tmp_path: Path
) -> None:
    """Read-only root, no volume at /app: a write is 403 naming the read-only file system
    (it was 500 io_error), on the file API and the legacy upload alike."""
    spec = _pod_containers.example_pod_spec()
    [container] = spec["containers"]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != "/app"]
    with runtime_pod(runtime_image, spec, tmp_path) as (client, _):
        refused = write(client, "/app/a.txt")
        assert refused.status_code == 403, refused.text
        assert refused.json()["code"] == "permission_denied"
        assert "read-only file system" in refused.text and "emptyDir" in refused.text
        legacy = client.post("/upload", files={"file": ("a.txt", b"x")})
        assert legacy.status_code == 403 and "read-only file system" in legacy.text
        assert write(client, "/workspace/a.txt").status_code == 200


def test_a_writable_root_without_volumes_works_under_any_uid_of_group_0(
    runtime_image: _oci.Image, tmp_path: Path
) -> None:
    """``podman run``-like: writable root, no volumes at all, an arbitrary uid of group 0.
    The image's /app, /workspace and HOME are group 0 and group-writable."""
    spec = as_any_uid(_pod_containers.example_pod_spec())
    [container] = spec["containers"]
    container["securityContext"]["readOnlyRootFilesystem"] = False
    container.pop("volumeMounts")
    spec.pop("volumes")
    with runtime_pod(runtime_image, spec, tmp_path) as (client, _):
        for path in ("/app/a.txt", "/workspace/a.txt"):
            answer = write(client, path)
            assert answer.status_code == 200, f"{path}: {answer.text}"
        _, err, code = run(client, "echo hi > $HOME/a.txt && mkdir -p /tmp/x /app/y")
        assert code == 0, err
        out, _, _ = run(client, "stat -c %a:%g /app /workspace $HOME")
        assert out.split() == ["775:0"] * 3


def test_the_runtime_images_default_command_listens_on_ipv4_and_ipv6(
    runtime_image: _oci.Image, tmp_path: Path
) -> None:
    """The image's ENTRYPOINT and CMD as they are (``--host ::``, port 8888), in a network
    namespace of its own: it answers on 127.0.0.1 and on ::1."""
    spec = _pod_containers.example_pod_spec()
    [container] = spec["containers"]
    container.pop("args")  # the image's own CMD
    started = _oci.pod_container(
        runtime_image, spec, container, _oci.PodFiles(tmp_path), hostname="dual"
    )
    started.network_namespace = True
    probe = (
        "import sys, urllib.request\n"
        "for url in sys.argv[1:]:\n"
        "    print(url, urllib.request.urlopen(url, timeout=5).status)\n"
    )
    urls = ["http://127.0.0.1:8888/", "http://[::1]:8888/"]
    with started:
        deadline = time.monotonic() + 30
        while True:
            done = started.exec(["python", "-c", probe, *urls])
            if done.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert done.returncode == 0, done.stderr + started.log.read_text()
    assert done.stdout.split() == [urls[0], "200", urls[1], "200"]


# ------------------------------------------------------------------------------ pins


def installed(img: _oci.Image) -> dict[str, str]:
    """The distributions in the image's virtual environment: normalised name -> version."""
    found = {}
    for info in img.site_packages().glob("*.dist-info"):
        name, version = info.name[: -len(".dist-info")].rsplit("-", 1)
        found[re.sub(r"[-_.]+", "-", name).lower()] = version
    return found


def pins() -> dict[str, str]:
    text = (REPO_ROOT / "deploy" / "image-constraints.txt").read_text()
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return dict(line.split("==") for line in lines if line)


TOOLS: Final = {"pip", "setuptools", "k8s-agent-sandbox-awx"}
"""The venv's installer (from the base's python) and our own wheel: not from the index."""


@pytest.mark.parametrize("name", ["runtime", "broker"])
def test_the_images_hold_exactly_the_pinned_versions(name: str) -> None:
    held = {k: v for k, v in installed(image(name)).items() if k not in TOOLS}
    pinned = pins()
    unpinned = sorted(set(held) - set(pinned))
    assert not unpinned, f"the {name} image holds unpinned {unpinned}: pin them"
    assert {k: pinned[k] for k in held} == held
    if name == "runtime":  # nothing but the runtime's one dependency
        assert set(held) == {"python-multipart"}


def test_every_pin_is_installed_in_an_image() -> None:
    held = set(installed(image("runtime"))) | set(installed(image("broker")))
    assert not set(pins()) - held, "a pin for nothing: remove it"


# ------------------------------------------------------------------------------ the broker


def broker_toml(kube: KubeAPIServer, namespace: str, port: int, metrics: int) -> str:
    """deploy/broker/configmap.yaml's broker.toml, changed only where this machine differs:
    the listen addresses (loopback, free ports), its URL, the cluster's issuer and JWKS URL
    (the test's API server), the policy's namespace and warm pool, and the pod data plane
    (no router here) with the stand-in's loopback pod IPs allowed."""
    text = find(render(BROKER), "ConfigMap", "sandbox-broker-config")["data"]["broker.toml"]
    url = f"https://127.0.0.1:{port}"
    changes = {
        r'listen = "\[::\]:8443"': f'listen = "127.0.0.1:{port}"',
        r'listen = "\[::\]:9090"': f'listen = "127.0.0.1:{metrics}"',
        r"https://sandbox-broker\.agent-sandbox-broker\.svc": url,
        r"https://kubernetes\.default\.svc\.cluster\.local": kube.issuer,
        r"https://kubernetes\.default\.svc/openid": f"{kube.url}/openid",
        r"team-a": namespace,
        r"warm_pools = \[[^]]*\]": 'warm_pools = ["awx-runtime-warmpool"]',
        r'data_plane = "router"': 'data_plane = "pod"\nallow_loopback_pod_ips = true',
        r"router_url = .*\n": "",
        r"router_token_file = .*\n": "",
    }
    for pattern, replacement in changes.items():
        text, count = re.subn(pattern, replacement, text)
        assert count, f"the ConfigMap's broker.toml has no {pattern!r} any more"
    return text


def broker_files(
    tmp_path: Path, kube: KubeAPIServer, identity: BrokerIdentity, pki: Pki, toml: str
) -> dict[str, Path]:
    """The deployment's volumes as a kubelet fills them, by volume name."""
    folders = {n: tmp_path / n for n in ("config", "tls", "router-token", "jwks-reader", "sa")}
    for folder in folders.values():
        folder.mkdir(parents=True)
    (folders["config"] / "broker.toml").write_text(toml)
    (folders["tls"] / "tls.crt").write_bytes(pki.cert_file.read_bytes())
    (folders["tls"] / "tls.key").write_bytes(pki.key_file.read_bytes())
    (folders["router-token"] / "token").write_text("unused: no router here\n")
    (folders["jwks-reader"] / "token").write_text(identity.token_file.read_text())
    (folders["sa"] / "token").write_text(identity.token_file.read_text())
    (folders["sa"] / "ca.crt").write_bytes(kube.ca_file.read_bytes())
    (folders["sa"] / "namespace").write_text(identity.namespace)
    for path in (p for folder in folders.values() for p in folder.iterdir()):
        path.chmod(0o644)  # a Secret volume's default mode (0644), readable by the broker's uid
    return folders


SA_DIR: Final = "/var/run/secrets/kubernetes.io/serviceaccount"


def broker_pod(kube: KubeAPIServer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The deployment's pod spec, plus the ServiceAccount volume a kubelet mounts and the
    service variables it sets."""
    spec = copy.deepcopy(
        find(render(BROKER), "Deployment", "sandbox-broker")["spec"]["template"]["spec"]
    )
    [container] = spec["containers"]
    container["volumeMounts"].append({"name": "sa", "mountPath": SA_DIR, "readOnly": True})
    spec["volumes"].append({"name": "sa", "projected": {"sources": []}})
    container["env"] = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(kube.port)},
    ]
    return spec, container


def test_the_broker_image_serves_a_sandbox_from_its_mounted_configuration(
    broker_image: _oci.Image,
    runtime_image: _oci.Image,
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    identity: BrokerIdentity,
    broker_pki: Pki,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker image, run as deployment.yaml runs it (uid 10001, read-only root, its
    ConfigMap and Secrets mounted as files), serves an SDK's sandbox: create through the
    API server, a command and a file in the sandbox's pod, a container of the runtime
    image under the example template; delete."""
    from k8s_agent_sandbox_awx import Sandbox, clear_credential_cache

    controller.kubelet.images.update(_pod_containers.runtime_registry())
    controller.create_template(
        namespace, "awx-runtime", pod_spec=_pod_containers.example_pod_spec()
    )
    controller.create_warm_pool(namespace, "awx-runtime-warmpool", "awx-runtime", replicas=0)
    port, metrics = free_ports(2)
    toml = broker_toml(kube, namespace, port, metrics)
    files = broker_files(tmp_path / "volumes", kube, identity, broker_pki, toml)
    spec, container = broker_pod(kube)
    pod_files = _oci.PodFiles(tmp_path / "pod", files)
    started = _oci.pod_container(broker_image, spec, container, pod_files, hostname="broker")
    url = f"https://127.0.0.1:{port}"
    token = tmp_path / "agent-token"
    with contextlib.suppress(Exception):
        kube.create_service_account(namespace, "agent")
    token.write_text(kube.token_request(namespace, "agent", [url]))
    environ = {
        "AGENT_SANDBOX_BROKER_URL": url,
        "AGENT_SANDBOX_CA_BUNDLE": str(broker_pki.cert_file.parent / "ca.pem"),
        "AGENT_SANDBOX_TOKEN_FILE": str(token),
    }
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    clear_credential_cache()
    with started:
        assert (started.uid, started.read_only_root) == (10001, True)
        wait_for_broker(url, broker_pki, started)
        with Sandbox.create("awx-runtime-warmpool", environ=environ) as sandbox:
            result = sandbox.commands.run("id -u; echo made > /workspace/out.txt; pwd")
            assert result.stdout.split() == ["1000", "/app"]
            assert sandbox.files.read("/workspace/out.txt") == b"made\n"
        logs = started.log.read_text()
    assert '"log": "access"' in logs or '"log":"access"' in logs, logs[-2000:]


def wait_for_broker(url: str, pki: Pki, container: _oci.Container) -> None:
    deadline = time.monotonic() + 60
    ca = ssl.create_default_context(cafile=str(pki.cert_file.parent / "ca.pem"))
    while True:
        assert container.poll() is None, f"the broker exited: {container.log.read_text()}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/readyz", verify=ca, timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"not ready: {container.log.read_text()[-3000:]}"
        time.sleep(0.1)


def test_a_commands_pid_is_found_in_its_pods_pid_namespace(
    runtime_image: _oci.Image, tmp_path: Path
) -> None:
    """The client suite's ``process_gone`` on container pods (``alive_in``) sees a command's
    pid while it runs and not once it is killed: its check can fail."""
    spec = _pod_containers.example_pod_spec()
    with runtime_pod(runtime_image, spec, tmp_path) as (client, container):
        started = client.post("/commands", json={"command": ["sleep", "60"]})
        assert started.status_code == 200, started.text
        command = client.get(f"/commands/{started.json()['command_id']}").json()
        pid = int(command["pid"])
        assert _pod_containers.alive_in([container], pid)
        assert not _pod_containers.alive_in([container], pid + 1000)
        run(client, f"kill -9 {pid}")
        deadline = time.monotonic() + 10
        while _pod_containers.alive_in([container], pid):
            assert time.monotonic() < deadline, "the killed sleep still runs"
            time.sleep(0.05)


def test_an_image_without_a_file_of_the_package_is_refused(tmp_path: Path) -> None:
    """What the images hold is this clone's package, file for file (``find_image`` refuses
    anything else): a file missing from the wheel, or an image older than the sources, fails
    the tests that run it instead of running something else."""
    site = tmp_path / "rootfs" / "opt" / "venv" / "lib" / "python3.11" / "site-packages"
    source = REPO_ROOT / "src" / "k8s_agent_sandbox_awx"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(source, site / "k8s_agent_sandbox_awx", ignore=ignore)
    fake = _oci.Image(tmp_path, {})
    assert _oci._compare_package(fake) == ([], [])
    (site / "k8s_agent_sandbox_awx" / "broker" / "openapi.json").unlink()
    with (site / "k8s_agent_sandbox_awx" / "broker" / "runtime" / "_server.py").open("a") as out:
        out.write("# changed\n")
    missing, stale = _oci._compare_package(fake)
    assert missing == ["broker/openapi.json"]
    assert stale == ["broker/runtime/_server.py"]
