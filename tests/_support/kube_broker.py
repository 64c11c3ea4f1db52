"""The Kubernetes-backed broker for the tests on the real API server (tests/kube/test_broker_*).

- ``BrokerIdentity``: the broker's own ServiceAccount in the test's namespace, its RBAC bound
  from deploy/broker/rbac.yaml (the ClusterRole ``sandbox-broker``, by a RoleBinding there, as
  the deployment binds it), a TokenRequest token in a file (read again on each request), and a
  kubeconfig using that file: the broker reads the API server, its OIDC discovery and its JWKS
  as that ServiceAccount, with the API server's CA.
- ``write_config``: a ``broker serve`` configuration (TOML) for one replica: the cluster's
  issuer, one policy for the namespace, the Kubernetes backend (pod data plane with the
  stand-in's loopback pod IPs allowed, or the router).
- ``Replica``: the app ``broker serve`` builds (``app_factory``) under uvicorn over HTTPS on its
  own thread and event loop; ``kill()`` drops every connection at once without an answer and
  stops it without its shutdown (a replica that died), ``stop()`` stops it gracefully, with
  ``broker serve``'s own shutdown (``_run._Server``: a connection whose last answer ended and
  that only waits for its peer's TLS close is dropped after ``CLOSE_WAIT``; uvicorn's waited
  the whole ``timeout_graceful_shutdown`` for an idle keep-alive client, 2 s of each stop).
- ``StandInRouter``: upstream's Python router (``tests/_support/stand_in_router.py``): it finds
  a pod by X-Sandbox-Pod-IP or by the Sandbox's headless Service, as upstream's does.
- The callers' side: ``sdk_environ`` (the SDK's environment for a replica), ``token_for`` (one
  token for several replicas' audiences), ``replica_client`` (a plain HTTP client of a
  replica's v1 API), and what the tests read of the API server: ``claims_in``, ``claim_of``,
  ``shutdown_time``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn

from k8s_agent_sandbox_awx.broker._app_factory import ConfiguredBroker, app_factory
from k8s_agent_sandbox_awx.broker.backends.kubernetes._backend import KubernetesBackend
from k8s_agent_sandbox_awx.broker.config import load_config
from k8s_agent_sandbox_awx.broker.server._probes import with_probes
from k8s_agent_sandbox_awx.broker.server._run import _Server, bind
from tests._support._api import CLAIM, collection, path
from tests._support.broker_server import Pki
from tests._support.deploy import BROKER, find, render
from tests._support.kube import KubeAPIServer, KubeError
from tests._support.stand_in_router import StandInRouter

__all__ = ["BrokerIdentity", "Replica", "SdkReplica", "StandInRouter", "sdk_environ",
           "write_config"]  # fmt: skip

T = TypeVar("T")

BROKER_SA = "sandbox-broker"
ROLE = "sandbox-broker"
"""The broker's ClusterRole in deploy/broker/rbac.yaml."""


def broker_cluster_role() -> dict[str, Any]:
    """The ClusterRole deploy/broker ships for the broker (its minimal RBAC)."""
    return find(render(BROKER), "ClusterRole", ROLE)


@dataclass
class BrokerIdentity:
    """The broker's ServiceAccount in ``namespace`` (see the module)."""

    kube: KubeAPIServer
    namespace: str
    folder: Path
    token_file: Path = field(init=False)
    kubeconfig: Path = field(init=False)

    def __post_init__(self) -> None:
        self.kube.create_service_account(self.namespace, BROKER_SA)
        self.kube.apply(broker_cluster_role())
        self.bind(self.namespace)
        self.token_file = self.folder / "broker-token"
        self.refresh_token()
        self.kubeconfig = self.folder / "kubeconfig.json"
        self.kubeconfig.write_text(json.dumps(self._kubeconfig()))

    def bind(self, namespace: str, role: str = ROLE, *, rules: Any = None) -> None:
        """Grant ``role`` (the deployment's ClusterRole, or a Role of ``rules``) in
        ``namespace`` to the broker."""
        self.kube.bind_role((self.namespace, BROKER_SA), role, namespace=namespace, rules=rules)

    def refresh_token(self) -> None:
        self.token_file.write_text(self.kube.token_request(self.namespace, BROKER_SA))

    def _kubeconfig(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {
                "server": self.kube.url, "certificate-authority": str(self.kube.ca_file)}}],
            "users": [{"name": "broker", "user": {"tokenFile": str(self.token_file)}}],
            "contexts": [{"name": "test", "context": {
                "cluster": "test", "user": "broker", "namespace": self.namespace}}],
        }  # fmt: skip


