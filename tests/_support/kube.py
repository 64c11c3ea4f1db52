"""A real kube-apiserver (and etcd) on loopback for the Kubernetes tests.

``KubeAPIServer`` starts etcd (data in a temporary folder, free loopback ports) and
kube-apiserver on 127.0.0.1 over HTTPS with a CA made at test time, a static token for the
test's admin (``system:masters``), ``--authorization-mode=RBAC`` and a service-account issuer
whose RSA signing key is generated at test time; it installs the stand-in agent-sandbox CRDs
(``deploy/crds/upstream-agent-sandbox.yaml``), waits for them to be served, and tears
everything down (each process group killed, temporary folders removed) even when a step fails.
Like envtest it runs no controllers, no kubelet and no pods: nothing garbage-collects by
ownerReference, no namespace gets its ``default`` ServiceAccount, and objects' status is what
a test writes. The test CA also signs client certificates (``client_certificate``).

The binaries come from ``.ci/kube-tools`` (``find_kube_tools``): etcd from Debian's
etcd-server, kube-apiserver 1.20 built from Debian's source package, cached outside the clone.

Facts about the 1.20 server that the tests pin (tests/kube/test_apiserver.py): TokenRequest
needs ``expirationSeconds >= 600``; a structural schema prunes unknown fields instead of
refusing them; a watch from a resourceVersion older than the watch cache's window is answered
``410 Gone`` before the stream starts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx

from k8s_agent_sandbox_awx.broker.backends.local._owned_dirs import (
    owned_temp_dir,
    sweep_dead_owners,
)

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
CRD_FILE: Final = REPO_ROOT / "deploy" / "crds" / "upstream-agent-sandbox.yaml"

ENV_APISERVER: Final = "AGENT_SANDBOX_TEST_KUBE_APISERVER"
ENV_ETCD: Final = "AGENT_SANDBOX_TEST_ETCD"
ENV_REQUIRE: Final = "AGENT_SANDBOX_REQUIRE_KUBE"
ENV_CACHE: Final = "AGENT_SANDBOX_KUBE_CACHE"
ENV_WAIT: Final = "AGENT_SANDBOX_KUBE_WAIT"
BUILD_HINT: Final = "build them once per machine with `bash .ci/kube-tools` (a few minutes)"

ADMIN_USER: Final = "test-admin"
_TMP_PREFIX: Final = "k8s-awx-kube-"
SERVICE_ACCOUNT_ISSUER_DISCOVERY: Final = "system:service-account-issuer-discovery"

# apiVersion/kind -> (plural, namespaced), for apply() and path_of()
KINDS: Final[Mapping[tuple[str, str], tuple[str, bool]]] = {
    ("v1", "Namespace"): ("namespaces", False),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Pod"): ("pods", True),
    ("v1", "Service"): ("services", True),
    ("v1", "Endpoints"): ("endpoints", True),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("batch/v1", "Job"): ("jobs", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True),
    ("policy/v1beta1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): ("clusterroles", False),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): ("clusterrolebindings", False),
    ("rbac.authorization.k8s.io/v1", "Role"): ("roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
    ("coordination.k8s.io/v1", "Lease"): ("leases", True),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): (
        "customresourcedefinitions",
        False,
    ),
    ("agents.x-k8s.io/v1beta1", "Sandbox"): ("sandboxes", True),
    ("extensions.agents.x-k8s.io/v1beta1", "SandboxClaim"): ("sandboxclaims", True),
    ("extensions.agents.x-k8s.io/v1beta1", "SandboxTemplate"): ("sandboxtemplates", True),
    ("extensions.agents.x-k8s.io/v1beta1", "SandboxWarmPool"): ("sandboxwarmpools", True),
}


# ------------------------------------------------------------------------------ the binaries


class KubeToolsMissing(Exception):
    """etcd or kube-apiserver is not available; the message says why and how to get them."""


@dataclass(frozen=True)
class KubeTools:
    etcd: Path
    kube_apiserver: Path


def cache_root() -> Path:
    """Where ``.ci/kube-tools`` caches the build and writes its env and status files."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "k8s-agent-sandbox-awx"


