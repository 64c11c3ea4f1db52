"""``LocalBroker``: the whole local stack (issuers, broker, sandboxes) in-process, on loopback."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

import httpx
import uvicorn

from ..broker._app import PROTOCOLS, BrokerApp
from ..broker.backends.local._backend import (
    DEFAULT_KEEP_DELETED,
    DEFAULT_KEEP_DELETED_SECONDS,
    LocalBackend,
)
from ..broker.backends.local._bubblewrap import Isolation
from ..broker.backends.local._launcher import RuntimeLauncher
from ..broker.backends.local._owned_dirs import (
    RUNTIMES_DIR_PREFIX,
    owned_temp_dir,
    release_owned_dir,
    sweep_dead_owners,
)
from ..broker.backends.local._processes import LocalProcessLauncher
from ..broker.dataplane._ports import ws_protocol
from ..broker.dataplane._relay import install_log_filter
from ..broker.dataplane._ws_limits import WebSocketLimits
from ..broker.identity._policy import Policy, caller_namespace
from ..broker.identity._revocations import Revocations
from ..broker.identity._rules import IssuerPolicies
from ..broker.identity._verify import TokenVerifier
from ..broker.runtime._tree import remove_quietly
from ..broker.server._dates import FreshDateServer, monotonic_clock
from ._broker_setup import (
    all_warm_pools,
    check_arguments,
    listen,
    make_certificates,
)
from ._faults import FaultLayer, FaultRules, Faults, FaultyRuntimes
from ._inspection import Inspection
from ._issuers import Issuer
from ._messages import isolation_warning
from ._tokens import NOT_RUNNING, Tokens

if TYPE_CHECKING:
    from ..broker.observability._observer import Observer

log = logging.getLogger("k8s_agent_sandbox_awx.testing")
T = TypeVar("T")
C = TypeVar("C")
P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_KUBERNETES_POLICY = Policy(
    templates=("python",), namespace=caller_namespace, max_sandboxes=5, max_lifetime_seconds=3600
)

DEFAULT_GITLAB_POLICY = Policy(
    templates=("python",), namespace="gitlab-ci", max_sandboxes=5, max_lifetime_seconds=3600
)


def _delegate(
    part: str, method: Callable[Concatenate[Any, P], R], doc: str
) -> Callable[Concatenate[Any, P], R]:
    """A method of the broker that calls ``method`` of its part ``part`` (looked up on the part
    at each call), with that method's signature, and returns what it returns (nothing, for a
    method annotated ``-> None``); its docstring names the method, then ``doc``.
    :func:`_delegates_named` gives it the broker's own name."""
    name = method.__name__
    gives = method.__annotations__.get("return") not in ("None", None)

    @functools.wraps(method)  # inspect.signature and help() follow __wrapped__: the same
    def delegate(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = getattr(getattr(self, part), name)(*args, **kwargs)
        return result if gives else cast(R, None)

    delegate.__doc__ = f":meth:`{method.__qualname__}`: {doc}"
    setattr(delegate, _DELEGATE, part)
    return delegate


_DELEGATE = "_delegates_to"


def _delegates_named(cls: type[C]) -> type[C]:
    """``cls`` with its :func:`_delegate` methods named as its own (``functools.wraps`` gave
    them their part's method's name)."""
    for name, value in vars(cls).items():
        if getattr(value, _DELEGATE, None) is not None:
            value.__name__, value.__qualname__ = name, f"{cls.__qualname__}.{name}"
            value.__module__ = cls.__module__
    return cls


@_delegates_named
class LocalBroker:
    """The local broker stack: OIDC issuers, the broker and local sandboxes, on 127.0.0.1.

    ``with LocalBroker() as broker:`` starts everything (HTTPS with a CA generated at start,
    one uvicorn server on a background thread) and stops and cleans up on exit.

    The broker itself is its lifecycle (``start``, ``stop``, ``reset``, ``delete_all``) and its
    properties (``url``, ``ca_bundle``, ...); the rest is in three parts it owns:

    - ``broker.tokens`` (:class:`Tokens`): the issuers and their tokens (``issue_kubernetes``,
      ``issue_gitlab``, ``write_projected``, ``environ``, ``add_issuer``, ``rotate_keys``,
      ``revoke``, ...);
    - ``broker.inspect`` (:class:`Inspection`): the state, for assertions (``claims``,
      ``sandboxes``, ``execution_count``, ``runtime_pid``, ``sandbox_name``);
    - ``broker.faults`` (:class:`Faults`): failure injection (``inject_unavailable``,
      ``cut_event_streams``, ``crash_next_start``, ..., ``clear``).

    The parts' methods are also the broker's own under their earlier names (for example
    ``issue_kubernetes_token`` is ``tokens.issue_kubernetes``, ``clear_faults`` is
    ``faults.clear``): those stay, as one-line delegates.

    Arguments (all keyword-only, all optional):

    - ``templates``: template name -> runtime command line (``None``: the backend default).
      Default ``{"python": None}``.
    - ``runtime_command``: the default runtime command line (see ``DEFAULT_RUNTIME_COMMAND``).
    - ``backend``: a :class:`RuntimeLauncher` (default: :class:`LocalProcessLauncher`).
    - ``kubernetes_policy`` / ``gitlab_policy``: the built-in providers' policies.
    - ``readiness_delay``: seconds a new sandbox stays ``Pending`` after its runtime is up.
    - ``skew_seconds``: clock skew allowed on ``exp``/``nbf``/``iat``; ``max_token_bytes``.
    - ``warn``: log the isolation warning at start (what a sandbox is and is not kept from).
    - ``isolation``: the default backend's, ``"auto"`` (bubblewrap when it works here, else
      none), ``"bwrap"`` or ``"none"``; default ``$AGENT_SANDBOX_LOCAL_ISOLATION``, else
      ``"auto"`` (see :class:`LocalProcessLauncher`; ``isolation_info`` says which is in force).
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
    - ``port``: the TCP port on ``host`` (default 0: a free one chosen at start); a port that
      is taken raises ``PortInUseError`` (an ``OSError``, ``errno.EADDRINUSE``).
    - ``tls``: ``(ca_bundle, server_pem)``, the CA certificate clients trust and the server's
      key and certificate chain (one PEM file), kept by the caller (``agent-sandbox-awx dev``
      keeps them in its state directory, so that its exports survive a restart); default: a
      CA made at start, in the temporary directory.
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
        backend: RuntimeLauncher | None = None,
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
        port: int = 0,
        tls: tuple[str, str] | None = None,
    ) -> None:
        check_arguments(
            keep_deleted, keep_deleted_seconds, isolation, backend, protocols, port, tls
        )
        self._port, self._tls = port, tls
        self._templates: dict[str, str | list[str] | None] = dict(templates or {"python": None})
        self._runtime_command = runtime_command
        self._backend = backend
        self._isolation = isolation
        self._faults = FaultRules(readiness_delay)
        self._skew = skew_seconds
        self._max_token_bytes = max_token_bytes
        self._host = host
        self._warn = warn
        self._protocols = tuple(p for p in PROTOCOLS if p in protocols)
        self._warm_pools = all_warm_pools(self._templates, warm_pools)
        self._keep_deleted = keep_deleted
        self._keep_deleted_seconds = float(keep_deleted_seconds)
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
        # the parts (see the class docstring): issuers and tokens, the state, failure injection
        self.tokens = Tokens(
            kubernetes_policy=kubernetes_policy or DEFAULT_KUBERNETES_POLICY,
            gitlab_policy=gitlab_policy or DEFAULT_GITLAB_POLICY,
            revocations=self._revocations,
        )
        self.inspect = Inspection(self._require_store)
        self.faults = Faults(self._faults, self.inspect.sandbox_name)

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
        sock: socket.socket | None = None
        try:
            sock, server_pem = self._listen_with_tls(self._tmp)
            self._app = self._make_app(self._tmp)
        except BaseException:  # a port in use; isolation="bwrap" without a working bwrap, ...
            if sock is not None:
                sock.close()
            self._cleanup_files()
            raise
        if self._warn:
            self._log_isolation()
        install_log_filter()
        served: Any = FaultLayer(self._app, self._faults, self._protocols)  # faults around it
        if self._observer is not None:  # and the observer around both: it sees what clients see
            served = self._observer.wrap_broker(self._app, served)
        self._server = FreshDateServer(_uvicorn_config(served, server_pem))
        loop = _OwnClockLoop()
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
        """The listening socket (sets ``url``) and the server's certificate chain file: the
        caller's (``tls=``), or from a CA generated now (written to ``ca_bundle``)."""
        sock = listen(self._host, self._port)
        self._url = f"https://{self._host}:{sock.getsockname()[1]}"
        self._ca_bundle, server_pem = self._tls or make_certificates(tmp, self._host)
        return sock, server_pem

    def _make_app(self, tmp: str) -> BrokerApp:
        """The built-in issuers, the backend and the ASGI application with both dialects."""
        assert self._url is not None and self._ca_bundle is not None
        self._jwks = _JwksClient(self._ca_bundle)
        self.tokens.bind(self._url, self._ca_bundle, tmp, self._forget_keys)
        runtimes = self._backend or LocalProcessLauncher(
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
            issuers=self.tokens.snapshot,
            http=self._jwks.client,  # the local issuers' documents: this broker's own URL
            skew_seconds=self._skew,
            max_token_bytes=self._max_token_bytes,
            is_revoked=self._revocations.is_revoked,
        )
        return BrokerApp(
            verifier=verifier,
            policies=IssuerPolicies(self.tokens.snapshot),
            backend=self._store,
            protocols=self._protocols,
            issuer_by_name=self.tokens.named,
        )

    def stop(self) -> None:
        """Delete every sandbox, stop the runtimes and the server, remove the temp files."""
        self.tokens.stop_rotating()
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
            raise RuntimeError(NOT_RUNNING)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _require_app(self) -> BrokerApp:
        if self._app is None or self._url is None:
            raise RuntimeError(NOT_RUNNING)
        return self._app

    def _require_store(self) -> LocalBackend:
        """The local backend: the sandboxes' records (``sandboxes``, ``history``)."""
        if self._store is None or self._url is None:
            raise RuntimeError(NOT_RUNNING)
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
        """The Kubernetes-like issuer (``<url>/issuers/kubernetes``); ``tokens.kubernetes``."""
        return self.tokens.kubernetes

    @property
    def gitlab(self) -> Issuer:
        """The GitLab-like issuer (``<url>/issuers/gitlab``); ``tokens.gitlab``."""
        return self.tokens.gitlab

    @property
    def issuers(self) -> dict[str, Issuer]:
        """Every trusted issuer, by name; ``tokens.issuers``."""
        return self.tokens.issuers

    def _forget_keys(self, issuer: Issuer) -> None:
        app = self._app
        if app is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(app.verifier.forget, issuer.url)

    # -- state changes -------------------------------------------------------------------------
    def delete_all(self) -> None:
        """Delete every sandbox now (all owners) and wait until their runtimes are gone."""
        self._call(self._require_store().delete_all())

    def reset(self) -> None:
        """Delete every sandbox and clear every injected fault (the fixture calls it per test)."""
        self.delete_all()
        self.faults.clear()

    # -- the parts' methods under their earlier names: one-line delegates ----------------------
    add_issuer = _delegate(
        "tokens", Tokens.add_issuer, "add and trust a custom issuer at ``<url>/issuers/<name>``."
    )
    issue_kubernetes_token = _delegate(
        "tokens", Tokens.issue_kubernetes, "a projected ServiceAccount token (RS256)."
    )
    issue_gitlab_token = _delegate(
        "tokens", Tokens.issue_gitlab, "a GitLab CI ``id_tokens`` token (RS256)."
    )
    rotate_keys = _delegate(
        "tokens", Tokens.rotate_keys, "rotate ``issuer``'s signing key; returns the new kid."
    )
    revoke_token = _delegate(
        "tokens", Tokens.revoke, "reject ``token`` from now on (``401 token_revoked``)."
    )
    write_projected_token = _delegate(
        "tokens", Tokens.write_projected, "a Kubernetes token written as the kubelet does."
    )
    keep_projected_token_rotated = _delegate(
        "tokens", Tokens.keep_projected_rotated, "written now, rewritten until :meth:`stop`."
    )
    environ = _delegate(
        "tokens", Tokens.environ, "the variables a zero-argument ``Sandbox.create()`` needs."
    )
    claims = _delegate(
        "inspect", Inspection.claims, "the SandboxClaim manifests the broker created."
    )
    sandboxes = _delegate(
        "inspect", Inspection.sandboxes, "every live sandbox as the API returns it."
    )
    sandbox_name = _delegate(
        "inspect", Inspection.sandbox_name, "the sandbox an ``/rpc`` claim name names."
    )
    execution_count = _delegate(
        "inspect", Inspection.execution_count, "commands forwarded to sandbox ``name``."
    )
    runtime_pid = _delegate(
        "inspect", Inspection.runtime_pid, "the pid of sandbox ``name``'s runtime process."
    )
    set_readiness_delay = _delegate(
        "faults", Faults.set_readiness_delay, "new sandboxes stay ``Pending`` this long."
    )
    inject_unavailable = _delegate(
        "faults", Faults.inject_unavailable, "the next ``count`` matching requests get 503."
    )
    drop_connection_after_execute = _delegate(
        "faults", Faults.drop_connection_after_execute, "the command runs, its answer is lost."
    )
    cut_event_streams = _delegate(
        "faults", Faults.cut_event_streams, "event streams end early, at a line boundary."
    )
    drop_event_stream_mid_line = _delegate(
        "faults", Faults.drop_event_stream_mid_line, "half a line, then the connection drops."
    )
    crash_next_start = _delegate(
        "faults", Faults.crash_next_start, "the next ``count`` sandboxes crash at startup."
    )
    clear_faults = _delegate(
        "faults", Faults.clear, "remove every injected fault and the readiness delay."
    )


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


class _OwnClockLoop(asyncio.SelectorEventLoop):
    """The local broker's event loop, its timers on the monotonic clock the process had at
    import: it runs in its caller's test process, where a test that patched ``time.monotonic``
    (asyncio's clock) held every timer the loop armed meanwhile for as far as the patch jumped
    (uvicorn's tick among them, so that answers kept the Date of before the patch: 62 s
    later, ``doctor`` failed its clock-skew check)."""

    def time(self) -> float:
        return monotonic_clock()


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
        ws_max_size=WebSocketLimits().max_message_bytes,  # as the broker app's relay
        loop="asyncio",
        server_header=False,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
    )