def write_config(
    path: Path,
    identity: BrokerIdentity,
    pki: Pki,
    port: int,
    *,
    pools: Sequence[str] = ("python",),
    max_sandboxes: int = 5,
    max_lifetime_seconds: int = 3600,
    protocols: Sequence[str] = ("v1", "rpc"),
    router: tuple[str, Path] | None = None,
    jwks_min_refetch_seconds: float = 30.0,
    extra_audiences: Sequence[str] = (),
    namespace: str | None = None,
    callers: Sequence[str] = (),
    router_pod_ip: bool = True,
) -> Path:
    """A configuration of one replica on 127.0.0.1:``port`` (its ``public_url``, the tokens'
    audience, with ``extra_audiences``); ``router``: (router URL, router token file) for the
    router data plane (``router_pod_ip``: its setting), else the pod data plane (either way
    with the stand-in pods' loopback IPs allowed: ``allow_loopback_pod_ips``). The policy
    admits the ServiceAccounts of the identity's namespace and puts their claims in
    ``namespace`` (default: that one too); ``callers``: more namespaces, each admitted by a
    policy of its own (the same warm pools, quota and lifetime cap) that puts its
    ServiceAccounts' claims in that namespace."""
    ns, url = identity.namespace, f"https://127.0.0.1:{port}"
    claims_in = namespace or ns
    more = "".join(
        _policy(f"callers-{caller}", caller, caller, pools, max_sandboxes, max_lifetime_seconds)
        for caller in callers
    )
    audiences = ", ".join(json.dumps(a) for a in (url, *extra_audiences))
    backend = (
        f'data_plane = "router"\nrouter_url = "{router[0]}"\nrouter_token_file = "{router[1]}"\n'
        if router is not None
        else 'data_plane = "pod"\n'
    ) + "allow_loopback_pod_ips = true\n"  # the stand-in pods' IPs (also sent to a router)
    if not router_pod_ip:
        backend += "router_pod_ip = false\n"
    path.write_text(f"""\
[server]
listen = "127.0.0.1:{port}"
public_url = "{url}"
tls_cert_file = "{pki.cert_file}"
tls_key_file = "{pki.key_file}"
protocols = {json.dumps(list(protocols))}
shutdown_grace_seconds = 5

[[issuers]]
name = "cluster"
url = "{identity.kube.issuer}"
provider = "kubernetes"
audiences = [{audiences}]
ca_file = "{identity.kube.ca_file}"
token_file = "{identity.token_file}"
jwks_min_refetch_seconds = {jwks_min_refetch_seconds}

{_policy("namespace", ns, claims_in, pools, max_sandboxes, max_lifetime_seconds)}{more}
[backend]
kind = "kubernetes"

[backend.kubernetes]
connection = "kubeconfig"
kubeconfig_file = "{identity.kubeconfig}"
ready_timeout_seconds = 60
{backend}""")
    return path


def _policy(
    name: str, caller: str, claims_in: str, pools: Sequence[str], most: int, lifetime: int
) -> str:
    """A ``[[policies]]`` table admitting the ServiceAccounts of namespace ``caller``."""
    return f"""\
[[policies]]
name = "{name}"
issuer = "cluster"
subject = "system:serviceaccount:{caller}:*"
claims = {{ "kubernetes.io.namespace" = "{caller}" }}
warm_pools = {json.dumps(list(pools))}
namespace = "{claims_in}"
max_sandboxes = {most}
max_lifetime_seconds = {lifetime}

"""


