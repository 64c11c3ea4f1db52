"""What ``agent-sandbox-awx broker serve`` serves: the broker app for a configuration.

:func:`app_factory` builds the same :class:`._app.BrokerApp` the local stack runs, over the
backend ``[backend] kind`` chooses, with the configuration's issuers and policies
(:func:`._identity_config.identity_from_config`) and its control-plane dialects:

- ``local``: :class:`.backends._local_claims.LocalBackend` over
  :class:`.backends._local.LocalProcessBackend` with ``[backend.local] templates`` (each
  template is also a warm pool of its name; ``python-sandbox-warmpool`` is ``python``, as in
  ``LocalBroker``). NO ISOLATION: host processes.
- ``kubernetes``: :class:`.backends.kubernetes._backend.KubernetesBackend` over the broker's
  own connection (in-cluster or a kubeconfig), which also reviews tokens for ``tokenreview``
  issuers.

At start (the ASGI lifespan) every issuer's keys are loaded (again every few seconds for one
that failed) and the backend started (Kubernetes: the RBAC check, then the claim cache);
``/readyz`` is ready once every issuer has keys (or its API server answered) and the backend
is (Kubernetes: the API server answered, the RBAC holds, the claims are listed). At the end
everything is closed (the local backend deletes its sandboxes; a cluster's claims stay).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from ._app import BrokerApp
from ._identity_config import identity_from_config
from ._relay import install_log_filter
from ._rpc import DEFAULT_WARM_POOL
from .backends._interface import Backend
from .backends._local import RUNTIMES_DIR_PREFIX, LocalProcessBackend, sweep_dead_owners
from .backends._local_claims import LocalBackend
from .backends.kubernetes._api import KubeClient
from .backends.kubernetes._api_config import KubeConfig, from_kubeconfig, in_cluster
from .backends.kubernetes._backend import KubernetesBackend, KubernetesSettings
from .backends.kubernetes._routes import RouteSettings
from .config import CALLER_NAMESPACE, BrokerConfig, KubernetesBackendConfig, LocalBackendConfig
from .server import ServedApp
from .server._probes import Receive, Scope, Send

__all__ = ["ConfiguredBroker", "app_factory", "kubernetes_backend", "local_backend"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker")

KEYS_RETRY_SECONDS: Final = 5.0
"""How often the keys of an issuer whose first load failed are fetched again."""


def app_factory(config: BrokerConfig) -> ServedApp:
    """The app ``broker serve`` runs for ``config``, and its readiness check."""
    broker = ConfiguredBroker(config)
    return ServedApp(broker, broker.readiness)


def kube_config(settings: KubernetesBackendConfig) -> tuple[KubeConfig, str]:
    """The broker's connection to its API server, and who it is there (for messages)."""
    if settings.connection == "kubeconfig":
        assert settings.kubeconfig_file is not None  # the configuration's rule
        config = from_kubeconfig(settings.kubeconfig_file, context=settings.context)
        return config, f"the broker's identity ({config.source})"
    return in_cluster(), "the broker's ServiceAccount"


def kubernetes_backend(
    config: BrokerConfig, client: KubeClient, identity: str
) -> KubernetesBackend:
    """The Kubernetes backend of ``config`` over ``client``."""
    settings = config.backend.kubernetes
    assert settings is not None  # kind = "kubernetes" has its table (the configuration's rule)
    namespaces = [p.namespace for p in config.policies]
    pools = dict.fromkeys(pool for p in config.policies for pool in p.warm_pools)
    routes = RouteSettings(
        data_plane=settings.data_plane,
        router_url=settings.router_url,
        router_token_file=settings.router_token_file,
        router_ca_file=settings.router_ca_file,
        runtime_port=settings.runtime_port,
        allow_loopback_pod_ips=settings.allow_loopback_pod_ips,
    )
    return KubernetesBackend(
        client,
        KubernetesSettings(
            namespaces=None if CALLER_NAMESPACE in namespaces else tuple(sorted(set(namespaces))),
            templates=tuple(pools),
            routes=routes,
            ready_timeout_seconds=settings.ready_timeout_seconds,
            tokenreview=any(i.verification == "tokenreview" for i in config.issuers),
            identity=identity,
        ),
    )


def local_backend(settings: LocalBackendConfig) -> LocalBackend:
    """The local backend (host processes, NO isolation) with the configured templates."""
    sweep_dead_owners(RUNTIMES_DIR_PREFIX)  # of brokers whose process died
    templates: dict[str, str | tuple[str, ...] | None] = {
        name: None if command == "" else command for name, command in settings.templates.items()
    }
    warm_pools = {name: name for name in templates}
    if "python" in templates:
        warm_pools.setdefault(DEFAULT_WARM_POOL, "python")
    return LocalBackend(LocalProcessBackend(), templates=templates, warm_pools=warm_pools)


class ConfiguredBroker:
    """The ASGI app of a configured broker (see the module): the lifespan here, every request
    to its :class:`BrokerApp`."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.kube: KubernetesBackend | None = None
        backend: Backend
        if config.backend.kind == "kubernetes":
            assert config.backend.kubernetes is not None
            connection, identity = kube_config(config.backend.kubernetes)
            client = KubeClient(connection)
            backend = self.kube = kubernetes_backend(config, client, identity)
            verifier, policies = identity_from_config(config, reviewer=client)
        else:
            backend = local_backend(config.backend.local or LocalBackendConfig())
            verifier, policies = identity_from_config(config)
        self.verifier = verifier
        self.app = BrokerApp(
            verifier=verifier, policies=policies, backend=backend,
            protocols=config.server.protocols,
        )  # fmt: skip
        self._keys: asyncio.Task[None] | None = None
        install_log_filter()

    def __repr__(self) -> str:
        return f"ConfiguredBroker({str(self.config.path)!r}, backend={self.config.backend.kind})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self.app(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            event = (await receive())["type"]
            if event == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif event == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        """Load the issuers' keys (in the background until each has them) and start the
        backend."""
        if self.kube is not None:
            self.kube.start()
        else:  # (logged once serving: the server's log handlers are in place by then)
            log.warning(
                "the local backend runs sandboxes as host processes with NO isolation "
                "(development and tests only)"
            )
        self._keys = asyncio.get_running_loop().create_task(self._load_keys())

    async def _load_keys(self) -> None:
        while True:
            loaded = await self.verifier.load()
            failed = sorted(name for name, ok in loaded.items() if not ok)
            if not failed:
                return
            log.warning("no keys yet for issuer(s) %s; again in %gs", failed, KEYS_RETRY_SECONDS)
            await asyncio.sleep(KEYS_RETRY_SECONDS)

    async def shutdown(self) -> None:
        """Close everything this broker holds (the local backend deletes its sandboxes)."""
        if self._keys is not None:
            self._keys.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keys
        await self.app.shutdown()

    def readiness(self) -> dict[str, str]:
        """What is not ready: ``{"issuer NAME": why, "kubernetes": why}`` (``{}``: ready)."""
        not_ready: dict[str, str] = {}
        for name, status in self.verifier.readiness().items():
            if not status.get("ready"):
                not_ready[f"issuer {name}"] = str(status.get("last_error") or _NO_KEYS)
        if self.kube is not None:
            not_ready.update(self.kube.readiness())
        return not_ready


_NO_KEYS: Final = "no keys loaded yet"
