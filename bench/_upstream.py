"""Upstream's client (k8s_agent_sandbox ``Sandbox``) aimed at an address of the benchmark's
choosing, for bench_paths.py and bench_kube_hop.py: no cluster, so no kubeconfig is loaded and
no pod IP is looked up (no ``X-Sandbox-Pod-IP`` header). Their paths A and B:
:func:`upstream_paths`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k8s_agent_sandbox.models import SandboxDirectConnectionConfig
from k8s_agent_sandbox.sandbox import Sandbox as UpstreamSandbox


class NoKubernetes:
    """Stands in for upstream's ``K8sHelper`` (which would load a kubeconfig)."""

    injected_api_client = None

    def get_sandbox(self, name: str, namespace: str) -> dict[str, Any]:
        return {}


def upstream_sandbox(name: str, namespace: str, config: SandboxDirectConnectionConfig) -> Any:
    """Upstream's ``Sandbox`` of claim ``name`` in ``namespace``, over ``config``."""
    return UpstreamSandbox(
        claim_name=name,
        sandbox_id=name,
        namespace=namespace,
        connection_config=config,
        k8s_helper=NoKubernetes(),  # type: ignore[arg-type]
    )


class NoKubernetesAsync:
    """:class:`NoKubernetes` for upstream's ``AsyncSandbox``."""

    async def get_sandbox(self, name: str, namespace: str) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        return None


def upstream_async_sandbox(name: str, namespace: str, config: SandboxDirectConnectionConfig) -> Any:
    """Upstream's ``AsyncSandbox`` (its ``[async]`` extra) of claim ``name``, over ``config``."""
    from k8s_agent_sandbox.async_sandbox import AsyncSandbox as UpstreamAsyncSandbox

    return UpstreamAsyncSandbox(
        claim_name=name,
        sandbox_id=name,
        namespace=namespace,
        connection_config=config,
        k8s_helper=NoKubernetesAsync(),  # type: ignore[arg-type]
    )


def upstream_paths(
    name: str,
    namespace: str,
    runtime: str,
    broker_url: str,
    token: str,
    ca_cert: str,
    make: Callable[[str, str, SandboxDirectConnectionConfig], Any] = upstream_sandbox,
) -> tuple[Any, Any]:
    """Upstream's client (``make``: :func:`upstream_sandbox` or
    :func:`upstream_async_sandbox`) straight to the ``runtime`` URL (plain HTTP, path A), and
    through the broker at ``broker_url`` with ``token`` as its bearer, over HTTPS verified by
    ``ca_cert`` (path B)."""
    direct = make(name, namespace, SandboxDirectConnectionConfig(api_url=runtime))
    through_broker = make(
        name,
        namespace,
        SandboxDirectConnectionConfig(
            api_url=broker_url,
            extra_headers={"Authorization": f"Bearer {token}"},
            ca_cert=ca_cert,
        ),
    )
    return direct, through_broker
