"""A real node for the Kubernetes tests: kubelet, containerd and runc, kube-scheduler and
kube-controller-manager on our kube-apiserver, all in a network namespace the test makes.

Why a namespace of its own (docs/broker/kubernetes.md, "A real node on CI machines"): pods
must be reachable from the node and reach the API server, which takes a pod network with a
gateway address on the node's side, a node address that is not loopback, and the API server
listening on that address; on these machines such addresses may exist only in a network
namespace the test made itself. ``python -m tests._support.real_node_scenario`` runs under
``unshare --net --mount --propagation private`` (``run_in_namespace``): traffic never leaves
that namespace, and every mount the node makes (tmpfs over ``/var/log``, ``/var/lib/cni``,
``/run/netns``, ``/run/containerd``; the containers' roots and volumes) ends with it.

In the namespace (``Node``):

- ``lo`` holds the node's address, ``NODE_IP``; the bridge ``cni0`` holds the pods' gateway.
  The API server listens there (``API_PORT``) with a certificate for the names pods use
  (``kubernetes.default.svc`` and the ``kubernetes`` Service's IP); its issuer is
  ``https://kubernetes.default.svc.cluster.local``, as deploy/broker's ConfigMap expects.
- containerd (Debian's) with its own root, state and socket, the CRI plugin's pod network from a
  CNI ``bridge`` + ``host-local`` conflist, and a pause image made from ``.ci/kube-tools``'s
  static ``pause``; images are imported from ``.ci/images``'s exports (``import_image``), under
  the names the manifests use, so ``imagePullPolicy: IfNotPresent`` pulls nothing.
- the kubelet (built from the same Debian source package as the API server) with a client
  certificate of ``system:node:<name>`` in ``system:nodes`` (bound to the ``system:node``
  ClusterRole: the API server has RBAC only, no Node authorizer), serving on ``NODE_IP`` so
  that ``kubectl logs`` works; kube-scheduler and kube-controller-manager (Deployments,
  ReplicaSets, Jobs, ServiceAccounts and their tokens, garbage collection, node lifecycle).
- two stand-ins for what Debian does not package: ``ServiceProxy`` plays kube-proxy's iptables
  mode (each Service's ClusterIP and port DNATed to its ready endpoints, chosen at random,
  masqueraded so that a pod reaching a Service served by a pod on the same bridge gets its
  answers), and ``ClusterDns`` plays CoreDNS's ``kubernetes`` plugin through dnsmasq
  (``<service>.<namespace>.svc.cluster.local`` to the ClusterIP, a headless Service's name to
  its ready pods' IPs); the node's processes and the pods resolve through it.

Nothing here replaces upstream agent-sandbox's controller or router: the scenario runs the
stand-ins of ``controller.py`` and ``stand_in_router.py`` beside the node (the controller's
own kubelet, scheduler and garbage collector off: the real ones do that work).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import ipaddress
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tests._support.kube import (
    KubeAPIServer,
    KubeToolsMissing,
    ServerAddress,
    _die_with_parent,
    _Process,
    _tail,
    cache_root,
)

NODE_NAME: Final = "node-1"
NODE_IP: Final = "10.123.0.1"
API_PORT: Final = 6443
POD_SUBNET: Final = "10.88.0.0/16"
POD_GATEWAY: Final = "10.88.0.1"
SERVICE_RANGE: Final = "10.96.0.0/24"
KUBERNETES_SERVICE_IP: Final = "10.96.0.1"
CLUSTER_DOMAIN: Final = "cluster.local"
ISSUER: Final = f"https://kubernetes.default.svc.{CLUSTER_DOMAIN}"
PAUSE_IMAGE: Final = "localhost/k8s-agent-sandbox-awx/pause:1"
ENV_NODE: Final = "AGENT_SANDBOX_TEST_KUBE_NODE"
_PRIVATE_MOUNTS: Final = ("/var/log", "/var/lib/cni", "/run/netns", "/run/containerd")
_CHAIN: Final = "AWX-SERVICES"
WORKDIR_PREFIX: Final = "k8s-awx-node-"  # the scenario's work folder (an owned temp dir)
_REJECT: Final = "AWX-SERVICES-REJECT"  # Services without endpoints (the filter table's)


# ------------------------------------------------------------------------------ the binaries


@dataclass(frozen=True)
class NodeTools:
    kubelet: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    pause: Path
    containerd: str
    ctr: str
    dnsmasq: str
    cni_bin_dir: Path


def find_node_tools() -> NodeTools:
    """The node's binaries: ``.ci/kube-tools`` builds kubelet, kube-controller-manager,
    kube-scheduler and pause into the folder it names as ``AGENT_SANDBOX_TEST_KUBE_NODE`` and
    installs containerd, runc, the CNI plugins and dnsmasq. ``KubeToolsMissing`` says what
    is missing."""
    folder = os.environ.get(ENV_NODE)
    if not folder:
        env_file = cache_root() / "kube-tools.env"
        values = dict(
            line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line
        ) if env_file.is_file() else {}  # fmt: skip
        folder = values.get(ENV_NODE, "")
    if not folder:
        raise KubeToolsMissing(f"{ENV_NODE} is not set and .ci/kube-tools named no node folder")
    root = Path(folder)
    found = {name: root / name for name in
             ("kubelet", "kube-controller-manager", "kube-scheduler", "pause")}  # fmt: skip
    commands = {name: shutil.which(name) for name in ("containerd", "ctr", "dnsmasq", "runc")}
    missing = [str(p) for p in found.values() if not os.access(p, os.X_OK)]
    missing += [name for name, where in commands.items() if where is None]
    cni = Path("/usr/lib/cni")
    if not (cni / "bridge").is_file():
        missing.append(str(cni / "bridge"))
    if missing:
        raise KubeToolsMissing(
            f"the node's parts are missing: {', '.join(missing)}: run `bash .ci/kube-tools` "
            "(as root; it installs and builds them)"
        )
    return NodeTools(
        kubelet=found["kubelet"],
        kube_controller_manager=found["kube-controller-manager"],
        kube_scheduler=found["kube-scheduler"],
        pause=found["pause"],
        containerd=str(commands["containerd"]),
        ctr=str(commands["ctr"]),
        dnsmasq=str(commands["dnsmasq"]),
        cni_bin_dir=cni,
    )


def run_in_namespace(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``argv`` in a new network and mount namespace (private propagation), killed with its
    parent; what it printed."""
    wrapped = ["unshare", "--net", "--mount", "--propagation", "private", "--fork",
               "--kill-child", "--", *argv]  # fmt: skip
    return subprocess.run(wrapped, capture_output=True, text=True, check=False,
                          preexec_fn=_die_with_parent, **kwargs)  # fmt: skip