def kube_required() -> bool:
    """Whether a missing binary is a failure (CI sets ``AGENT_SANDBOX_REQUIRE_KUBE=1``)."""
    return os.environ.get(ENV_REQUIRE, "").strip().lower() not in ("", "0", "false", "no")


def find_kube_tools(*, wait: float | None = None) -> KubeTools:
    """The binaries, from ``AGENT_SANDBOX_TEST_ETCD`` / ``AGENT_SANDBOX_TEST_KUBE_APISERVER``,
    else from what ``.ci/kube-tools`` provided. When ``.ci/kube-tools --background`` is still
    building, waits for it (up to ``wait`` seconds, default ``AGENT_SANDBOX_KUBE_WAIT`` or 900).
    Raises ``KubeToolsMissing`` naming what is missing and how to provide it."""
    named = {ENV_ETCD: os.environ.get(ENV_ETCD), ENV_APISERVER: os.environ.get(ENV_APISERVER)}
    if any(named.values()):
        return _tools_from(named, source="the environment")
    root = cache_root()
    _wait_for_build(root, float(os.environ.get(ENV_WAIT, "900")) if wait is None else wait)
    env_file = root / "kube-tools.env"
    if not env_file.is_file():
        raise KubeToolsMissing(
            f"etcd and kube-apiserver are not provided ({env_file} is missing): "
            f"{BUILD_HINT}, or set {ENV_ETCD} and {ENV_APISERVER}"
        )
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    return _tools_from({k: values.get(k) for k in named}, source=str(env_file))


def build_wait() -> float:
    """How long ``find_kube_tools`` will wait for a ``.ci/kube-tools --background`` that is
    still building now (``AGENT_SANDBOX_KUBE_WAIT``, default 900 s), else 0."""
    if os.environ.get(ENV_ETCD) or os.environ.get(ENV_APISERVER):
        return 0.0
    status_file = cache_root() / "kube-tools.status"
    status = status_file.read_text().strip() if status_file.is_file() else ""
    return float(os.environ.get(ENV_WAIT, "900")) if status.startswith("running") else 0.0


def _tools_from(named: Mapping[str, str | None], *, source: str) -> KubeTools:
    for variable, value in named.items():
        if not value or not os.access(value, os.X_OK):
            raise KubeToolsMissing(
                f"{variable} from {source} is {value!r}, not an executable file: {BUILD_HINT}"
            )
    return KubeTools(
        etcd=Path(named[ENV_ETCD] or ""), kube_apiserver=Path(named[ENV_APISERVER] or "")
    )


