"""``LocalBroker``: the whole local stack (issuers, broker, sandboxes) in-process, on loopback."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import re
import secrets
import shutil
import socket
import ssl
import tempfile
import threading
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import trustme
import uvicorn

from ..broker._app import PROTOCOLS, BrokerApp
from ..broker._ports import ws_protocol
from ..broker._relay import install_log_filter
from ..broker._rpc import DEFAULT_WARM_POOL
from ..broker._v1 import sandbox_json
from ..broker.backends._isolation import ISOLATIONS, Isolation
from ..broker.backends._local import (
    RUNTIMES_DIR_PREFIX,
    LocalProcessBackend,
    owned_temp_dir,
    release_owned_dir,
    sweep_dead_owners,
)
from ..broker.backends._local_claims import (
    DEFAULT_KEEP_DELETED,
    DEFAULT_KEEP_DELETED_SECONDS,
    LocalBackend,
)
from ..broker.backends._runtimes import SandboxBackend
from ..broker.identity._policy import Policy, caller_namespace
from ..broker.identity._revocations import Revocations
from ..broker.identity._rules import IssuerPolicies
from ..broker.identity._verify import TokenVerifier
from ..broker.runtime._tree import remove_quietly
from ._faults import CutRule, DropRule, FaultLayer, Faults, FaultyRuntimes, UnavailableRule
from ._issuers import (
    GITLAB_ATTRIBUTES,
    AttributesRule,
    ClaimsRule,
    Issuer,
    kubernetes_attributes,
)
from ._messages import isolation_warning

if TYPE_CHECKING:
    from ..broker.observability._observer import Observer

log = logging.getLogger("k8s_agent_sandbox_awx.testing")
T = TypeVar("T")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

DEFAULT_KUBERNETES_POLICY = Policy(
    templates=("python",), namespace=caller_namespace, max_sandboxes=5, max_lifetime_seconds=3600
)

DEFAULT_GITLAB_POLICY = Policy(
    templates=("python",), namespace="gitlab-ci", max_sandboxes=5, max_lifetime_seconds=3600
)


class LocalBroker:
    """The local broker stack: OIDC issuers, the broker and local sandboxes, on 127.0.0.1.

    ``with LocalBroker() as broker:`` starts everything (HTTPS with a CA generated at start,
    one uvicorn server on a background thread) and stops and cleans up on exit.

    Arguments (all keyword-only, all optional):

    - ``templates``: template name -> runtime command line (``None``: the backend default).
      Default ``{"python": None}``.
    - ``runtime_command``: the default runtime command line (see ``DEFAULT_RUNTIME_COMMAND``).
    - ``backend``: a :class:`SandboxBackend` (default: :class:`LocalProcessBackend`).
    - ``kubernetes_policy`` / ``gitlab_policy``: the built-in providers' policies.
    - ``readiness_delay``: seconds a new sandbox stays ``Pending`` after its runtime is up.
    - ``skew_seconds``: clock skew allowed on ``exp``/``nbf``/``iat``; ``max_token_bytes``.
    - ``warn``: log the isolation warning at start (what a sandbox is and is not kept from).
    - ``isolation``: the default backend's, ``"auto"`` (bubblewrap when it works here, else
      none), ``"bwrap"`` or ``"none"``; default ``$AGENT_SANDBOX_LOCAL_ISOLATION``, else
      ``"auto"`` (see :class:`LocalProcessBackend`; ``isolation_info`` says which is in force).
    - ``protocols``: the control-plane dialects served on the one URL, ``("v1", "rpc")`` by
      default; ``("rpc",)`` makes every ``/v1/...`` answer 404 and ``("v1",)`` makes ``/rpc``
      answer 404, so that each dialect can be tested alone. The data plane serves both.
    - ``warm_pools``: extra ``/rpc`` warm pools, name -> template. Every template is also a
      warm pool of its own name, and ``python-sandbox-warmpool`` (the original package's
      default) is template ``python``. A warm pool naming a template that does not exist makes
      its claims fail with ``TemplateNotFound``; an unknown warm pool with ``WarmPoolNotFound``.
    - ``keep_deleted`` / ``keep_deleted_seconds``: the retention of deleted sandboxes' records
      (for ``claims(include_deleted=True)``, ``execution_count`` and create replays): the newest
      ``keep_deleted`` (default 1000), each for at most ``keep_deleted_seconds`` (default 3600)
      after its deletion; older ones are forgotten, so a long-running broker does not grow.
    - ``observer``: an :class:`~k8s_agent_sandbox_awx.broker.observability._observer.Observer`
      around the broker (its access log, audit log and metrics, as ``broker serve`` has them:
      docs/broker/operate.md); default none: the local broker stays quiet.

    WARNING: local sandboxes are host processes with NO isolation, or, with bubblewrap, processes
    in namespaces of their own, which are not a virtual machine (development and tests only).
    """

    def __init__(
        self,
        *,
        templates: Mapping[str, str | list[str] | None] | None = None,
        runtime_command: str | Sequence[str] | None = None,
        backend: SandboxBackend | None = None,
        kubernetes_policy: Policy | None = None,
        gitlab_policy: Policy | None = None,
        readiness_delay: float = 0.0,
        skew_seconds: int = 30,
        max_token_bytes: int = 16 * 1024,
        host: str = "127.0.0.1",
        warn: bool = True,
        protocols: Sequence[str] = PROTOCOLS,
        warm_pools: Mapping[str, str] | None = None,
        keep_deleted: int = DEFAULT_KEEP_DELETED,
        keep_deleted_seconds: float = DEFAULT_KEEP_DELETED_SECONDS,
        isolation: str | None = None,
        observer: Observer | None = None,
    ) -> None:
        _check_retention(keep_deleted, keep_deleted_seconds)
        _check_isolation(isolation, backend)
        _check_protocols(protocols)
        self._templates: dict[str, str | list[str] | None] = dict(templates or {"python": None})
        self._runtime_command = runtime_command
        self._backend = backend
        self._isolation = isolation
        self._kubernetes_policy = kubernetes_policy or DEFAULT_KUBERNETES_POLICY
        self._gitlab_policy = gitlab_policy or DEFAULT_GITLAB_POLICY
        self._faults = Faults(readiness_delay)
        self._skew = skew_seconds
        self._max_token_bytes = max_token_bytes
        self._host = host
        self._warn = warn
        self._protocols = tuple(p for p in PROTOCOLS if p in protocols)
        self._warm_pools = {name: name for name in self._templates}
        if "python" in self._templates:
            self._warm_pools[DEFAULT_WARM_POOL] = "python"
        self._warm_pools.update(warm_pools or {})
        self._keep_deleted = keep_deleted
        self._keep_deleted_seconds = float(keep_deleted_seconds)
        self._lock = threading.Lock()
        self._issuers_by_url: dict[str, Issuer] = {}
        self._issuers_by_name: dict[str, Issuer] = {}
        self._uids: dict[tuple[str, ...], str] = {}
        self._counter = itertools.count(1000)
        self._rotators: list[tuple[threading.Event, threading.Thread]] = []
        self._tmp: str | None = None
        self._url: str | None = None
        self._ca_bundle: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
        self._app: BrokerApp | None = None
        self._store: LocalBackend | None = None
        self._jwks: _JwksClient | None = None
        self._revocations = Revocations()
        self._observer = observer
        self.startup_seconds: float | None = None

    def __repr__(self) -> str:
        return f"LocalBroker(url={self._url!r})"

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> LocalBroker:
        """Start the stack; returns ``self``. Takes a few hundred milliseconds."""
        if self._thread is not None:
            raise RuntimeError("this LocalBroker is already started")
        started = time.perf_counter()
        sweep_dead_owners(_TMP_PREFIX, RUNTIMES_DIR_PREFIX)  # of brokers whose process died
        self._tmp = owned_temp_dir(_TMP_PREFIX)
        sock, server_pem = self._listen_with_tls(self._tmp)
        try:
            self._app = self._make_app(self._tmp)
        except BaseException:  # isolation="bwrap" without a working bwrap, for one
            sock.close()
            self._cleanup_files()
            raise
        if self._warn:
            self._log_isolation()
        install_log_filter()
        served: Any = FaultLayer(self._app, self._faults, self._protocols)  # faults around it
        if self._observer is not None:  # and the observer around both: it sees what clients see
            served = self._observer.wrap_broker(self._app, served)
        self._server = uvicorn.Server(_uvicorn_config(served, server_pem))
        loop = asyncio.new_event_loop()
        self._loop = loop
        server = self._server
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(server.serve(sockets=[sock]))
            except BaseException as exc:  # reported to start() or logged at stop
                failure.append(exc)
            finally:
                sock.close()

        self._thread = threading.Thread(target=run, name="local-broker", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 15
        while not server.started:
            if failure or not self._thread.is_alive() or time.monotonic() > deadline:
                self._cleanup_files()
                raise RuntimeError(f"the local broker failed to start: {failure or 'timeout'}")
            time.sleep(0.002)
        atexit.register(self._atexit)
        self.startup_seconds = time.perf_counter() - started
        log.info("LocalBroker at %s started in %.3f s", self._url, self.startup_seconds)
        return self

    def _log_isolation(self) -> None:
        """The warning at start: which isolation is in force, and what it does not protect."""
        info = self.isolation_info
        log.warning(
            "LocalBroker: isolation %s. %s",
            info.describe() if info else "of the custom backend",
            isolation_warning(info.mode if info else None),
        )

    def _listen_with_tls(self, tmp: str) -> tuple[socket.socket, str]:
        """The listening socket (sets ``url``) and the server's certificate chain file, from a
        CA generated now (written to ``ca_bundle``)."""
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        self._url = f"https://{self._host}:{port}"
        ca = trustme.CA()
        server_cert = ca.issue_cert(self._host, "localhost")
        self._ca_bundle = os.path.join(tmp, "ca.pem")
        ca.cert_pem.write_to_path(self._ca_bundle)
        server_pem = os.path.join(tmp, "server.pem")
        server_cert.private_key_and_cert_chain_pem.write_to_path(server_pem)
        os.chmod(server_pem, 0o600)
        return sock, server_pem

    def _make_app(self, tmp: str) -> BrokerApp:
        """The built-in issuers, the backend and the ASGI application with both dialects."""
        assert self._url is not None and self._ca_bundle is not None
        self._jwks = _JwksClient(self._ca_bundle)
        self._add_issuer(
            "kubernetes",
            provider="kubernetes",
            policy=self._kubernetes_policy,
            attributes=kubernetes_attributes,
            audience_as_list=True,
        )
        self._add_issuer(
            "gitlab", provider="gitlab", policy=self._gitlab_policy, attributes=GITLAB_ATTRIBUTES
        )
        runtimes = self._backend or LocalProcessBackend(
            self._runtime_command,
            root_dir=os.path.join(tmp, "sandboxes"),
            isolation=self._isolation,
        )
        self._backend = runtimes
        self._store = LocalBackend(
            FaultyRuntimes(runtimes, self._faults),  # crashes and slow readiness, injected
            templates=self._templates,
            warm_pools=self._warm_pools,
            keep_deleted=self._keep_deleted,
            keep_deleted_seconds=self._keep_deleted_seconds,
        )
        verifier = TokenVerifier(
            audience=self._url,
            issuers=self._issuer_snapshot,
            http=self._jwks.client,  # the local issuers' documents: this broker's own URL
            skew_seconds=self._skew,
            max_token_bytes=self._max_token_bytes,
            is_revoked=self._revocations.is_revoked,
        )
        return BrokerApp(
            verifier=verifier,
            policies=IssuerPolicies(self._issuer_snapshot),
            backend=self._store,
            protocols=self._protocols,
            issuer_by_name=self._issuer_named,
        )

    def stop(self) -> None:
        """Delete every sandbox, stop the runtimes and the server, remove the temp files."""
        for event, _thread in self._rotators:
            event.set()
        self._rotators.clear()
        loop, thread, server, app = self._loop, self._thread, self._server, self._app
        if loop is not None and thread is not None and thread.is_alive() and app is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(app), loop).result(30)
            except Exception:
                log.exception("LocalBroker: clean shutdown failed; killing the runtimes")
                if self._backend is not None:
                    self._backend.kill_all_now()
        if server is not None:
            server.should_exit = True
            server.force_exit = True  # sandboxes are gone; do not wait for idle keep-alives
        if thread is not None:
            thread.join(10)
        if loop is not None and not loop.is_running():
            loop.close()
        self._thread = None
        self._loop = None
        with contextlib.suppress(Exception):
            atexit.unregister(self._atexit)
        self._cleanup_files()

    async def _shutdown(self, app: BrokerApp) -> None:
        await app.shutdown()
        if self._jwks is not None:
            await self._jwks.aclose()

    def _atexit(self) -> None:
        if self._backend is not None:
            self._backend.kill_all_now()
        self._cleanup_files()

    def _cleanup_files(self) -> None:
        if self._tmp is not None:  # never raises: a failure is logged (any depth is removed)
            remove_quietly(self._tmp, "the local broker's temporary directory")
            release_owned_dir(self._tmp)  # what could not be removed is a later start's

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        if self._loop is None or self._app is None:
            coro.close()
            raise RuntimeError("the LocalBroker is not running: use 'with LocalBroker() as b:'")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _require_app(self) -> BrokerApp:
        if self._app is None or self._url is None:
            raise RuntimeError("the LocalBroker is not running: use 'with LocalBroker() as b:'")
        return self._app

    def _require_store(self) -> LocalBackend:
        """The local backend: the sandboxes' records (``sandboxes``, ``history``)."""
        if self._store is None or self._url is None:
            raise RuntimeError("the LocalBroker is not running: use 'with LocalBroker() as b:'")
        return self._store

    # -- basic properties ----------------------------------------------------------------------
    @property
    def isolation_info(self) -> Isolation | None:
        """The sandboxes' isolation (``mode`` ``"bwrap"`` or ``"none"``, and why; ``describe()``
        for people), once started; ``None`` for a custom backend that does not say."""
        info = getattr(self._backend, "isolation_info", None)
        return info if isinstance(info, Isolation) else None

    @property
    def isolation(self) -> str | None:
        """``"bwrap"`` or ``"none"`` (see :attr:`isolation_info`)."""
        info = self.isolation_info
        return info.mode if info is not None else None

    @property
    def url(self) -> str:
        """The broker URL (``https://127.0.0.1:PORT``, no trailing slash); also the audience."""
        if self._url is None:
            raise RuntimeError("the LocalBroker is not started")
        return self._url

    @property
    def protocols(self) -> tuple[str, ...]:
        """The control-plane dialects this broker serves (``"v1"``, ``"rpc"``)."""
        return self._protocols

    @property
    def warm_pools(self) -> dict[str, str]:
        """The ``/rpc`` warm pools: name -> template."""
        return dict(self._warm_pools)

    @property
    def ca_bundle(self) -> str:
        """Path of the PEM CA bundle that verifies the broker's (and issuers') certificate."""
        if self._ca_bundle is None:
            raise RuntimeError("the LocalBroker is not started")
        return self._ca_bundle

    @property
    def kubernetes(self) -> Issuer:
        """The Kubernetes-like issuer (``<url>/issuers/kubernetes``)."""
        return self._issuers_by_name["kubernetes"]

    @property
    def gitlab(self) -> Issuer:
        """The GitLab-like issuer (``<url>/issuers/gitlab``)."""
        return self._issuers_by_name["gitlab"]

    @property
    def issuers(self) -> dict[str, Issuer]:
        with self._lock:
            return dict(self._issuers_by_name)

    # -- issuers -------------------------------------------------------------------------------
    def _issuer_snapshot(self) -> Mapping[str, Issuer]:
        with self._lock:
            return dict(self._issuers_by_url)

    def _issuer_named(self, name: str) -> Issuer | None:
        with self._lock:
            return self._issuers_by_name.get(name)

    def _forget_keys(self, issuer: Issuer) -> None:
        app = self._app
        if app is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(app.verifier.forget, issuer.url)

    def _add_issuer(
        self,
        name: str,
        *,
        provider: str,
        policy: Policy,
        claims: ClaimsRule = None,
        attributes: AttributesRule = None,
        algorithm: str = "RS256",
        audience_as_list: bool = False,
    ) -> Issuer:
        if not _DNS_LABEL.match(name):
            raise ValueError(f"issuer name {name!r} must be a DNS-1123 label")
        issuer = Issuer(
            name,
            f"{self.url}/issuers/{name}",
            provider=provider,
            policy=policy,
            default_audience=self.url,
            algorithm=algorithm,
            claims=claims,
            attributes=attributes,
            audience_as_list=audience_as_list,
            on_keys_changed=self._forget_keys,
        )
        with self._lock:
            if name in self._issuers_by_name:
                raise ValueError(f"an issuer named {name!r} already exists")
            self._issuers_by_name[name] = issuer
            self._issuers_by_url[issuer.url] = issuer
        return issuer

    def add_issuer(
        self,
        name: str,
        *,
        claims: ClaimsRule = None,
        policy: Policy | None = None,
        provider: str | None = None,
        attributes: AttributesRule = None,
        algorithm: str = "RS256",
        audience_as_list: bool = False,
    ) -> Issuer:
        """Add and trust a custom issuer at ``<url>/issuers/<name>``.

        - ``claims``: extra claims of every token it issues (a mapping, or a callable of the
          subject returning one); ``issue_token(..., claims=...)`` adds more per token.
        - ``policy``: its callers' :class:`Policy` (default: template ``python``, namespace
          ``name``).
        - ``provider``: the provider name the broker derives from this issuer (default ``name``).
        - ``attributes``: the claim names that are the provider's key attributes (or a callable
          of the claims); default: every non-registered scalar claim.
        - ``algorithm``: ``RS256`` or ``ES256``; ``audience_as_list``: ``aud`` as a list.
        """
        self._require_app()
        return self._add_issuer(
            name,
            provider=provider or name,
            policy=policy or Policy(templates=("python",), namespace=name),
            claims=claims,
            attributes=attributes,
            algorithm=algorithm,
            audience_as_list=audience_as_list,
        )

    def _stable_uid(self, *key: str) -> str:
        with self._lock:
            return self._uids.setdefault(key, str(uuid.uuid4()))

    def issue_kubernetes_token(
        self,
        namespace: str,
        service_account: str,
        audience: str | Sequence[str] | None = None,
        ttl: int = 3600,
        *,
        pod_name: str | None = None,
        claims: Mapping[str, Any] | None = None,
    ) -> str:
        """A projected ServiceAccount token (RS256) as the kubelet would mount it.

        Claims: ``iss``, ``sub`` = ``system:serviceaccount:NS:NAME``, ``aud`` (a list; default
        ``[broker.url]``), ``exp``, ``iat``, ``nbf`` (= ``iat``), ``jti`` and ``kubernetes.io``
        ``{namespace, serviceaccount{name, uid}, pod{name, uid}}``; ``claims`` overrides any.
        """
        pod = pod_name or f"{service_account}-local"
        info = {
            "namespace": namespace,
            "serviceaccount": {
                "name": service_account,
                "uid": self._stable_uid("sa", namespace, service_account),
            },
            "pod": {"name": pod, "uid": self._stable_uid("pod", namespace, pod)},
        }
        payload: dict[str, Any] = {"kubernetes.io": info}
        payload.update(claims or {})
        return self.kubernetes.issue_token(
            f"system:serviceaccount:{namespace}:{service_account}",
            payload,
            audience=audience,
            ttl=ttl,
        )

    def issue_gitlab_token(
        self,
        project_path: str,
        ref: str = "main",
        audience: str | Sequence[str] | None = None,
        ttl: int = 3600,
        *,
        ref_type: str = "branch",
        user_login: str = "local-developer",
        claims: Mapping[str, Any] | None = None,
    ) -> str:
        """A GitLab CI ``id_tokens`` token (RS256).

        ``sub`` = ``project_path:GROUP/PROJECT:ref_type:branch:ref:REF``; claims as GitLab sends
        them (ids as strings, ``ref_protected`` "true"/"false"); ``aud`` a string (default the
        broker URL); ``claims`` overrides any.
        """
        if "/" not in project_path:
            raise ValueError(f"project_path {project_path!r} must be GROUP/PROJECT")
        namespace_path = project_path.rsplit("/", 1)[0]
        pipeline_id = str(next(self._counter))
        payload: dict[str, Any] = {
            "namespace_id": self._numeric_id("ns", namespace_path),
            "namespace_path": namespace_path,
            "project_id": self._numeric_id("project", project_path),
            "project_path": project_path,
            "user_id": self._numeric_id("user", user_login),
            "user_login": user_login,
            "user_email": f"{user_login}@example.invalid",
            "pipeline_id": pipeline_id,
            "pipeline_source": "push",
            "job_id": str(next(self._counter)),
            "ref": ref,
            "ref_type": ref_type,
            "ref_path": f"refs/{'heads' if ref_type == 'branch' else 'tags'}/{ref}",
            "ref_protected": "true" if ref in ("main", "master") else "false",
            "runner_id": self._numeric_id("runner", "local"),
            "runner_environment": "self-hosted",
            "sha": secrets.token_hex(20),
        }
        payload.update(claims or {})
        return self.gitlab.issue_token(
            f"project_path:{project_path}:ref_type:{ref_type}:ref:{ref}",
            payload,
            audience=audience,
            ttl=ttl,
        )

    def _numeric_id(self, *key: str) -> str:
        with self._lock:
            value = self._uids.get(key)
            if value is None:
                value = self._uids[key] = str(next(self._counter))
            return value

    def rotate_keys(self, issuer: str = "kubernetes", *, retire_old: bool = False) -> str:
        """Rotate ``issuer``'s signing key (see :meth:`Issuer.rotate_key`); returns the new kid."""
        target = self._issuer_named(issuer)
        if target is None:
            raise KeyError(f"no issuer named {issuer!r}; known: {sorted(self.issuers)}")
        return target.rotate_key(retire_old=retire_old)

    def revoke_token(self, token: str) -> None:
        """Reject ``token`` from now on (``401 token_revoked``), by ``jti`` and by digest."""
        self._require_app()
        self._revocations.revoke(token)

    # -- token files and environment -----------------------------------------------------------
    def write_projected_token(
        self,
        path: str | os.PathLike[str],
        namespace: str = "default",
        service_account: str = "default",
        ttl: int = 3600,
        *,
        audience: str | Sequence[str] | None = None,
    ) -> str:
        """Write a Kubernetes token to ``path`` the way the kubelet does; returns the token.

        The directory gets a timestamped data directory, an atomically swapped ``..data``
        symlink and ``path`` as a symlink through ``..data``. Call again to rotate.
        """
        token = self.issue_kubernetes_token(namespace, service_account, audience, ttl)
        write_kubelet_style(os.fspath(path), token)
        return token

    def keep_projected_token_rotated(
        self,
        path: str | os.PathLike[str],
        namespace: str = "default",
        service_account: str = "default",
        ttl: int = 3600,
    ) -> str:
        """Write the token now and rewrite it at 80 % of its lifetime until :meth:`stop`."""
        token = self.write_projected_token(path, namespace, service_account, ttl)
        stop = threading.Event()

        def rotate() -> None:
            while not stop.wait(ttl * 0.8):
                try:
                    self.write_projected_token(path, namespace, service_account, ttl)
                except Exception:
                    log.exception("LocalBroker: rotating the projected token failed")

        thread = threading.Thread(target=rotate, name="token-rotator", daemon=True)
        thread.start()
        self._rotators.append((stop, thread))
        return token

    def environ(
        self,
        kind: str = "kubernetes",
        *,
        namespace: str = "default",
        service_account: str = "default",
        project_path: str = "group/project",
        ref: str = "main",
        ttl: int = 3600,
        token_file: str | os.PathLike[str] | None = None,
    ) -> dict[str, str]:
        """Environment variables that make ``Sandbox.create()`` work with zero arguments.

        Always ``AGENT_SANDBOX_BROKER_URL`` and ``AGENT_SANDBOX_CA_BUNDLE``; for
        ``kind="kubernetes"`` also ``AGENT_SANDBOX_TOKEN_FILE`` (a projected token written
        kubelet-style, to ``token_file`` or a fresh temp path); for ``kind="gitlab"``
        ``AGENT_SANDBOX_TOKEN`` (the id token, as a CI job would have it).
        """
        env = {"AGENT_SANDBOX_BROKER_URL": self.url, "AGENT_SANDBOX_CA_BUNDLE": self.ca_bundle}
        if kind == "kubernetes":
            if token_file is None:
                assert self._tmp is not None
                token_dir = tempfile.mkdtemp(prefix="token-", dir=self._tmp)
                token_file = os.path.join(token_dir, "agent-sandbox-token")
            self.write_projected_token(token_file, namespace, service_account, ttl)
            env["AGENT_SANDBOX_TOKEN_FILE"] = os.fspath(token_file)
        elif kind == "gitlab":
            env["AGENT_SANDBOX_TOKEN"] = self.issue_gitlab_token(project_path, ref, ttl=ttl)
        else:
            raise ValueError(f"kind must be 'kubernetes' or 'gitlab', not {kind!r}")
        return env

    # -- state and faults ----------------------------------------------------------------------
    def claims(self, *, include_deleted: bool = False) -> list[dict[str, Any]]:
        """The SandboxClaim manifests the broker created (live ones; all with include_deleted)."""
        store = self._require_store()
        with store.lock:
            store.prune_deleted()
            records = list(store.history) if include_deleted else list(store.sandboxes.values())
        return [r.manifest() for r in records]

    def sandboxes(self) -> list[dict[str, Any]]:
        """Every live sandbox as the API returns it (all owners)."""
        store = self._require_store()
        with store.lock:
            return [sandbox_json(r.state()) for r in store.sandboxes.values()]

    def sandbox_name(self, name: str) -> str:
        """The sandbox ``name`` names: under ``/rpc`` the client's ``Sandbox.name`` is the
        claim name create returned (``broker-…``), which this maps to the sandbox bound to it;
        any other name is returned as it is. Every method here that takes a sandbox name (or
        ``sandbox=``) accepts either."""
        store = self._require_store()
        with store.lock:
            store.prune_deleted()
            bound = next((r.name for r in store.history if r.claim_name == name), None)
        return bound or name

    def execution_count(self, name: str) -> int:
        """How many command-running requests (``POST /execute``, ``POST /commands``) the broker
        forwarded to sandbox ``name``: refused ones count too, as they reached the runtime."""
        store = self._require_store()
        name = self.sandbox_name(name)
        with store.lock:
            store.prune_deleted()
            record = store.sandboxes.get(name) or next(
                (r for r in store.history if r.name == name), None
            )
        if record is None:
            raise KeyError(f"no sandbox named {name!r}")
        return record.executions

    def runtime_pid(self, name: str) -> int | None:
        """The pid of sandbox ``name``'s runtime process (``None`` before it started)."""
        store = self._require_store()
        name = self.sandbox_name(name)
        with store.lock:
            record = store.sandboxes.get(name)
        return record.handle.pid if record is not None and record.handle is not None else None

    def _sandbox_or_none(self, name: str | None) -> str | None:
        return None if name is None else self.sandbox_name(name)

    def delete_all(self) -> None:
        """Delete every sandbox now (all owners) and wait until their runtimes are gone."""
        self._call(self._require_store().delete_all())

    def reset(self) -> None:
        """Delete every sandbox and clear every injected fault (the fixture calls it per test)."""
        self.delete_all()
        self.clear_faults()

    def set_readiness_delay(self, seconds: float) -> None:
        """New sandboxes stay ``Pending`` this long after their runtime is up (slow readiness)."""
        with self._faults.lock:
            self._faults.readiness_delay = seconds

    def inject_unavailable(
        self,
        count: int = 1,
        *,
        retry_after: int = 1,
        scope: str = "data",
        path: str | None = None,
        sandbox: str | None = None,
    ) -> None:
        """The next ``count`` matching requests get ``503 unavailable`` with ``Retry-After``.

        ``scope``: ``"data"`` (data plane), ``"control"`` (``/v1`` except healthz) or ``"any"``;
        ``path``: only requests whose path starts with it; ``sandbox``: only that sandbox.
        """
        if scope not in ("data", "control", "any"):
            raise ValueError("scope must be 'data', 'control' or 'any'")
        sandbox = self._sandbox_or_none(sandbox)
        with self._faults.lock:
            self._faults.unavailable.append(
                UnavailableRule(count, retry_after, scope, path, sandbox)
            )

    def drop_connection_after_execute(self, count: int = 1, *, sandbox: str | None = None) -> None:
        """The next ``count`` ``POST /execute`` or ``POST /commands``: the command starts, the
        runtime answers, then the connection drops."""
        sandbox = self._sandbox_or_none(sandbox)
        with self._faults.lock:
            self._faults.drops.append([count, sandbox])

    def cut_event_streams(
        self,
        *,
        after_events: int | None = None,
        after_seconds: float | None = None,
        sandbox: str | None = None,
    ) -> None:
        """From now on (until ``clear_faults``), every command event stream
        (``GET /commands/{id}/events``) ends cleanly after ``after_events`` NDJSON lines
        (heartbeats included) or ``after_seconds``, whichever comes first, at a line boundary,
        as a proxy that times out would end it. ``sandbox``: only that sandbox's streams."""
        if after_events is None and after_seconds is None:
            raise ValueError("give after_events, after_seconds or both")
        if after_events is not None and (isinstance(after_events, bool) or after_events < 1):
            raise ValueError(f"after_events must be an integer >= 1, not {after_events!r}")
        if after_seconds is not None and not after_seconds > 0:
            raise ValueError(f"after_seconds must be a number > 0, not {after_seconds!r}")
        sandbox = self._sandbox_or_none(sandbox)
        with self._faults.lock:
            self._faults.event_cuts.insert(0, CutRule(after_events, after_seconds, sandbox))

    def drop_event_stream_mid_line(
        self, count: int = 1, *, after_events: int = 0, sandbox: str | None = None
    ) -> None:
        """The next ``count`` command event streams that get that far: after ``after_events``
        whole NDJSON lines the broker sends half of the next line, then drops the connection
        (no end of the chunked body: the client sees a protocol error). ``sandbox``: only that
        sandbox's streams."""
        if isinstance(after_events, bool) or after_events < 0:
            raise ValueError(f"after_events must be an integer >= 0, not {after_events!r}")
        sandbox = self._sandbox_or_none(sandbox)
        with self._faults.lock:
            self._faults.event_drops.append(DropRule(count, after_events, sandbox))

    def crash_next_start(self, count: int = 1) -> None:
        """The next ``count`` sandboxes crash at startup: phase ``Failed``, reason
        ``RuntimeCrashed`` under ``/v1``; condition ``Ready``/``False``/``crashed`` under
        ``/rpc``."""
        if count < 0:
            raise ValueError("count must be >= 0")
        with self._faults.lock:
            self._faults.crashes = count

    def clear_faults(self) -> None:
        """Remove injected 503s, drops, start crashes, event-stream cuts and the readiness
        delay."""
        self._faults.clear()
        self.set_readiness_delay(0.0)


