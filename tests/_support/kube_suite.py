"""The client's end-to-end suite through the Kubernetes-backed broker
(tests/kube/test_client_suite.py).

``KubeSuite`` is, for one test module, what the local brokers of tests/_support/brokers.py are for
the client tests: the session's real API server with namespaces ``default``, ``team-a`` and
``team-b`` (the ones the client tests' callers use), the stand-in controller watching them, a
template and an empty warm pool ``python`` in each, the broker's ServiceAccount (its deploy/
ClusterRole bound in each) and ``broker serve`` replicas started on first use, one per
(policy, dialect): ``default`` (the local broker's default policy: 5 sandboxes, 3600 s) and
``files`` (``files_broker``'s: 10 sandboxes, lifetimes capped at ``FILES_POLICY_CAP``); under
``v1`` a replica serving both dialects, under ``rpc`` one serving only ``/rpc`` (the client finds
out which itself), as the local brokers do.

``SuiteBroker`` is one replica with the surface of a ``LocalBroker`` that the reused tests use:
``environ(kind, namespace=, service_account=, token_file=)`` (a TokenRequest token of that
ServiceAccount for the replica's URL), ``claims()`` (the live SandboxClaims in the API server),
``reset()`` (every claim deleted and gone), ``set_readiness_delay()`` (the stand-in's),
``url`` and ``ca_bundle``. What only a local broker can do (inject faults, count executions,
revoke a token, issue a GitLab token) it does not have: the tests that need it are not reused.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from tests._support._agent_sandbox import CLAIM_EXPIRED
from tests._support._api import CLAIM, collection
from tests._support._pod_containers import runtime_pods
from tests._support.broker_server import Pki
from tests._support.brokers import FILES_POLICY_CAP
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer, KubeError, free_ports
from tests._support.kube_broker import BrokerIdentity, Replica, write_config

CALLER_NAMESPACES: Final = ("default", "team-a", "team-b", "team-q")
POLICIES: Final = {
    "default": {"max_sandboxes": 5, "max_lifetime_seconds": 3600},
    "files": {"max_sandboxes": 10, "max_lifetime_seconds": FILES_POLICY_CAP},
}
POOLS: Final = ("python", "tuned", "orphan")
"""The policies' warm pools: ``orphan`` does not exist (as the local ``/rpc`` broker's)."""
TUNED: Final = {"SANDBOX_COMMAND_MAX_RUNNING": "64", "SANDBOX_FS_READ_MAX_BYTES": "1000"}
"""The runtime settings of template ``tuned`` (its container's env): on Kubernetes the runtime's
settings are the template's, never a create's ``env`` (docs/broker/kubernetes.md)."""
PROTOCOLS: Final = {"v1": ("v1", "rpc"), "rpc": ("rpc",)}
MANAGED: Final = "app.kubernetes.io/managed-by=agent-sandbox-awx-broker"


class SuiteBroker:
    """One ``broker serve`` replica, used as the client tests use a local broker (see the
    module)."""

    def __init__(self, suite: KubeSuite, replica: Replica) -> None:
        self.suite, self.replica = suite, replica
        self.url = replica.url
        self.ca_bundle = str(replica.config.server.tls_cert_file.parent / "ca.pem")

    def __repr__(self) -> str:
        return f"SuiteBroker({self.url})"

    def environ(
        self,
        kind: str = "kubernetes",
        *,
        namespace: str = "default",
        service_account: str = "default",
        token_file: str | Path | None = None,
        **_ignored: Any,
    ) -> dict[str, str]:
        """``AGENT_SANDBOX_BROKER_URL``, ``AGENT_SANDBOX_CA_BUNDLE`` and a projected-style token
        file: a TokenRequest token of ``service_account`` in ``namespace`` for this replica."""
        if kind != "kubernetes":
            raise ValueError(f"the Kubernetes-backed suite has only Kubernetes callers, not {kind}")
        if namespace not in CALLER_NAMESPACES:
            raise ValueError(f"namespace {namespace!r} is none of {CALLER_NAMESPACES}")
        path = Path(token_file) if token_file is not None else self.suite.new_token_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.suite.token(namespace, service_account, self.url))
        return {
            "AGENT_SANDBOX_BROKER_URL": self.url,
            "AGENT_SANDBOX_CA_BUNDLE": self.ca_bundle,
            "AGENT_SANDBOX_TOKEN_FILE": str(path),
        }

    def claims(self, *, include_deleted: bool = False) -> list[dict[str, Any]]:
        """The broker's live SandboxClaims in the callers' namespaces: neither being deleted
        nor expired (at ``shutdownTime`` upstream first writes ``Ready=False`` reason
        ``ClaimExpired``, then deletes the claim; a local broker deletes at once). The API
        server keeps no deleted claims: ``include_deleted`` counts the live ones too, so a
        test's "nothing left behind" still sees a claim that was left."""
        del include_deleted
        return [c for c in self.suite.claims() if not _going(c)]

    def reset(self) -> None:
        self.suite.reset()

    def set_readiness_delay(self, seconds: float) -> None:
        """New pods become Ready this long after their runtime answers (the stand-in's)."""
        self.suite.controller.ready_delay = seconds


def _going(claim: dict[str, Any]) -> bool:
    conditions = (claim.get("status") or {}).get("conditions") or ()
    expired = any(c.get("reason") == CLAIM_EXPIRED for c in conditions)
    return expired or bool(claim["metadata"].get("deletionTimestamp"))


class KubeSuite:
    """The namespaces, controller, identity and replicas of the suite (see the module)."""

    def __init__(self, kube: KubeAPIServer, folder: Path) -> None:
        self.kube, self.folder = kube, folder
        self._stack = contextlib.ExitStack()
        self._tokens = itertools.count()
        self._accounts: set[tuple[str, str]] = set()
        self._brokers: dict[tuple[str, str], SuiteBroker] = {}
        for name in CALLER_NAMESPACES:
            kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        self.controller = self._stack.enter_context(StandInController(kube, CALLER_NAMESPACES))
        try:
            self.pod_spec = runtime_pods(self.controller)
            for name in CALLER_NAMESPACES:
                self._apply_template(name)
            self.identity = BrokerIdentity(kube, kube.create_namespace(), folder)
            for name in CALLER_NAMESPACES:
                self.identity.bind(name)
            (folder / "pki").mkdir()
            self.pki = Pki(folder / "pki")
            self.pki.write(self.pki.issue())
        except BaseException:
            self._stack.close()
            raise

    def _apply_template(self, namespace: str) -> None:
        """Templates ``python`` and ``tuned`` (:data:`TUNED`), with upstream's default
        ``envVarsInjectionPolicy`` (``Disallowed``: a create's ``env`` never goes into the pod,
        its commands get it from the broker), and an empty warm pool of each (claims start
        cold); kept if there already. Their pods are the example template's
        (deploy/examples/awx-runtime.yaml): real containers of the runtime image
        (``_pod_containers``); without the image, the stand-in controller's host processes."""
        for name in ("python", "tuned"):
            with contextlib.suppress(KubeError):
                self.controller.create_template(namespace, name, pod_spec=self._pod_spec(name))
            with contextlib.suppress(KubeError):
                self.controller.create_warm_pool(namespace, name, name, replicas=0)

    def _pod_spec(self, template: str) -> dict[str, Any]:
        """The pod spec of ``template`` (``tuned``: :data:`TUNED` in its container's env)."""
        spec: dict[str, Any] = copy.deepcopy(self.pod_spec) if self.pod_spec else {}
        spec.setdefault("containers", [{
            "name": "sandbox",
            "image": "stand-in/python-runtime:local",
            "ports": [{"containerPort": self.controller.port, "protocol": "TCP"}],
        }])  # fmt: skip
        if template == "tuned":
            container = spec["containers"][0]
            tuned = [{"name": k, "value": v} for k, v in TUNED.items()]
            container["env"] = [*container.get("env", []), *tuned]
        return spec

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.reset()
        for broker in self._brokers.values():
            broker.replica.stop()
        self._stack.close()

    def broker(self, policy: str, dialect: str) -> SuiteBroker:
        """The replica of ``policy`` (``POLICIES``) for ``dialect``, started on first use."""
        if (policy, dialect) not in self._brokers:
            [port] = free_ports(1)
            path = write_config(
                self.folder / f"broker-{policy}-{dialect}.toml", self.identity, self.pki, port,
                protocols=PROTOCOLS[dialect], callers=CALLER_NAMESPACES, pools=POOLS,
                **POLICIES[policy],  # type: ignore[arg-type]
            )  # fmt: skip
            self._brokers[policy, dialect] = SuiteBroker(self, Replica(path).start())
        return self._brokers[policy, dialect]

    def new_token_path(self) -> Path:
        return self.folder / "tokens" / f"token-{next(self._tokens)}" / "agent-sandbox-token"

    def token(self, namespace: str, service_account: str, audience: str) -> str:
        if (namespace, service_account) not in self._accounts:
            with contextlib.suppress(KubeError):  # it may exist: an earlier module's
                self.kube.create_service_account(namespace, service_account)
            self._accounts.add((namespace, service_account))
        return self.kube.token_request(namespace, service_account, audience)

    def claims(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for name in CALLER_NAMESPACES:
            listed = self.kube.admin.get(
                collection(CLAIM, name), params={"labelSelector": MANAGED}
            ).json()
            found.extend(listed["items"])
        return found

    def reset(self, timeout: float = 30.0) -> None:
        """Every claim of the broker deleted and gone (its Sandbox and pod with it); the
        stand-in's readiness delay back to none."""
        self.controller.ready_delay = 0.0
        for name in CALLER_NAMESPACES:
            self.kube.admin.delete(collection(CLAIM, name), params={"labelSelector": MANAGED})
        deadline = time.monotonic() + timeout
        while self.claims():
            assert time.monotonic() < deadline, f"claims left: {self.claims()}"
            time.sleep(0.05)


@contextlib.contextmanager
def kube_suite(kube: KubeAPIServer, folder: Path) -> Iterator[KubeSuite]:
    suite = KubeSuite(kube, folder)
    try:
        yield suite
    finally:
        suite.close()