def sweep_leftovers() -> list[int]:
    """What a killed scenario left running: containerd's shims of a node whose work folder's
    owner is gone (they outlive containerd on purpose), and every container process under
    containerd's cgroups (``k8s.io``) when no scenario lives. SIGKILLed; their pids."""
    import fcntl

    from k8s_agent_sandbox_awx.broker.backends.local._owned_dirs import OWNER_FILE

    def owner_lives(folder: Path) -> bool:
        try:
            fd = os.open(folder / OWNER_FILE, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    folders = list(Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"))
    if any(owner_lives(folder) for folder in folders):
        return []  # a scenario runs: its node is its own business
    shims = _shim_pids()
    victims = sorted(shims | _descendants(shims))  # a shim is its containers' subreaper
    cgroups = {c for pid in victims for c in _container_cgroups(pid)}
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, 9)
    deadline = time.monotonic() + 5
    for cgroup in sorted(cgroups, key=lambda c: len(c.parts), reverse=True):
        while cgroup.is_dir() and time.monotonic() < deadline:
            try:
                cgroup.rmdir()  # empty once its processes are reaped
            except OSError:
                time.sleep(0.05)
    return victims


def _descendants(roots: set[int]) -> set[int]:
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if proc.name.isdigit():
                stat = (proc / "stat").read_text()
                parents[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = set(roots)
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _container_cgroups(pid: int) -> list[Path]:
    """The cgroups (v1 hierarchies or v2) of ``pid`` under containerd's ``k8s.io``."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "/k8s.io/" not in path + "/":
                continue
            for controller in controllers.split(",") if controllers else [""]:
                base = Path("/sys/fs/cgroup") / controller.removeprefix("name=")
                found.append(base / path.lstrip("/"))
    return found


def _shim_pids() -> set[int]:
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(b"containerd-shim-runc-v2") and any(
                f"/{WORKDIR_PREFIX}".encode() in arg for arg in argv
            ):
                found.add(int(proc.name))
    return found


def _run(*argv: str, input: str | None = None) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, input=input, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


# ------------------------------------------------------------------------------ the network


def prepare_namespace(workdir: Path) -> None:
    """Inside the new namespaces: the private mounts, the node's address on ``lo``, the pods'
    bridge and gateway, forwarding, the route to the Services, the resolver for this
    process and its children (the cluster DNS, ``NODE_IP``)."""
    if os.geteuid() != 0:
        raise RuntimeError("the real node needs root")
    for target in _PRIVATE_MOUNTS:
        os.makedirs(target, exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", target)
    resolv = workdir / "resolv.conf"
    resolv.write_text(
        f"nameserver {NODE_IP}\nsearch svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\noptions ndots:5\n"
    )
    _run("mount", "--bind", str(resolv), "/etc/resolv.conf")
    _run("ip", "link", "set", "lo", "up")
    _run("ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo")
    _run("ip", "link", "add", "cni0", "type", "bridge")
    prefix = ipaddress.ip_network(POD_SUBNET).prefixlen
    _run("ip", "addr", "add", f"{POD_GATEWAY}/{prefix}", "dev", "cni0")
    _run("ip", "link", "set", "cni0", "up")
    _run("ip", "route", "add", SERVICE_RANGE, "dev", "cni0", "src", POD_GATEWAY)
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    rules = [
        "*nat", f":{_CHAIN} - [0:0]", f"-A PREROUTING -j {_CHAIN}", f"-A OUTPUT -j {_CHAIN}",
        "-A POSTROUTING -m conntrack --ctstate DNAT -j MASQUERADE", "COMMIT",
        "*filter", f":{_REJECT} - [0:0]", f"-A OUTPUT -j {_REJECT}", f"-A FORWARD -j {_REJECT}",
        "COMMIT", "",
    ]  # fmt: skip
    _run("iptables-restore", "--noflush", input="\n".join(rules))


def api_server_address() -> ServerAddress:
    names = (NODE_IP, KUBERNETES_SERVICE_IP, "127.0.0.1", "localhost", "kubernetes",
             "kubernetes.default", "kubernetes.default.svc",
             f"kubernetes.default.svc.{CLUSTER_DOMAIN}")  # fmt: skip
    return ServerAddress(
        bind="0.0.0.0", port=API_PORT, advertise=NODE_IP, names=names, issuer=ISSUER,
        endpoint_reconciler="lease", kubelet_client=True,
    )  # fmt: skip


# ------------------------------------------------------------------------------ images


def oci_archive(rootfs: Path, config: Mapping[str, Any], name: str, out: Path) -> Path:
    """An OCI image archive of one uncompressed layer (``rootfs`` as it is, numeric owners)
    and ``config`` (the image's Docker-style config: User, Env, Entrypoint, ...), named
    ``name`` for containerd's import."""
    layer = out.with_suffix(".layer")
    _run("tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(layer), ".")
    layer_digest = _sha256(layer)
    image_config = {
        "architecture": "amd64", "os": "linux", "config": dict(config),
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
    }  # fmt: skip
    config_blob = json.dumps(image_config).encode()
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": f"sha256:{hashlib.sha256(config_blob).hexdigest()}",
                   "size": len(config_blob)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": f"sha256:{layer_digest}", "size": layer.stat().st_size}],
    }  # fmt: skip
    manifest_blob = json.dumps(manifest).encode()
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": f"sha256:{hashlib.sha256(manifest_blob).hexdigest()}",
        "size": len(manifest_blob),
        "annotations": {"io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rpartition(":")[2]},
    }]}  # fmt: skip
    with tarfile.open(out, "w") as archive:
        _add_bytes(archive, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add_bytes(archive, "index.json", json.dumps(index).encode())
        for blob in (config_blob, manifest_blob):
            _add_bytes(archive, f"blobs/sha256/{hashlib.sha256(blob).hexdigest()}", blob)
        archive.add(str(layer), arcname=f"blobs/sha256/{layer_digest}")
    layer.unlink()
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    archive.addfile(info, io.BytesIO(data))


# ------------------------------------------------------------------------------ the node


class Node:
    """containerd, the kubelet, kube-scheduler and kube-controller-manager on ``kube`` (which
    must listen on ``api_server_address()``), in the namespace ``prepare_namespace`` made."""

    def __init__(self, kube: KubeAPIServer, tools: NodeTools, workdir: Path) -> None:
        self.kube, self.tools, self.workdir = kube, tools, workdir
        self.socket = workdir / "containerd" / "containerd.sock"
        self.processes: list[_Process] = []
        self.dns = ClusterDns(workdir / "dns", tools.dnsmasq)
        self.proxy = ServiceProxy()
        self.services = ServiceWatch(kube, self.proxy, self.dns)

    def __enter__(self) -> Node:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.dns.start()
        self.services.start()
        self._start_containerd()
        self.import_archive(self._pause_archive())
        self._grant_nodes()
        self._start("kube-controller-manager", self._controller_manager_argv())
        self._start("kube-scheduler", self._control_plane_argv(self.tools.kube_scheduler, 10259))
        self._start("kubelet", self._kubelet_argv())
        self.kube.wait_for(self._node_ready, what=f"node {NODE_NAME} Ready", timeout=90)

    def stop(self) -> None:
        """Every pod's containers removed (the kubelet first, then what it left), then the
        processes; the namespace's mounts end with the namespace."""
        for process in reversed(self.processes):
            if process.name == "kubelet":
                process.stop(grace=5)
        if self.socket.exists():
            with contextlib.suppress(Exception):
                self._remove_pods()
        for process in reversed(self.processes):
            process.stop(grace=5)
        self.services.stop()
        self.dns.stop()
        for parent in [*Path("/sys/fs/cgroup").glob("*/k8s.io"), Path("/sys/fs/cgroup/k8s.io")]:
            with contextlib.suppress(OSError):  # containerd's (v1 or v2); only if empty now
                parent.rmdir()

    def logs(self) -> str:
        parts = [f"--- {p.name} ({p.log}):\n{_log_tail(p.log, 40)}" for p in self.processes]
        return "\n".join([*parts, f"--- dnsmasq:\n{_tail(self.dns.log, 10)}"])

    # ---------------------------------------------------------------------- images

    def ctr(self, *args: str) -> str:
        return _run(self.tools.ctr, "--address", str(self.socket), "--namespace", "k8s.io", *args)

    def import_archive(self, archive: Path) -> None:
        self.ctr("images", "import", "--no-unpack", str(archive))
        archive.unlink()

    def import_image(self, rootfs: Path, config: Mapping[str, Any], name: str) -> float:
        """One of ``.ci/images``' exports, as ``name``; its seconds."""
        started = time.perf_counter()
        out = self.workdir / f"image-{hashlib.sha256(name.encode()).hexdigest()[:8]}.tar"
        self.import_archive(oci_archive(rootfs, config, name, out))
        return time.perf_counter() - started

    def _pause_archive(self) -> Path:
        folder = self.workdir / "pause-rootfs"
        folder.mkdir()
        shutil.copy2(self.tools.pause, folder / "pause")
        config = {"Entrypoint": ["/pause"], "User": "65535:65535"}
        return oci_archive(folder, config, PAUSE_IMAGE, self.workdir / "pause.tar")

    # ---------------------------------------------------------------------- processes

    def _start(self, name: str, argv: list[str]) -> _Process:
        process = _Process(name, argv, self.workdir / f"{name}.log")
        self.processes.append(process)
        return process

    def _start_containerd(self) -> None:
        root = self.workdir / "containerd"
        cni = self.workdir / "cni"
        cni.mkdir(parents=True)
        (cni / "10-pods.conflist").write_text(json.dumps(_cni_conflist(self.workdir / "ipam")))
        config = root / "config.toml"
        root.mkdir(exist_ok=True)
        config.write_text(_containerd_config(root, cni, self.tools.cni_bin_dir))
        process = self._start("containerd", [self.tools.containerd, "--config", str(config)])
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if not process.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start:\n{_tail(process.log)}")
            time.sleep(0.05)
        self.ctr("version")

    def _kubeconfig(self, name: str, user: Mapping[str, str]) -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "node",
            "clusters": [{"name": "node", "cluster": {
                "server": self.kube.url, "certificate-authority": str(self.kube.ca_file)}}],
            "users": [{"name": name, "user": dict(user)}],
            "contexts": [{"name": "node", "context": {"cluster": "node", "user": name}}],
        }  # fmt: skip
        path = self.workdir / f"{name}.kubeconfig"
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    @functools.cached_property
    def admin_kubeconfig(self) -> Path:
        """The admin's kubeconfig (written once): the control plane's and kubectl's."""
        return self._kubeconfig("admin", {"token": self.kube.admin_token})

    def _grant_nodes(self) -> None:
        self.kube.apply({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "awx-test-nodes"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:node"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                          "name": "system:nodes"}],
        })  # fmt: skip

    def _control_plane_argv(self, binary: Path, secure_port: int) -> list[str]:
        """What kube-controller-manager and kube-scheduler share: the admin's kubeconfig for
        the API and for checking their own callers, no leader election, no insecure port,
        the secure one on loopback."""
        config = self.admin_kubeconfig
        return [
            str(binary), f"--kubeconfig={config}", f"--authentication-kubeconfig={config}",
            f"--authorization-kubeconfig={config}", "--leader-elect=false", "--port=0",
            "--bind-address=127.0.0.1", f"--secure-port={secure_port}", "--v=1",
        ]  # fmt: skip

    def _controller_manager_argv(self) -> list[str]:
        return [
            *self._control_plane_argv(self.tools.kube_controller_manager, 10257),
            "--controllers=*",
            f"--service-account-private-key-file={self.kube.service_account_key_file}",
            f"--root-ca-file={self.kube.ca_file}", "--use-service-account-credentials=false",
            f"--service-cluster-ip-range={SERVICE_RANGE}",
        ]  # fmt: skip

    def _kubelet_argv(self) -> list[str]:
        cert, key = self.kube.client_certificate(f"system:node:{NODE_NAME}", "system:nodes")
        kubeconfig = self._kubeconfig(
            "kubelet", {"client-certificate": str(cert), "client-key": str(key)}
        )
        resolv = self.workdir / "node-resolv.conf"
        resolv.write_text(f"nameserver {NODE_IP}\n")
        config = self.workdir / "kubelet.json"
        config.write_text(json.dumps(_kubelet_config(self.kube.ca_file, resolv)))
        return [
            str(self.tools.kubelet), f"--config={config}", f"--kubeconfig={kubeconfig}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{self.socket}",
            f"--root-dir={self.workdir / 'kubelet'}", f"--cert-dir={self.workdir / 'kubelet-pki'}",
            f"--node-ip={NODE_IP}", f"--hostname-override={NODE_NAME}", "--v=1",
        ]  # fmt: skip

    def _node_ready(self) -> bool:
        try:
            node = self.kube.get(f"/api/v1/nodes/{NODE_NAME}")
        except Exception:
            return False
        return any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (node.get("status") or {}).get("conditions") or []
        )

    def _remove_pods(self) -> None:
        for line in self.ctr("containers", "list", "--quiet").split():
            with contextlib.suppress(RuntimeError):
                self.ctr("tasks", "kill", "--signal", "SIGKILL", line)
        time.sleep(0.5)
        for line in self.ctr("containers", "list", "--quiet").split():
            with contextlib.suppress(RuntimeError):
                self.ctr("tasks", "delete", "--force", line)
            with contextlib.suppress(RuntimeError):
                self.ctr("containers", "delete", line)