_TMP_PREFIX = "agent-sandbox-broker-"


class _JwksClient:
    """The one HTTPS client the broker fetches its local issuers' keys with (they are served
    by the broker itself, under the CA made at start); made on first use, on the loop."""

    def __init__(self, ca_bundle: str) -> None:
        self.ca_bundle = ca_bundle
        self._http: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                verify=ssl.create_default_context(cafile=self.ca_bundle),
                timeout=httpx.Timeout(5.0),
                follow_redirects=False,
                trust_env=False,
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def _check_protocols(protocols: Sequence[str]) -> None:
    if isinstance(protocols, str) or not protocols or not set(protocols) <= set(PROTOCOLS):
        raise ValueError(
            f"protocols={protocols!r}: give a non-empty sequence of {list(PROTOCOLS)}, "
            'e.g. protocols=("rpc",)'
        )


def _uvicorn_config(app: Any, server_pem: str) -> uvicorn.Config:
    """The local broker's server: HTTPS with ``server_pem``, quiet (its own log filter)."""
    return uvicorn.Config(
        app,
        ssl_certfile=server_pem,
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        http="h11",
        ws=ws_protocol(),
        loop="asyncio",
        server_header=False,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
    )


def _check_isolation(isolation: object, backend: object) -> None:
    if isolation is None:
        return
    if isolation not in ISOLATIONS:
        raise ValueError(
            f"isolation={isolation!r}: give 'auto' (bubblewrap when it works here, else none), "
            "'bwrap' or 'none'"
        )
    if backend is not None:
        raise ValueError(
            "isolation= is the default backend's: with backend=..., give the backend its own "
            "(LocalProcessBackend(isolation=...))"
        )


