"""What ``agent-sandbox-awx broker serve`` serves: the broker app for a configuration.

:func:`app_factory` builds the same :class:`._app.BrokerApp` the local stack runs, over the
backend ``[backend] kind`` chooses, with the configuration's issuers and policies
(:func:`._identity_config.identity_from_config`) and its control-plane dialects:

- ``local``: :class:`.backends.local._backend.LocalBackend` over
  :class:`.backends.local._processes.LocalProcessLauncher` with ``[backend.local] templates`` (each
  template is also a warm pool of its name; ``python-sandbox-warmpool`` is ``python``, as in
  ``LocalBroker``): in bubblewrap where it works (``$AGENT_SANDBOX_LOCAL_ISOLATION``), with
  every file the configuration names hidden from sandboxes (:func:`broker_files`), else host
  processes with NO isolation; the start-up message says which.
- ``kubernetes``: :class:`.backends.kubernetes._backend.KubernetesBackend` over the broker's
  own connection (in-cluster or a kubeconfig), which also reviews tokens for ``tokenreview``
  issuers.

At start (the ASGI lifespan) every issuer's keys are loaded (again every few seconds for one
that failed, then every ``jwks_cache_seconds``) and the backend started (Kubernetes: the RBAC
check, then the claim cache); ``/readyz`` is ready once every issuer has had keys (or its API
server answered) since start and the backend is ready (Kubernetes: the API server answered, the
RBAC holds, the claims are listed; with the router data plane, the router answered once). An
issuer that loses its keys later is ``degraded`` (named in ``/readyz``'s body; its tokens
``503 issuer_unavailable``), not unready, and so is a router that stops answering. At the end
everything is closed (the local backend deletes its sandboxes; a cluster's claims stay).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from ._app import BrokerApp
from ._identity_config import identity_from_config
from .backends._interface import Backend
from .backends.kubernetes._api import KubeClient
from .backends.kubernetes._api_config import KubeConfig, from_kubeconfig, in_cluster
from .backends.kubernetes._backend import KubernetesBackend, KubernetesSettings
from .backends.kubernetes._routes import RouteSettings
from .backends.local._backend import LocalBackend
from .backends.local._owned_dirs import RUNTIMES_DIR_PREFIX, sweep_dead_owners
from .backends.local._processes import LocalProcessLauncher
from .config import CALLER_NAMESPACE, BrokerConfig, KubernetesBackendConfig, LocalBackendConfig
from .config._schema import AUDIT_STREAMS
from .control._rpc import DEFAULT_WARM_POOL
from .dataplane._relay import install_log_filter
from .dataplane._ws_limits import WebSocketLimits
from .server import ServedApp
from .server._probes import Receive, Scope, Send

__all__ = ["ConfiguredBroker", "app_factory", "kubernetes_backend", "local_backend"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker")

KEYS_RETRY_SECONDS: Final = 5.0
"""How often the keys of an issuer whose first load failed are fetched again."""


def app_factory(config: BrokerConfig) -> ServedApp:
    """The app ``broker serve`` runs for ``config``, and its readiness check."""
    broker = ConfiguredBroker(config)
    return ServedApp(broker, broker.readiness, degraded=broker.degraded)


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
        router_pod_ip=settings.router_pod_ip,
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
            pod_label_domains=settings.pod_label_domains,
        ),
    )


def broker_files(config: BrokerConfig) -> list[str]:
    """The files of ``config`` no sandbox may read: the configuration file itself, the TLS
    pair, every token and kubeconfig file, the audit log. CA bundles are certificates, which
    are public (hidden too when they sit with these)."""
    files: list[Path | None] = [
        config.path,
        config.server.tls_cert_file,
        config.server.tls_key_file,
    ]
    files += [issuer.token_file for issuer in config.issuers]
    kube = config.backend.kubernetes
    if kube is not None:
        files += [kube.kubeconfig_file, kube.router_token_file]
    destination = config.audit.destination
    if isinstance(destination, Path) or destination not in AUDIT_STREAMS:
        files.append(Path(destination))
    return [str(path) for path in files if path is not None]


def local_backend(settings: LocalBackendConfig, hide: Sequence[str] = ()) -> LocalBackend:
    """The local backend with the configured templates: in bubblewrap where it works (``hide``:
    the broker's files, :func:`broker_files`), else host processes."""
    sweep_dead_owners(RUNTIMES_DIR_PREFIX)  # of brokers whose process died
    templates: dict[str, str | tuple[str, ...] | None] = {
        name: None if command == "" else command for name, command in settings.templates.items()
    }
    warm_pools = {name: name for name in templates}
    if "python" in templates:
        warm_pools.setdefault(DEFAULT_WARM_POOL, "python")
    runtimes = LocalProcessLauncher(hide=hide)
    return LocalBackend(runtimes, templates=templates, warm_pools=warm_pools)


class ConfiguredBroker:
    """The ASGI app of a configured broker (see the module): the lifespan here, every request
    to its :class:`BrokerApp`."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.kube: KubernetesBackend | None = None
        self.local: Any = None
        """The local backend's runtimes (``describe_isolation``), with ``kind = "local"``."""
        backend: Backend
        if config.backend.kind == "kubernetes":
            assert config.backend.kubernetes is not None
            connection, identity = kube_config(config.backend.kubernetes)
            client = KubeClient(connection)
            backend = self.kube = kubernetes_backend(config, client, identity)
            verifier, policies = identity_from_config(config, reviewer=client)
        else:
            local = local_backend(
                config.backend.local or LocalBackendConfig(), broker_files(config)
            )
            backend, self.local = local, local.runtimes
            verifier, policies = identity_from_config(config)
        self.verifier = verifier
        server = config.server
        self.app = BrokerApp(
            verifier=verifier,
            policies=policies,
            backend=backend,
            protocols=server.protocols,
            websocket_limits=WebSocketLimits(
                server.websocket_max_per_caller, server.websocket_max_message_bytes
            ),
        )
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
            describe = getattr(self.local, "describe_isolation", None)
            isolation = describe() if describe is not None else "with a backend of its own"
            log.warning(
                "the local backend runs sandboxes %s (development and tests only)", isolation
            )
        self._keys = asyncio.get_running_loop().create_task(self._load_keys())

    async def _load_keys(self) -> None:
        """Load every issuer's keys, again every few seconds while one fails, then refresh
        them every ``jwks_cache_seconds`` (the shortest), so that an idle broker's keys never
        age past ``jwks_max_stale_seconds`` while their issuer is up (a token also refreshes
        them when they are older)."""
        every = min((i.jwks_cache_seconds for i in self.config.issuers), default=300.0)
        while True:
            loaded = await self.verifier.load()
            failed = sorted(name for name, ok in loaded.items() if not ok)
            if failed:
                log.warning("no keys for issuer(s) %s; again in %gs", failed, KEYS_RETRY_SECONDS)
            await asyncio.sleep(min(every, KEYS_RETRY_SECONDS) if failed else every)

    async def shutdown(self) -> None:
        """Close everything this broker holds (the local backend deletes its sandboxes)."""
        if self._keys is not None:
            self._keys.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keys
        await self.app.shutdown()

    def readiness(self) -> dict[str, str]:
        """What is not ready: ``{"issuer NAME": why, "kubernetes": why}`` (``{}``: ready): the
        backend, and each issuer that has not had keys (or an API server's answer) since
        start. One that had them and lost them is :meth:`degraded`, not unready: every replica
        sees the same outage, so leaving the Service could not help its callers and would
        refuse every other issuer's."""
        had_keys = self.verifier.had_keys()
        down = self._issuers_down()
        not_ready = {f"issuer {name}": why for name, why in down.items() if not had_keys[name]}
        if self.kube is not None:
            not_ready.update(self.kube.readiness())
        return not_ready

    def degraded(self) -> dict[str, str]:
        """The issuers that had keys since start and cannot have them now (their tokens are
        refused ``503 issuer_unavailable``; the others' callers go on), and the router once it
        answered since start and does not now (the data plane fails; the control plane goes
        on)."""
        had_keys = self.verifier.had_keys()
        down = self._issuers_down()
        degraded = {f"issuer {name}": why for name, why in down.items() if had_keys[name]}
        if self.kube is not None:
            degraded.update(self.kube.degraded())
        return degraded

    def _issuers_down(self) -> dict[str, str]:
        """``{NAME: why}`` of each issuer whose keys are not loaded now."""
        return {
            name: str(status.get("last_error") or _NO_KEYS)
            for name, status in self.verifier.readiness().items()
            if not status.get("ready")
        }


_NO_KEYS: Final = "no keys loaded yet"
