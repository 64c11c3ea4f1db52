"""Fixtures of the Kubernetes tests: ONE real kube-apiserver (and etcd) per pytest session.

The binaries come from ``.ci/kube-tools`` (see ``tests/_support/kube.py``). Without them the
tests skip, saying how to build them, unless ``AGENT_SANDBOX_REQUIRE_KUBE`` is set (CI sets
it): then every test that needs the server errors, naming what is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._support._oci import images_wait
from tests._support._pod_containers import runtime_pods
from tests._support.broker_server import Pki
from tests._support.controller import StandInController
from tests._support.kube import (
    ENV_REQUIRE,
    KubeAPIServer,
    KubeTools,
    KubeToolsMissing,
    build_wait,
    find_kube_tools,
    free_ports,
    kube_required,
)
from tests._support.kube_broker import (
    BrokerIdentity,
    Replica,
    SdkReplica,
    sdk_environ,
    write_config,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """While ``.ci/kube-tools --background`` is still building (a new machine: minutes), the
    time limit of each test that needs the binaries includes the wait for them: the first such
    test waits in its setup, and pytest-timeout's limit (300 s) must not cut that short; the
    same for a ``.ci/images --background`` still building (the tests that run the images)."""
    wait = build_wait() + images_wait()
    if not wait or not config.pluginmanager.hasplugin("timeout"):
        return
    limit = wait + float(config.getini("timeout") or 300)
    for item in items:
        if "kube_tools" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture(scope="session")
def kube_tools() -> KubeTools:
    """etcd and kube-apiserver (waits for a background ``.ci/kube-tools`` build)."""
    try:
        return find_kube_tools()
    except KubeToolsMissing as exc:
        missing = str(exc)
    if kube_required():
        pytest.fail(f"{ENV_REQUIRE} is set, and {missing}", pytrace=False)
    pytest.skip(missing)


@pytest.fixture(scope="session")
def kube(kube_tools: KubeTools) -> Iterator[KubeAPIServer]:
    """The session's API server, with the stand-in agent-sandbox CRDs installed. Tests share
    it: each works in its own namespace (``namespace``); nothing deletes namespaces (1.20
    without kube-controller-manager would leave them Terminating)."""
    with KubeAPIServer(kube_tools) as server:
        yield server


@pytest.fixture
def namespace(kube: KubeAPIServer) -> str:
    """A fresh namespace of the session's API server."""
    return kube.create_namespace()


@pytest.fixture
def controller(kube: KubeAPIServer, namespace: str) -> Iterator[StandInController]:
    """The stand-in agent-sandbox controller (tests/_support/controller.py) on the session's
    API server, watching the test's own namespace; stopped (every pod's processes killed) at
    the end of the test."""
    with StandInController(kube, [namespace]) as stand_in:
        yield stand_in


# ------------------------------------------------------------------------------ the broker


@pytest.fixture
def broker_pki(tmp_path: Path) -> Pki:
    """The broker's serving certificate (a CA made now; ``ca.pem`` beside it)."""
    folder = tmp_path / "broker-pki"
    folder.mkdir()
    pki = Pki(folder)
    pki.write(pki.issue())
    return pki


@pytest.fixture
def identity(kube: KubeAPIServer, namespace: str, tmp_path: Path) -> BrokerIdentity:
    """The broker's ServiceAccount in the test's namespace, bound to deploy/'s ClusterRole."""
    return BrokerIdentity(kube, namespace, tmp_path)


@pytest.fixture
def python_pool(controller: StandInController, namespace: str) -> str:
    """Template ``python`` and its warm pool ``python``, empty (claims start cold). Its pods
    are the example template's (deploy/examples/awx-runtime.yaml): real containers of the
    runtime image (``_pod_containers``; host processes only without the image, outside CI)."""
    controller.create_template(namespace, "python", pod_spec=runtime_pods(controller))
    controller.create_warm_pool(namespace, "python", "python", replicas=0)
    return "python"


@pytest.fixture
def replica_factory(
    identity: BrokerIdentity, broker_pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Replica]]:
    """``start(port=None, **config)``: a broker replica (``write_config``'s keywords), started
    and ready; every one stopped at the end."""
    from k8s_agent_sandbox_awx import clear_credential_cache

    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    started: list[Replica] = []

    def start(port: int | None = None, *, ready: bool = True, **config: Any) -> Replica:
        port = port or free_ports(1)[0]
        path = write_config(tmp_path / f"broker-{port}.toml", identity, broker_pki, port, **config)
        replica = Replica(path)
        started.append(replica)
        return replica.start(ready=ready)

    clear_credential_cache()
    yield start
    for replica in started:
        replica.stop()
    clear_credential_cache()


@pytest.fixture
def sdk_replica(
    kube: KubeAPIServer,
    namespace: str,
    replica_factory: Callable[..., Replica],
    tmp_path: Path,
) -> SdkReplica:
    """``start(protocol="v1", **config)``: a replica (``replica_factory``'s keywords) and the
    SDK's environment for it in ``protocol`` (``sdk_environ``: a token of the namespace's
    ServiceAccount ``agent`` for the replica's URL, in ``tmp_path / "token"``)."""

    def start(protocol: str = "v1", **config: Any) -> tuple[Replica, dict[str, str]]:
        replica = replica_factory(**config)
        token_file = tmp_path / "token"
        return replica, sdk_environ(kube, namespace, replica, token_file, protocol=protocol)

    return start


@pytest.fixture
def python_replica(
    controller: StandInController, python_pool: str, sdk_replica: SdkReplica
) -> SdkReplica:
    """``sdk_replica``, with the stand-in controller watching the test's namespace and the
    empty warm pool ``python`` (``python_pool``) made first: where most of these tests start."""
    return sdk_replica