def _check_retention(keep_deleted: object, keep_deleted_seconds: object) -> None:
    if isinstance(keep_deleted, bool) or not isinstance(keep_deleted, int) or keep_deleted < 0:
        raise ValueError(
            f"keep_deleted={keep_deleted!r}: give the number of deleted sandboxes whose records "
            f"are kept, an integer >= 0 (default {DEFAULT_KEEP_DELETED})"
        )
    if (
        isinstance(keep_deleted_seconds, bool)
        or not isinstance(keep_deleted_seconds, int | float)
        or not keep_deleted_seconds >= 0
    ):
        raise ValueError(
            f"keep_deleted_seconds={keep_deleted_seconds!r}: give the seconds a deleted "
            f"sandbox's record is kept, a number >= 0 (default {DEFAULT_KEEP_DELETED_SECONDS:g}; "
            "math.inf: no age limit)"
        )


def write_kubelet_style(path: str, token: str) -> None:
    """Atomically (re)write ``path`` as the kubelet's projected volume does (``..data`` swap)."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    name = os.path.basename(path)
    os.makedirs(directory, exist_ok=True)
    stamp = datetime.now(UTC).strftime("..%Y_%m_%d_%H_%M_%S.%f")
    data_dir = tempfile.mkdtemp(prefix=stamp + "-", dir=directory)
    with open(os.path.join(data_dir, name), "w") as fh:
        fh.write(token)
    os.chmod(os.path.join(data_dir, name), 0o600)
    data_link = os.path.join(directory, "..data")
    old_target = os.readlink(data_link) if os.path.islink(data_link) else None
    tmp_link = os.path.join(directory, "..data_tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp_link)
    os.symlink(os.path.basename(data_dir), tmp_link)
    os.replace(tmp_link, data_link)
    if not os.path.islink(path):
        if os.path.exists(path):
            os.unlink(path)
        os.symlink(os.path.join("..data", name), path)
    if old_target and old_target != os.path.basename(data_dir):
        shutil.rmtree(os.path.join(directory, old_target), ignore_errors=True)
