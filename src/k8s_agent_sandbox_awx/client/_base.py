"""State shared by the sync and the async client and sandbox handle (no I/O).

``ClientBase`` holds the configuration, the credential source and the registry of handles;
``SandboxBase`` the sandbox's state and the checks before each use. The sync classes
(``BrokerSandboxClient``, ``Sandbox``) and the async ones (``AsyncBrokerSandboxClient``,
``AsyncSandbox``) add only the methods that talk to the broker.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Concatenate, Generic, NoReturn, ParamSpec, TypedDict, TypeVar, overload

from .._upstream import SandboxNotFoundError
from ..credentials._auth import CredentialSource, KubernetesAuth, OIDCTokenAuth
from ..credentials._chain import DefaultCredentials
from ..errors import ConfigurationError, UnsupportedOperationError
from .core import _fsapi as fsapi
from .core._flow import SandboxSpec, spec_from_create
from .core._options import ATTACH, CREATE, check_options, unexpected_keywords
from .core._steps import Op
from .http._config import BrokerConnectionConfig
from .wire import _protocol as proto
from .wire._dataplane import DataTarget, Keepalive, KeptAlive
from .wire._dialect import Dialect, Lifetime
from .wire._dialects import BrokerDialect
from .wire._files_wire import check_max_bytes

__all__ = [
    "ClassOrInstanceMethod",
    "ClientBase",
    "ConnectOptions",
    "ExcType",
    "FilesBase",
    "SandboxBase",
    "SandboxCreateOptions",
    "SandboxPart",
    "Traceback",
    "client_overrides",
    "create_spec",
    "data_target",
    "kill_name",
    "make_client",
    "timeout_seconds",
]

ExcType = type[BaseException] | None
Traceback = TracebackType | None


class ConnectOptions(TypedDict, total=False):
    """Where the broker is and who I am, for ``Sandbox.create/connect/list``."""

    auth: CredentialSource | None
    broker_url: str | None
    ca_cert: str | os.PathLike[str] | None
    config: BrokerConnectionConfig | None
    environ: Mapping[str, str] | None
    token: str | None
    """The original package's spelling of ``auth=OIDCTokenAuth(token)``."""
    token_path: str | None
    """The original package's spelling of ``auth=KubernetesAuth(token_path)``."""


class SandboxCreateOptions(ConnectOptions, total=False):
    """Keyword arguments of ``Sandbox.create``."""

    annotations: Mapping[str, str] | None
    envs: Mapping[str, str] | None
    timeout: int | None
    lifetime_seconds: int | None
    keepalive: int | None
    ready_timeout: float | None
    request_timeout: float | None
    allow_insecure_http: bool | None
    idempotency_key: str | None
    pod_labels: Mapping[str, str] | None
    pod_annotations: Mapping[str, str] | None
    scopes: Sequence[str] | None
    # Other spellings, renamed by ``sdk_spelling``: upstream's env= (envs=), E2B's metadata=
    env: Mapping[str, str] | None
    metadata: Mapping[str, str] | None
    # The original package's spellings (drop-in migration), renamed by ``sdk_spelling``:
    warmpool: str | None
    namespace: str | None
    shutdown_after_seconds: int | None
    sandbox_ready_timeout: float | None
    keepalive_ttl_seconds: int | None
    backend: str | None


H = TypeVar("H", bound="SandboxBase[Any, Any, Any]")
CL = TypeVar("CL", bound="ClientBase[Any, Any]")
C = TypeVar("C")
Cmd = TypeVar("Cmd")
F = TypeVar("F")
T = TypeVar("T")