def _wait_for_build(root: Path, wait: float) -> None:
    """Waits while the status file says ``running <pid>``; raises if the build failed."""
    status_file, log_file = root / "kube-tools.status", root / "kube-tools.log"
    deadline = time.monotonic() + wait
    while True:
        status = status_file.read_text().strip() if status_file.is_file() else ""
        if status.startswith("failed"):
            raise KubeToolsMissing(
                f".ci/kube-tools --background failed ({status}); the end of {log_file}:\n"
                + _tail(log_file)
            )
        if not status.startswith("running"):
            return
        pid = status.split()[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            raise KubeToolsMissing(
                f".ci/kube-tools --background (pid {pid}) died without reporting; see {log_file}"
            )
        if time.monotonic() > deadline:
            raise KubeToolsMissing(
                f".ci/kube-tools --background is still running after {wait:.0f} s "
                f"({ENV_WAIT} raises the wait); see {log_file}"
            )
        time.sleep(1)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


# ------------------------------------------------------------------------------ processes


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()  # its own process group: stop() kills the whole group
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan if pytest is killed


_SPAWNER: list[concurrent.futures.ThreadPoolExecutor] = []


def _spawner() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that starts processes for callers other than the main thread."""
    if not _SPAWNER:
        _SPAWNER.append(
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kube-spawner")
        )
    return _SPAWNER[0]


class _Process:
    """One child process in its own process group, its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], log: Path) -> None:
        self.name, self.log = name, log
        with log.open("ab") as out:

            def spawn() -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,  # forked by a thread that lives (below)
                )

            # PR_SET_PDEATHSIG fires when the THREAD that forked ends, not the process: a
            # restart() from a worker thread (asyncio.to_thread, whose thread ends with the
            # test's event loop) would have the new API server killed with it. Such starts go
            # through one spawner thread that lives as long as the session.
            if threading.current_thread() is threading.main_thread():
                self.popen = spawn()
            else:
                self.popen = _spawner().submit(spawn).result()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
            try:
                self.popen.wait(max(grace, 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # anything it left in its group


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all held open together while chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


# ------------------------------------------------------------------------------ errors


class KubeError(Exception):
    """A request the API server answered with an error status (the Status object kept)."""

    def __init__(self, method: str, path: str, response: httpx.Response) -> None:
        self.status_code = response.status_code
        try:
            self.status: dict[str, Any] = response.json()
        except ValueError:
            self.status = {"message": response.text[:500]}
        self.reason = str(self.status.get("reason", ""))
        message = self.status.get("message", "")
        super().__init__(f"{method} {path}: {self.status_code} {self.reason}: {message}")


# ------------------------------------------------------------------------------ the server


@dataclass(frozen=True)
class ServerAddress:
    """Where the API server listens and what it says of itself. The default: 127.0.0.1 on a
    free port, its own URL as the service-account issuer, no endpoints for the ``kubernetes``
    Service. ``tests/_support/real_node.py`` gives a node's address instead (the pods reach it
    through the ``kubernetes`` Service, by IP and by name)."""

    bind: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    advertise: str = "127.0.0.1"
    names: tuple[str, ...] = ("127.0.0.1", "localhost")  # the serving certificate's
    issuer: str | None = None  # None: the server's own URL
    endpoint_reconciler: str = "none"  # "lease": the kubernetes Service's endpoints kept
    kubelet_client: bool = False  # a client certificate for the kubelets (logs, exec)
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Pki:
    ca_file: Path
    cert_file: Path
    key_file: Path
    sa_key_file: Path
    sa_public_file: Path
    authority: Any = None  # the trustme.CA: it also signs client certificates


def _make_pki(folder: Path, names: Sequence[str]) -> _Pki:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert(*names)
    paths = _Pki(
        ca_file=folder / "ca.pem",
        cert_file=folder / "server.pem",
        key_file=folder / "server-key.pem",
        sa_key_file=folder / "sa.key",
        sa_public_file=folder / "sa.pub",
        authority=ca,
    )
    ca.cert_pem.write_to_path(str(paths.ca_file))
    cert.cert_chain_pems[0].write_to_path(str(paths.cert_file))
    cert.private_key_pem.write_to_path(str(paths.key_file))
    paths.key_file.chmod(0o600)
    paths.sa_public_file.write_bytes(_new_signing_key(paths.sa_key_file))
    return paths


def _new_signing_key(key_file: Path) -> bytes:
    """A new RSA service-account signing key written (mode 600) to ``key_file``; its public
    key (PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class KubeAPIServer:
    """etcd + kube-apiserver on loopback. Use as a context manager (or ``start``/``stop``).

    Exposes ``url``, ``ca_file``, ``admin_token``, ``issuer`` (the service-account issuer, the
    server's own URL, so its discovery document is at ``issuer + /.well-known/...``),
    ``api_audience`` (the server's own audience) and REST helpers acting as the admin."""

    def __init__(
        self, tools: KubeTools, *, workdir: Path | None = None, address: ServerAddress | None = None
    ) -> None:
        self.tools = tools
        self.address = address or ServerAddress()
        self._own_workdir = workdir is None
        if workdir is None:  # and remove those of sessions that were killed
            sweep_dead_owners(_TMP_PREFIX)
            workdir = Path(owned_temp_dir(_TMP_PREFIX))
        self.workdir = workdir
        self.admin_token = secrets.token_urlsafe(32)
        self.port, *self._etcd_ports = free_ports(3)  # the API server, etcd client, peer
        self.port = self.address.port or self.port
        self.url = f"https://{self.address.advertise}:{self.port}"
        self.issuer = self.address.issuer or self.url
        self.api_audience = "https://kubernetes.default.svc"
        self.ca_file = self.workdir / "pki" / "ca.pem"
        self._etcd: _Process | None = None
        self._apiserver: _Process | None = None
        self._admin: httpx.Client | None = None
        self._pki: _Pki | None = None
        self._crds: list[dict[str, Any]] = []
        self.etcd_url = ""
        self.start_seconds = 0.0

    def __repr__(self) -> str:  # no token in it
        return f"KubeAPIServer(url={self.url!r}, workdir={str(self.workdir)!r})"

    def __enter__(self) -> KubeAPIServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---------------------------------------------------------------------- lifecycle

    def start(self) -> KubeAPIServer:
        """Start etcd and the API server, install the CRDs; raises (after cleaning up) with
        the end of the failing process's log if a step fails."""
        started = time.perf_counter()
        try:
            (self.workdir / "pki").mkdir(parents=True, exist_ok=True)
            self._pki = _make_pki(self.workdir / "pki", self.address.names)
            (self.workdir / "tokens.csv").write_text(
                f"{self.admin_token},{ADMIN_USER},{ADMIN_USER},system:masters\n"
            )
            (self.workdir / "tokens.csv").chmod(0o600)
            self._start_etcd()
            self._start_apiserver()
            self.install_crds()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - started
        return self

    def stop(self) -> None:
        """Kill both process groups and remove the work folder (if this object made it)."""
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        for process in (self._apiserver, self._etcd):
            if process is not None:
                process.stop()
        self._apiserver = self._etcd = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def restart(self, *, crash: bool = False) -> float:
        """Stop the API server and start it again on the same port with the same etcd;
        returns, in seconds, how long until it was ready and served the CRDs again.
        SIGTERM (a rolling restart) with 3 s of grace before SIGKILL, since 1.20 holds open
        watches much longer than that; ``crash=True`` sends SIGKILL at once. Clients see their
        connections drop, and a watch resumed from a resourceVersion of before the restart is
        told 410 (the new watch cache starts at etcd's current revision)."""
        started = time.perf_counter()
        if self._apiserver is None:
            raise RuntimeError("restart(): the API server is not running (start() first)")
        self._apiserver.stop(grace=0 if crash else 3)
        if self._admin is not None:  # its pooled connections are dead
            self._admin.close()
            self._admin = None
        self._start_apiserver()
        self._wait_for_crds_served()
        return time.perf_counter() - started

    def rotate_signing_key(self) -> float:
        """A service-account key rotation: a new signing key (``--service-account-signing-key-
        file``), the old public key still published beside the new one (both in
        ``--service-account-key-file``: tokens of either verify, and the JWKS lists both), the
        API server restarted (``restart()``) to take them; its seconds. Later tokens are signed
        with the new key (another ``kid``). Nothing retires the old key."""
        pki = self._pki
        if pki is None:
            raise RuntimeError("rotate_signing_key(): start() first")
        public = pki.sa_public_file.read_bytes() + _new_signing_key(pki.sa_key_file)
        pki.sa_public_file.write_bytes(public)
        return self.restart()

    def _start_etcd(self) -> None:
        client, peer = self._etcd_ports
        self.etcd_url = f"http://127.0.0.1:{client}"
        data = self.workdir / "etcd"
        self._etcd = _Process("etcd", [
            str(self.tools.etcd), "--name=test", f"--data-dir={data}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=test=http://127.0.0.1:{peer}",
            "--logger=zap", "--log-level=warn", "--snapshot-count=10000",
        ], self.workdir / "etcd.log")  # fmt: skip
        self._wait(self._etcd, lambda: self._etcd_healthy(), "etcd /health")

    def _etcd_healthy(self) -> bool:
        response = httpx.get(f"{self.etcd_url}/health", timeout=2)
        return response.status_code == 200 and response.json().get("health") == "true"

    def _apiserver_argv(self) -> list[str]:
        pki = self._pki
        assert pki is not None, "start() makes the PKI first"
        return [
            str(self.tools.kube_apiserver), f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.address.bind}", f"--secure-port={self.port}",
            f"--advertise-address={self.address.advertise}",
            f"--endpoint-reconciler-type={self.address.endpoint_reconciler}",
            f"--tls-cert-file={pki.cert_file}", f"--tls-private-key-file={pki.key_file}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            f"--client-ca-file={pki.ca_file}",  # client certificates: client_certificate()
            "--authorization-mode=RBAC",
            f"--service-account-issuer={self.issuer}",
            f"--service-account-key-file={pki.sa_public_file}",
            f"--service-account-signing-key-file={pki.sa_key_file}",
            f"--api-audiences={self.api_audience}",
            "--service-cluster-ip-range=10.96.0.0/24",
            "--enable-priority-and-fairness=false", "--profiling=false",
            "--cert-dir", str(self.workdir / "apiserver-certs"), "--v=1",
            *self._kubelet_client_args(), *self.address.extra_args,
        ]  # fmt: skip

    def _kubelet_client_args(self) -> list[str]:
        if not self.address.kubelet_client:
            return []
        cert, key = self.client_certificate("kube-apiserver-kubelet-client", "system:masters")
        return [f"--kubelet-client-certificate={cert}", f"--kubelet-client-key={key}",
                "--kubelet-preferred-address-types=InternalIP"]  # fmt: skip

    def _start_apiserver(self) -> None:
        self._apiserver = _Process("kube-apiserver", self._apiserver_argv(),
                                   self.workdir / "kube-apiserver.log")  # fmt: skip
        self._wait(self._apiserver, self._ready, "kube-apiserver /readyz", timeout=90)

    def _ready(self) -> bool:
        return self.admin.get("/readyz", timeout=2).status_code == 200

    def _wait(self, process: _Process, check: Any, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not process.alive():
                raise RuntimeError(
                    f"{process.name} exited ({process.popen.returncode}) before {what} "
                    f"answered; the end of {process.log}:\n{_tail(process.log)}"
                )
            with contextlib.suppress(httpx.TransportError):
                if check():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what} not ready after {timeout:.0f} s; the end of {process.log}:\n"
                    + _tail(process.log)
                )
            time.sleep(0.05)

    # ---------------------------------------------------------------------- CRDs

    def install_crds(self) -> None:
        """Apply the stand-in CRDs and wait until each is Established and served."""
        import yaml  # type: ignore[import-untyped]

        document = yaml.safe_load(CRD_FILE.read_text())
        self._crds = list(document["items"])
        for crd in self._crds:
            self.apply(crd)
        for crd in self._crds:
            name = crd["metadata"]["name"]
            self.wait_for(
                lambda n=name: _condition(self.get(path_of(
                    "apiextensions.k8s.io/v1", "CustomResourceDefinition", name=n
                )), "Established"),
                what=f"CRD {name} Established",
            )  # fmt: skip
        self._wait_for_crds_served()

    def _wait_for_crds_served(self) -> None:
        for crd in self._crds:
            group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
            path = f"/apis/{group}/v1beta1/{plural}"
            self.wait_for(
                lambda p=path: self.admin.get(p).status_code == 200, what=f"{path} served"
            )

    # ---------------------------------------------------------------------- REST

    @property
    def admin(self) -> httpx.Client:
        """An httpx client acting as the admin (``system:masters``)."""
        if self._admin is None:
            self._admin = self.client(self.admin_token)
        return self._admin

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.Client:
        """An httpx client to the API server trusting its CA; ``token`` as a Bearer token
        (None: anonymous). The caller closes it."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, verify=self.ssl_context(), headers=headers,
                            timeout=httpx.Timeout(30), **kwargs)  # fmt: skip

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """An admin request; the decoded JSON body; ``KubeError`` on an error status."""
        response = self.admin.request(method, path, **kwargs)
        if response.is_error:
            raise KubeError(method, path, response)
        return dict(response.json())

    def get(self, path: str) -> dict[str, Any]:
        return self.request("GET", path)

    def create(self, obj: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """POST ``obj`` to its collection (``metadata.generateName`` works)."""
        return self.request("POST", path_of_obj(obj, namespace, collection=True), json=obj)

    def delete(self, path: str) -> dict[str, Any]:
        return self.request("DELETE", path)

    def apply(self, obj: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """Server-side apply (field manager ``tests``, forced): creates or updates ``obj``."""
        return self.request(
            "PATCH",
            path_of_obj(obj, namespace),
            params={"fieldManager": "tests", "force": "true"},
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )

    def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self.request(
            "PATCH", path, content=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )  # fmt: skip

    def wait_for(self, check: Any, *, what: str, timeout: float = 30) -> Any:
        """Poll ``check()`` until it returns something truthy; that value."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                value = check()
            except (KubeError, httpx.TransportError) as exc:
                value, last = None, exc
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"{what}: not after {timeout:.0f} s (last error: {last})")

    @contextlib.contextmanager
    def watch(
        self, path: str, *, resource_version: str | None = None, timeout_seconds: int = 30,
        token: str | None = None, params: Mapping[str, str] | None = None,
    ) -> Iterator[Iterator[dict[str, Any]]]:  # fmt: skip
        """``with server.watch(path, resource_version=rv) as events:`` — the decoded watch
        events until the server ends the watch (``timeout_seconds``); ``params`` adds query
        parameters (``labelSelector``, ``fieldSelector``). ``KubeError`` when the server
        refuses the watch outright; a too-old ``resource_version`` is an ERROR event."""
        params = {**(params or {}), "watch": "1", "timeoutSeconds": str(timeout_seconds)}
        if resource_version is not None:
            params["resourceVersion"] = resource_version
        client = self.admin if token is None else self.client(token)
        try:
            with client.stream("GET", path, params=params, timeout=timeout_seconds + 10) as r:
                if r.is_error:
                    r.read()
                    raise KubeError("WATCH", path, r)
                yield (json.loads(line) for line in r.iter_lines() if line.strip())
        finally:
            if token is not None:
                client.close()

    # ---------------------------------------------------------------------- identities

    @property
    def service_account_key_file(self) -> Path:
        """The service-account signing key (kube-controller-manager's token controller)."""
        if self._pki is None:
            raise RuntimeError("service_account_key_file: the API server is not running")
        return self._pki.sa_key_file

    def client_certificate(self, user: str, group: str | None = None) -> tuple[Path, Path]:
        """A client certificate the API server accepts (``--client-ca-file`` is the test
        CA): the user is its CN, the group its O. Returns (certificate file, key file)."""
        if self._pki is None:
            raise RuntimeError("client_certificate(): the API server is not running")
        identity = user if ":" not in user else user.replace(":", "-") + ".invalid"  # a SAN
        cert = self._pki.authority.issue_cert(identity, common_name=user, organization_name=group)
        folder = self.workdir / "client-certs"
        folder.mkdir(exist_ok=True)
        cert_file, key_file = folder / f"{user}.pem", folder / f"{user}-key.pem"
        cert.cert_chain_pems[0].write_to_path(str(cert_file))
        cert.private_key_pem.write_to_path(str(key_file))
        key_file.chmod(0o600)
        return cert_file, key_file

    def create_namespace(self, name: str | None = None) -> str:
        """A new namespace (``t-<random>`` when no name is given); its name."""
        meta = {"name": name} if name else {"generateName": "t-"}
        created = self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": meta})
        return str(created["metadata"]["name"])

    def create_service_account(self, namespace: str, name: str) -> dict[str, Any]:
        return self.create(
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
            namespace,
        )

    def create_pod(self, namespace: str, name: str, service_account: str) -> dict[str, Any]:
        """A Pod object running as ``service_account`` (it stays Pending: no scheduler, no
        kubelet), for tokens bound to a pod. ``automountServiceAccountToken: false`` because
        1.20's ServiceAccount admission would otherwise want a legacy token Secret that no
        controller creates here."""
        pod = {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"serviceAccountName": service_account,
                     "automountServiceAccountToken": False,
                     "containers": [{"name": "main", "image": "example.invalid/sandbox"}]},
        }  # fmt: skip
        return self.request("POST", f"/api/v1/namespaces/{namespace}/pods", json=pod)

    def token_request(
        self, namespace: str, service_account: str, audience: str | Sequence[str] | None = None,
        expiration: int = 3600, *, bound_pod: Mapping[str, Any] | None = None,
    ) -> str:  # fmt: skip
        """A service-account token from the TokenRequest API (a real JWT signed by the API
        server, the claims a projected volume's token has). ``bound_pod`` (a Pod object, e.g.
        from ``create_pod``) binds it to that pod, as the kubelet does for a pod's projected
        token. 1.20 refuses ``expiration`` below 600 s."""
        spec: dict[str, Any] = {"expirationSeconds": expiration}
        if audience is not None:
            spec["audiences"] = [audience] if isinstance(audience, str) else list(audience)
        if bound_pod is not None:
            meta = bound_pod["metadata"]
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod",
                                      "name": meta["name"], "uid": meta["uid"]}  # fmt: skip
        answer = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
            json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return str(answer["status"]["token"])

    def token_review(self, token: str, audiences: Sequence[str] | None = None) -> dict[str, Any]:
        """The TokenReview status for ``token`` (``authenticated``, ``user``, ``audiences``)."""
        spec: dict[str, Any] = {"token": token}
        if audiences is not None:
            spec["audiences"] = list(audiences)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
        answer = self.request("POST", "/apis/authentication.k8s.io/v1/tokenreviews", json=body)
        return dict(answer["status"])

    def bind_role(
        self, service_account: tuple[str, str], role: str, *, namespace: str | None = None,
        rules: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:  # fmt: skip
        """Grant ``role`` to ``service_account`` (namespace, name). With ``namespace``: a
        RoleBinding there; else a ClusterRoleBinding. With ``rules``, the role (a Role in
        ``namespace``, else a ClusterRole) is first applied with exactly those rules; without,
        ``role`` names an existing ClusterRole."""
        rbac = "rbac.authorization.k8s.io/v1"
        role_kind = "ClusterRole" if namespace is None or rules is None else "Role"
        if rules is not None:
            self.apply({"apiVersion": rbac, "kind": role_kind,
                        "metadata": {"name": role}, "rules": list(rules)}, namespace)  # fmt: skip
        binding = {
            "apiVersion": rbac,
            "kind": "ClusterRoleBinding" if namespace is None else "RoleBinding",
            "metadata": {"name": f"{role.replace(':', '-')}-{service_account[1]}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role},
            "subjects": [{"kind": "ServiceAccount", "namespace": service_account[0],
                          "name": service_account[1]}],
        }  # fmt: skip
        self.apply(binding, namespace)


# ------------------------------------------------------------------------------ paths


def path_of(
    api_version: str, kind: str, *, namespace: str | None = None, name: str | None = None,
    subresource: str | None = None,
) -> str:  # fmt: skip
    """The REST path of a kind this module knows (``KINDS``): its collection without ``name``."""
    try:
        plural, namespaced = KINDS[(api_version, kind)]
    except KeyError:
        raise ValueError(
            f"unknown kind {kind!r} of {api_version!r}: add it to KINDS in {__file__}"
        ) from None
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespaced:
        if not namespace:
            raise ValueError(f"{kind} is namespaced: give a namespace")
        prefix += f"/namespaces/{namespace}"
    path = f"{prefix}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def path_of_obj(
    obj: Mapping[str, Any], namespace: str | None = None, *, collection: bool = False
) -> str:
    meta = obj.get("metadata", {})
    return path_of(
        obj["apiVersion"], obj["kind"], namespace=namespace or meta.get("namespace"),
        name=None if collection else meta["name"],
    )  # fmt: skip


def _condition(obj: Mapping[str, Any], kind: str) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)