class Replica:
    """One broker replica in this process (see the module); ``url`` once started."""

    def __init__(self, config_path: Path) -> None:
        self.config = load_config(config_path)
        served = app_factory(self.config)
        assert isinstance(served.app, ConfiguredBroker)
        self.broker: ConfiguredBroker = served.app
        self._app = with_probes(served.app, served.ready, served.degraded)
        self.url = f"https://127.0.0.1:{self.config.server.port}"
        self._loop = asyncio.new_event_loop()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Replica({self.url})"

    @property
    def backend(self) -> KubernetesBackend:
        assert self.broker.kube is not None
        return self.broker.kube

    def start(self, *, ready: bool = True, timeout: float = 30.0) -> Replica:
        settings = self.config.server
        sock = bind(settings.host, settings.port)
        config = uvicorn.Config(
            self._app, ssl_certfile=str(settings.tls_cert_file),
            ssl_keyfile=str(settings.tls_key_file), lifespan="on", log_level="warning",
            access_log=False, http="h11", ws="none", loop="asyncio",
            timeout_graceful_shutdown=2, server_header=False,
        )  # fmt: skip
        server = self._server = _Server(config, None, settings.request_head_seconds)

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            with contextlib.suppress(BaseException):
                self._loop.run_until_complete(server.serve(sockets=[sock]))
            sock.close()

        self._thread = threading.Thread(target=run, name=f"replica-{settings.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "did not start"
            time.sleep(0.01)
        if ready:
            self.wait_ready(timeout)
        return self

    def readyz(self) -> tuple[int, dict[str, Any]]:
        ca = self.config.server.tls_cert_file.parent / "ca.pem"
        with httpx.Client(verify=ssl.create_default_context(cafile=str(ca))) as c:
            answer = c.get(self.url + "/readyz")
        return answer.status_code, answer.json()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while (answer := self.readyz())[0] != 200:
            assert time.monotonic() < deadline, f"{self} not ready: {answer}"
            time.sleep(0.05)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the replica's event loop (its backend's objects live there)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def on_loop(self, function: Callable[[], T], timeout: float = 30.0) -> T:
        """Call ``function`` on the replica's event loop."""

        async def run() -> T:
            return function()

        return self.call(run(), timeout)

    def kill(self) -> None:
        """Die: every connection dropped without an answer, no shutdown (claims stay)."""
        server = self._server
        assert server is not None

        def drop() -> None:
            for connection in list(server.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()
            server.force_exit = server.should_exit = True

        self._loop.call_soon_threadsafe(drop)
        self._join()

    def stop(self) -> None:
        if self._server is not None and self._thread is not None and self._thread.is_alive():
            self._server.should_exit = True
            self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join(30)
        if not self._loop.is_closed():  # what a killed replica left: closed here, after it
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(asyncio.wait_for(self.broker.shutdown(), 10))
            left = asyncio.all_tasks(self._loop)  # a killed replica's requests and lifespan
            for task in left:
                task.cancel()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            self._loop.close()


def sdk_environ(
    kube: KubeAPIServer,
    namespace: str,
    replica: Replica,
    token_file: Path,
    *,
    protocol: str = "v1",
    service_account: str = "agent",
    audiences: Sequence[str] | None = None,
) -> dict[str, str]:
    """The SDK's environment for ``replica``: a TokenRequest token of ``service_account``
    (audiences: the replica's URL, or ``audiences``) in ``token_file``."""
    with contextlib.suppress(Exception):
        kube.create_service_account(namespace, service_account)
    token_file.write_text(
        kube.token_request(namespace, service_account, list(audiences or [replica.url]))
    )
    ca = replica.config.server.tls_cert_file.parent / "ca.pem"
    return {
        "AGENT_SANDBOX_BROKER_URL": replica.url,
        "AGENT_SANDBOX_CA_BUNDLE": str(ca),
        "AGENT_SANDBOX_TOKEN_FILE": str(token_file),
        "AGENT_SANDBOX_BROKER_PROTOCOL": protocol,
        "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
    }


SdkReplica = Callable[..., tuple[Replica, dict[str, str]]]
"""tests/kube's ``sdk_replica`` and ``python_replica`` fixtures: ``start(protocol="v1",
**config)``, a started replica and the SDK's environment for it (:func:`sdk_environ`)."""


def token_for(kube: KubeAPIServer, namespace: str, *replicas: Replica) -> str:
    """One token of ``namespace``'s ServiceAccount ``agent`` for every replica's audience."""
    with contextlib.suppress(Exception):
        kube.create_service_account(namespace, "agent")
    return kube.token_request(namespace, "agent", [r.url for r in replicas])


@contextlib.contextmanager
def replica_client(replica: Replica, token: str) -> Iterator[httpx.Client]:
    """A plain HTTP client of ``replica``'s v1 API as the caller of ``token``."""
    ca = replica.config.server.tls_cert_file.parent / "ca.pem"
    with httpx.Client(
        base_url=replica.url,
        verify=ssl.create_default_context(cafile=str(ca)),
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
        trust_env=False,
    ) as client:
        yield client


def claims_in(
    kube: KubeAPIServer, namespace: str, *, deleting: bool = False
) -> list[dict[str, Any]]:
    """The namespace's SandboxClaims: those not being deleted (``deleting``: all of them)."""
    items: list[dict[str, Any]] = kube.get(collection(CLAIM, namespace))["items"]
    return [c for c in items if deleting or not c["metadata"].get("deletionTimestamp")]


def claim_of(kube: KubeAPIServer, namespace: str, name: str) -> dict[str, Any] | None:
    """The SandboxClaim ``name``, or ``None`` when there is none."""
    try:
        return kube.get(path(CLAIM, namespace, name))
    except KubeError as exc:
        if exc.status_code == 404:
            return None
        raise


def shutdown_time(claim: dict[str, Any]) -> float:
    """A claim's ``spec.lifecycle.shutdownTime``, as a timestamp."""
    return datetime.fromisoformat(claim["spec"]["lifecycle"]["shutdownTime"]).timestamp()