class ClientBase(ABC, Generic[H, T]):
    """Configuration, credentials, the dialect spoken, the transport (``T``) and the handles a
    client created or attached to; the sync and the async client add the methods that do
    I/O.

    ``connection_config`` defaults to :meth:`BrokerConnectionConfig.from_env` (with
    ``config_overrides`` such as ``broker_url=``/``ca_cert=`` winning); ``auth`` defaults to
    ``DefaultCredentials()``, the zero-config discovery chain; ``http_transport`` replaces
    httpx's network transport (tests).
    """

    def __init__(
        self,
        connection_config: BrokerConnectionConfig | None = None,
        *,
        auth: CredentialSource | None = None,
        environ: Mapping[str, str] | None = None,
        http_transport: Any = None,
        **config_overrides: Any,
    ) -> None:
        if environ is not None and not isinstance(environ, Mapping):
            raise TypeError(
                "environ= must be a mapping of variable names to values (like os.environ), "
                f"not a {type(environ).__name__}."
            )
        fields = BrokerConnectionConfig.model_fields
        unknown = sorted(set(config_overrides) - set(fields))
        if unknown:
            import inspect

            parameters = inspect.signature(type(self).__init__).parameters.values()
            named = {p.name for p in parameters if p.kind is not p.VAR_KEYWORD} - {"self"}
            raise unexpected_keywords(f"{type(self).__name__}()", unknown, {*fields, *named})
        if connection_config is not None and config_overrides:
            raise ConfigurationError(
                "Pass either connection_config= or individual settings "
                f"({', '.join(sorted(config_overrides))}), not both."
            )
        self.connection_config = connection_config or BrokerConnectionConfig.from_env(
            environ, **config_overrides
        )
        self.auth = auth if auth is not None else config_auth(self.connection_config, environ)
        config = self.connection_config
        self._speaking = BrokerDialect(config.broker_url, config.broker_protocol)
        """The dialect spoken: the one owner of it (the transport shares it)."""
        self._lock = threading.RLock()
        self._handles: dict[str, H] = {}
        self._closed = False
        self._transport = self._new_transport(http_transport)

    @abstractmethod
    def _new_transport(self, http_transport: Any) -> T: ...

    @property
    def dialect(self) -> Dialect:
        """The broker dialect spoken: pinned (``broker_protocol``), or found out from the
        broker on the first request (until then: the default, ``v1``)."""
        return self._speaking.current

    @property
    def broker_url(self) -> str:
        return self.connection_config.broker_url

    def _mark_closed(self) -> bool:
        """Mark closed; ``False`` if it already was."""
        with self._lock:
            was_open = not self._closed
            self._closed = True
        return was_open

    def _register(self, handle: H) -> H:
        with self._lock:
            self._handles[handle.name] = handle
        return handle

    def _existing(self, name: str) -> H | None:
        with self._lock:
            handle = self._handles.get(name)
        return handle if handle is not None and handle.is_active else None

    def _pop(self, name: str) -> H | None:
        with self._lock:
            return self._handles.pop(name, None)

    def _names_to_delete(self) -> list[str]:
        with self._lock:
            return [] if self._closed else list(self._handles)

    def _live_handles(self) -> list[H]:
        with self._lock:
            return list(self._handles.values())

    def _forget(self, name: str) -> None:
        with self._lock:
            self._handles.pop(name, None)

    def _active(self) -> list[tuple[str, str]]:
        with self._lock:
            for name, handle in list(self._handles.items()):
                if not handle.is_active:
                    del self._handles[name]
            return [(h.namespace, name) for name, h in self._handles.items()]


class SandboxPart(Generic[T]):
    """``commands`` or ``files`` of one sandbox: its transport and data-plane target."""

    def __init__(self, transport: T, target: DataTarget) -> None:
        self._transport = transport
        self._target = target


S = TypeVar("S")