def _log_tail(path: Path, lines: int) -> str:
    """The end of a component's log without its flag dump and its informational lines."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    kept = [line for line in text if "flags.go" not in line and not line.startswith("I1")]
    return "\n".join(kept[-lines:])


def _cni_conflist(ipam_dir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "0.4.0", "name": "awx-pods",
        "plugins": [{
            "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
            "hairpinMode": True,
            "ipam": {"type": "host-local", "dataDir": str(ipam_dir),
                     "ranges": [[{"subnet": POD_SUBNET, "gateway": POD_GATEWAY}]],
                     "routes": [{"dst": "0.0.0.0/0"}]},
        }],
    }  # fmt: skip


def _containerd_config(root: Path, cni_conf: Path, cni_bin: Path) -> str:
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    return "\n".join([
        "version = 2", f'root = "{root / "root"}"', f'state = "{root / "state"}"',
        "[grpc]", f'  address = "{root / "containerd.sock"}"',
        cri, f'  sandbox_image = "{PAUSE_IMAGE}"', "  restrict_oom_score_adj = true",
        "  disable_apparmor = true", "  enable_selinux = false",
        f"{cri[:-1]}.containerd]", '  snapshotter = "overlayfs"',
        '  default_runtime_name = "runc"',
        f"{cri[:-1]}.containerd.runtimes.runc]", '  runtime_type = "io.containerd.runc.v2"',
        f"{cri[:-1]}.cni]", f'  bin_dir = "{cni_bin}"', f'  conf_dir = "{cni_conf}"', "",
    ])  # fmt: skip


def _kubelet_config(ca_file: Path, resolv: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": NODE_IP, "port": 10250, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca_file)}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
        "failSwapOn": False, "clusterDNS": [NODE_IP], "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(resolv), "staticPodPath": "", "serializeImagePulls": False,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
    }  # fmt: skip


# ------------------------------------------------------------------------------ the stand-ins


Services = list[dict[str, Any]]
Endpoints = dict[tuple[str, str], dict[str, Any]]


class _Consumer:
    """What the Services and Endpoints are turned into (``apply``), with its failures: the
    last 20 (each tried again at the next refresh) and the last one's, None once one worked."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.failing: str | None = None

    def apply(self, services: Services, endpoints: Endpoints) -> None:
        raise NotImplementedError

    def failed(self, exc: Exception) -> None:
        self.failing = repr(exc)
        self.errors.append(self.failing)
        del self.errors[:-20]


class ServiceWatch:
    """One thread that lists the Services and Endpoints every ``interval`` seconds and hands
    them to each consumer (the stand-in kube-proxy and DNS); ``start`` applies them once
    first, and raises if that fails."""

    interval = 0.5

    def __init__(self, kube: KubeAPIServer, *consumers: _Consumer) -> None:
        self.kube, self.consumers = kube, consumers
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="service-watch")

    def start(self) -> None:
        services, endpoints = self._list()
        for consumer in self.consumers:
            consumer.apply(services, endpoints)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                services, endpoints = self._list()
            except Exception as exc:  # kept for the scenario's report, tried again
                for consumer in self.consumers:
                    consumer.failed(exc)
                continue
            for consumer in self.consumers:
                try:
                    consumer.apply(services, endpoints)
                    consumer.failing = None
                except Exception as exc:
                    consumer.failed(exc)

    def _list(self) -> tuple[Services, Endpoints]:
        services = list(self.kube.get("/api/v1/services").get("items") or [])
        items = self.kube.get("/api/v1/endpoints").get("items") or []
        return services, {(e["metadata"]["namespace"], e["metadata"]["name"]): e for e in items}


def _ready_addresses(
    endpoints: Mapping[str, Any] | None, port_name: str | None
) -> list[tuple[str, int]]:
    """The ready (address, port) pairs of ``endpoints`` for the Service port named
    ``port_name`` ("" for an unnamed one); ``None``: every ready address, port 0."""
    found: list[tuple[str, int]] = []
    for subset in (endpoints or {}).get("subsets") or []:
        ports = [int(p["port"]) for p in subset.get("ports") or []
                 if (p.get("name") or "") == port_name]  # fmt: skip
        for address in subset.get("addresses") or []:
            found += (
                [(address["ip"], port) for port in ports]
                if port_name is not None
                else [(address["ip"], 0)]
            )
    return found