class FilesBase(SandboxPart[T], ABC, Generic[T, S]):
    """What ``files`` of the sync and the async handle share: the sandbox's :class:`FileAPI`
    and the operations' plans (``_fsapi``); ``S``: a generator of chunks, or an async one."""

    def __init__(self, transport: T, target: DataTarget) -> None:
        super().__init__(transport, target)
        self._api = fsapi.FileAPI(target)

    @abstractmethod
    def _stream(self, op: Op[fsapi.Opened], src: str, max_bytes: int | None) -> S:
        """The chunks of the file ``op`` opens (the request is sent on first iteration)."""

    def iter_bytes(
        self,
        path: str,
        timeout: float | None = None,
        allow_unsafe_paths: bool = False,
        max_bytes: int | None = None,
    ) -> S:
        """The file at ``path`` as an iterator of chunks (up to 1 MiB each), streamed: ``for``
        (sync) or ``async for`` (async); the download starts with the first chunk. Close it
        (``contextlib.closing`` / ``contextlib.aclosing``) if you stop early. The same as
        ``read(path, format="stream")``, with ``max_bytes``."""
        check_max_bytes(max_bytes)  # now, not at the first chunk
        op = fsapi.read(self._api, path, timeout, allow_unsafe_paths, stream=True)
        return self._stream(op, path, max_bytes)

    def _write_op(
        self, path: Any, data: Any, timeout: float | None, allow_unsafe: bool, allow_async: bool
    ) -> Op[Any]:
        if isinstance(path, list | tuple) and data is None:
            return fsapi.write_many(self._api, path, timeout, allow_async=allow_async)
        if data is None:
            raise TypeError(
                "write() needs the data: write(path, data), or a batch write([(path, data)])."
            )
        return fsapi.write(
            self._api, path, data, timeout, allow_unsafe=allow_unsafe, allow_async=allow_async
        )


Owner = TypeVar("Owner")
P = ParamSpec("P")
R = TypeVar("R")
PC = ParamSpec("PC")
RC = TypeVar("RC")


class ClassOrInstanceMethod(Generic[Owner, P, R, PC, RC]):
    """A method with a meaning on the instance and another on the class, as E2B's
    ``Sandbox.kill``: ``sandbox.kill()`` is ``instance(sandbox)``, ``Sandbox.kill(name)`` is
    ``on_class(Sandbox, name)``."""

    def __init__(
        self,
        instance: Callable[Concatenate[Owner, P], R],
        on_class: Callable[Concatenate[type[Owner], PC], RC],
    ) -> None:
        self._instance = instance
        self._on_class = on_class
        self.__doc__ = instance.__doc__
        self.__name__ = instance.__name__

    @overload
    def __get__(self, obj: None, owner: type[Owner]) -> Callable[PC, RC]: ...
    @overload
    def __get__(self, obj: Owner, owner: type[Owner] | None = None) -> Callable[P, R]: ...
    def __get__(self, obj: Owner | None, owner: type[Owner] | None = None) -> Callable[..., Any]:
        if obj is None:
            return types.MethodType(self._on_class, owner)
        return types.MethodType(self._instance, obj)


def kill_name(handle_type: type, name: Any) -> str:
    """The sandbox name ``Sandbox.kill(name)`` on the class was given, checked (a TypeError
    naming the rule and the fix otherwise)."""
    if not isinstance(name, str) or not name:
        kind = handle_type.__name__
        raise TypeError(
            f"{kind}.kill() on the class takes a sandbox's name (a non-empty str), e.g. "
            f"{kind}.kill(sandbox.name), not {type(name).__name__}; on a handle call "
            "sandbox.kill()."
        )
    return name


def data_target(client: Any, info: proto.SandboxInfo, keepalive: int | None) -> DataTarget:
    """Where sandbox ``info``'s data plane goes, with its activity keepalive (``keepalive``
    seconds, else the config's ``sandbox_keepalive``; 0: none): a :class:`KeptAlive` target
    owns it, and extends through the client's dialect."""
    dialect: Dialect = client.dialect
    target = dialect.data_target(info)
    seconds = keepalive if keepalive is not None else client.connection_config.sandbox_keepalive
    if not seconds:
        return target
    deadline = proto.rfc3339_seconds(info.expires_at)
    return KeptAlive(target, Keepalive(info.name, seconds, deadline), dialect.extend)