class ServiceProxy(_Consumer):
    """kube-proxy's iptables mode, for this node: each Service's ``clusterIP:port`` (TCP and
    UDP) DNATed to one of its ready endpoints at random (``statistic --mode random``, as
    kube-proxy's per-endpoint probabilities), rewritten whenever Services or Endpoints change."""

    def __init__(self) -> None:
        super().__init__()
        self._last = ""

    def apply(self, services: Services, endpoints: Endpoints) -> None:
        nat, reject = [f"-F {_CHAIN}"], [f"-F {_REJECT}"]
        for service in services:
            spec = service.get("spec") or {}
            ip = spec.get("clusterIP")
            if not ip or ip == "None":
                continue
            key = (service["metadata"]["namespace"], service["metadata"]["name"])
            for port in spec.get("ports") or []:
                targets = _ready_addresses(endpoints.get(key), port.get("name") or "")
                protocol = str(port.get("protocol") or "TCP").lower()
                match = f"-d {ip}/32 -p {protocol} -m {protocol} --dport {port['port']}"
                if targets:
                    nat += _dnat_rules(match, targets)
                else:  # as kube-proxy: refused at once, not a connection left to time out
                    reject.append(f"-A {_REJECT} {match} -j REJECT")
        rules = ["*nat", *nat, "COMMIT", "*filter", *reject, "COMMIT", ""]
        text = "\n".join(rules)
        if text != self._last:
            _run("iptables-restore", "--noflush", input=text)
            self._last = text


def _dnat_rules(match: str, targets: Sequence[tuple[str, int]]) -> list[str]:
    """One endpoint of ``targets`` at random: the first with 1/n, the next 1/(n-1), ..."""
    rules = []
    for index, (address, target_port) in enumerate(targets):
        left = len(targets) - index
        chance = "" if left == 1 else f" -m statistic --mode random --probability {1 / left:.5f}"
        rules.append(
            f"-A {_CHAIN} {match}{chance} -j DNAT --to-destination {address}:{target_port}"
        )
    return rules


class ClusterDns(_Consumer):
    """CoreDNS's ``kubernetes`` plugin, for this cluster, through dnsmasq on ``NODE_IP:53``:
    ``<service>.<namespace>.svc.cluster.local`` answers the ClusterIP, or for a headless
    Service its ready endpoints' IPs; any other name under ``cluster.local`` is NXDOMAIN, and
    nothing is forwarded outside."""

    def __init__(self, folder: Path, dnsmasq: str) -> None:
        super().__init__()
        self.folder, self.dnsmasq = folder, dnsmasq
        self.log = folder.parent / "dnsmasq.log"
        self._process: _Process | None = None
        self._last = ""

    def start(self) -> None:
        (self.folder / "hosts").mkdir(parents=True)
        self._process = _Process("dnsmasq", [
            self.dnsmasq, "--keep-in-foreground", "--no-resolv", "--no-hosts",
            "--no-daemon", "--log-facility=-", "--user=root", "--pid-file=",
            f"--listen-address={NODE_IP}", "--bind-interfaces", "--port=53",
            f"--hostsdir={self.folder / 'hosts'}", f"--local=/{CLUSTER_DOMAIN}/",
            "--local-ttl=1", "--cache-size=0",
        ], self.log)  # fmt: skip

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop(grace=2)

    def apply(self, services: Services, endpoints: Endpoints) -> None:
        lines = []
        for service in services:
            namespace, name = service["metadata"]["namespace"], service["metadata"]["name"]
            ip = (service.get("spec") or {}).get("clusterIP")
            if ip and ip != "None":
                addresses = [ip]
            else:
                ready = _ready_addresses(endpoints.get((namespace, name)), None)
                addresses = sorted({address for address, _ in ready})
            fqdn = f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"
            lines += [f"{address} {fqdn}" for address in addresses]
        text = "\n".join(sorted(lines)) + "\n"
        if text != self._last:
            target = self.folder / "hosts" / "services"
            temporary = self.folder / "services.tmp"  # outside the folder dnsmasq watches
            temporary.write_text(text)
            os.replace(temporary, target)
            self._last = text