def timeout_seconds(seconds: Any) -> int:
    """``set_timeout``'s argument as whole seconds (rounded up: never shorter than asked)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(
            f"set_timeout() takes a positive number of seconds, e.g. 600; got {seconds!r}."
        )
    if seconds == float("inf"):
        raise ValueError("set_timeout() takes a finite number of seconds.")
    return math.ceil(seconds)


class _MissingAttributeError(UnsupportedOperationError, AttributeError):
    """An attribute of the original package this SDK does not have (``sandbox.snapshots``):
    the typed error, and an ``AttributeError`` for ``hasattr``, ``getattr(..., default)`` and
    introspection (``inspect.getmembers``, ``mock.create_autospec``)."""


class SandboxBase(Generic[C, Cmd, F]):
    """A sandbox's state as the broker reported it, and whether the handle may be used."""

    def __init__(
        self,
        client: C,
        info: proto.SandboxInfo,
        target: DataTarget,
        commands: Cmd,
        files: F,
        owns_client: bool,
    ) -> None:
        self._client = client
        self._info = info
        self._target = target
        """Where its data plane goes (with its keepalive, if any)."""
        self._owns_client = owns_client
        self._killed = False
        self._closed = False
        self._commands = commands
        self._files = files

    @property
    def name(self) -> str:
        return self._info.name

    @property
    def sandbox_id(self) -> str:
        return self._info.router.sandbox_id

    @property
    def namespace(self) -> str:
        return self._info.namespace

    @property
    def template(self) -> str | None:
        return self._info.template

    @property
    def info(self) -> proto.SandboxInfo:
        """The broker's last reported state (see ``refresh``)."""
        return self._info

    @property
    def client(self) -> C:
        return self._client

    @property
    def is_active(self) -> bool:
        return not (self._killed or self._closed)

    def _check_active(self) -> None:
        if self._killed:
            raise SandboxNotFoundError(
                f"Sandbox {self.name!r} was killed; create a new one with Sandbox.create()."
            )
        if self._closed:
            raise SandboxNotFoundError(
                f"The connection to sandbox {self.name!r} was closed; reattach with "
                f"Sandbox.connect({self.name!r})."
            )

    @property
    def commands(self) -> Cmd:
        self._check_active()
        return self._commands

    @property
    def files(self) -> F:
        self._check_active()
        return self._files

    # -- the original package's GKE-only operations: refused, before anything is sent --------
    def _gke_only(
        self, operation: str, error: type[UnsupportedOperationError] | None = None
    ) -> NoReturn:
        dialect = getattr(getattr(self._client, "dialect", None), "name", "any")
        raise (error or UnsupportedOperationError)(
            f"{operation} is the original package's GKE pod-snapshot feature (snapshots, "
            "suspend, resume, restore, is_suspended), which this SDK does not have. Keep the "
            "sandbox running with set_timeout(), or create a new one and write the files it "
            "needs; see docs/migrating.md (Differences that remain).",
            dialect=dialect,
            operation=operation.removesuffix("()"),
        )

    @property
    def snapshots(self) -> NoReturn:
        """Not available: the original package's GKE pod snapshots (a clear error, also an
        ``AttributeError``: ``hasattr`` is ``False`` and introspection skips it)."""
        self._gke_only("snapshots", _MissingAttributeError)

    def suspend(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not available: the original package's GKE suspend (a clear error)."""
        self._gke_only("suspend()")

    def resume(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not available: the original package's GKE resume (a clear error)."""
        self._gke_only("resume()")

    def restore(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not available: the original package's GKE restore from a snapshot (a clear error)."""
        self._gke_only("restore()")

    def is_suspended(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not available: the original package's GKE suspend state (a clear error)."""
        self._gke_only("is_suspended()")

    def _extended(self, lifetime: Lifetime) -> proto.SandboxInfo:
        """Record the state a lifetime change answered (and the keepalive's deadline); a
        dialect whose answer carries only the deadline updates the known state with it."""
        info = lifetime.info or dataclasses.replace(self._info, expires_at=lifetime.expires_at)
        self._info = info
        if isinstance(self._target, KeptAlive):
            self._target.keepalive.extended(info.expires_at)
        return info

    @staticmethod
    def _running(info: proto.SandboxInfo | None) -> bool:
        return info is not None and (info.ready or info.phase == "Ready")

    @staticmethod
    def _status_of(info: proto.SandboxInfo | None, name: str) -> tuple[str, str]:
        if info is None:
            return "SandboxNotFound", f"Sandbox {name!r} does not exist (any more)."
        if info.ready:
            return "SandboxReady", info.message or ""
        return "SandboxNotReady", info.message or info.phase

    def _needs_own_client_to_kill(self) -> bool:
        """``close_connection()`` closed the HTTP client this handle owned."""
        return self._closed and self._owns_client

    def _killed_now(self) -> bool:
        """Record a successful delete; ``True`` if the handle's client must be closed now."""
        self._killed = True
        forget = getattr(self._client, "_forget", None)
        if forget is not None:
            forget(self.name)
        if self._owns_client and not self._closed:
            self._closed = True
            return True
        return False

    def _exit_note(self, exc: BaseException, kill_error: Exception) -> None:
        exc.add_note(
            f"Sandbox {self.name!r} could not be killed ({kill_error}); kill it with "
            f"`agent-sandbox-awx kill {self.name}`."
        )

    def __repr__(self) -> str:
        state = "killed" if self._killed else self._info.phase
        return f"{type(self).__name__}(name={self.name!r}, namespace={self.namespace!r}, {state})"


def config_auth(config: BrokerConnectionConfig, environ: Mapping[str, str] | None) -> Any:
    """The credential source when no ``auth=`` is given: the config's ``token`` or
    ``token_path`` (the original package's ``SandboxBrokerConnectionConfig``), else the
    discovery chain."""
    token, path = getattr(config, "token", None), getattr(config, "token_path", None)
    if token is not None and path is not None:
        raise ConfigurationError("Pass token= or token_path=, not both.")
    if getattr(config, "backend", None) not in (None, "kubernetes"):
        raise ConfigurationError("backend= must be 'kubernetes' (or left out).")
    if token is not None:
        return OIDCTokenAuth(token.get_secret_value())
    if path is not None:
        return KubernetesAuth(path)
    return DefaultCredentials(environ)


def options_auth(options: ConnectOptions | SandboxCreateOptions) -> Any:
    """``auth=``, or the original package's ``token=`` / ``token_path=`` (one of them)."""
    values: Mapping[str, object] = options
    given = {k: values.get(k) for k in ("auth", "token", "token_path")}
    named = [k for k, v in given.items() if v is not None]
    if len(named) > 1:
        raise ConfigurationError(f"Pass only one of {', '.join(named)}: each names the credential.")
    if given.get("token") is not None:
        return OIDCTokenAuth(str(given["token"]))
    if given.get("token_path") is not None:
        return KubernetesAuth(str(given["token_path"]))
    return given["auth"]


def make_client(
    cls: type[CL],
    options: ConnectOptions | SandboxCreateOptions,
    *,
    creating: bool = False,
    what: str = "connect()",
    named: tuple[str, ...] = (),
) -> CL:
    """A client for ``Sandbox.create/connect/list`` from their keyword options (``what`` and
    ``named``: the calling method and its named parameters, for the unknown-keyword error)."""
    if not creating:
        check_options(what, options, ConnectOptions, named, where=ATTACH)
    config, overrides = client_overrides(options)
    factory: Any = cls
    client: CL = factory(
        config, auth=options_auth(options), environ=options.get("environ"), **overrides
    )
    return client


def client_overrides(
    options: ConnectOptions | SandboxCreateOptions,
) -> tuple[BrokerConnectionConfig | None, dict[str, Any]]:
    """The explicit config and the settings that override it (or the environment)."""
    ca = options.get("ca_cert")
    settings: dict[str, Any] = {
        "broker_url": options.get("broker_url"),
        "ca_cert": os.fspath(ca) if ca is not None else None,
        "request_timeout": options.get("request_timeout"),
        "allow_insecure_http": options.get("allow_insecure_http"),
    }
    overrides = {k: v for k, v in settings.items() if v is not None}
    config = options.get("config")
    if config is not None and overrides:
        data = config.model_dump()
        data.update(overrides)
        if "broker_url" in overrides:
            data.pop("api_url", None)
        return type(config).model_validate(data), {}
    return config, overrides


def create_spec(
    template: str | None, labels: Mapping[str, str] | None, options: SandboxCreateOptions
) -> SandboxSpec:
    """``Sandbox.create``'s arguments, its keywords checked against its signature first."""
    check_options("create()", options, SandboxCreateOptions, ("template", "labels"), where=CREATE)
    return spec_from_create(template, labels, options)
