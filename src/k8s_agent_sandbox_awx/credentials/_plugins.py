"""Plugin manager factory: built-ins first, then entry points, in the host's own order.

- The built-in providers are registered first under reserved names (``RESERVED_NAMES``).
- Entry points of the group ``k8s_agent_sandbox_awx.providers`` are loaded one by one, each in
  its own ``try``: a plugin that fails to import, to register or to describe itself is skipped
  with a :class:`CredentialPluginWarning` (and a log record) and reported by ``explain()``.
- An entry point whose *name* is reserved is refused with a warning. A name provided by more
  than one installed entry point is ambiguous: all of them are refused with a warning (no
  "first one wins", so that a package cannot squat another plugin's name).
- ``AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD`` (non-empty): no entry point is loaded.
  ``AGENT_SANDBOX_LOAD_PLUGINS``: unset = all; a comma-separated list of **entry-point names**
  = only those; empty = none. Both take entry-point names, never distribution or module names.
- The order in which providers are consulted is decided by :func:`order_providers`, never by
  pluggy's registration order or by entry-point iteration order.
- A provider implements ``agent_sandbox_get_credential`` (sync), ``..._async`` (an ``async def``)
  or both; :meth:`ProviderEntry.call` and :meth:`ProviderEntry.acall` pick the hook for the sync
  and the async path (see ``hookspecs``), and give a plugin ``request.timeout`` seconds plus a
  grace (:func:`answer_limit`) to answer: a plugin that takes longer is answered
  :class:`TimedOut` (the chain decides what that means).
- A problem is reported once: a :class:`CredentialPluginWarning` (which
  ``logging.captureWarnings`` routes to logging), never also a log record of its own.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import re
import threading
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pluggy

from . import _hookspecs as hookspecs
from ._bridge import FetchTimeout, aresult, awaited_in_thread, in_thread, result, within
from ._credential import CredentialRequest, ProviderInfo
from ._credential_errors import CredentialPluginWarning
from ._jwt import redact
from ._providers import (
    DEFAULT_TOKEN_PATH,
    RESERVED_NAMES,
    TOKEN_ENV,
    EnvTokenProvider,
    ProjectedTokenProvider,
    TokenFileProvider,
)

__all__ = [
    "DISABLE_AUTOLOAD_ENV",
    "LOAD_PLUGINS_ENV",
    "PluginProblem",
    "ProviderEntry",
    "ProviderRegistry",
    "TimedOut",
    "create_plugin_manager",
    "load_providers",
    "order_providers",
    "plugin_selection",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.credentials")

DISABLE_AUTOLOAD_ENV = "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"
LOAD_PLUGINS_ENV = "AGENT_SANDBOX_LOAD_PLUGINS"

ProviderCall = Callable[[CredentialRequest], object]
AsyncProviderCall = Callable[[CredentialRequest], Awaitable[object]]


MAX_GRACE_SECONDS = 1.0


def answer_limit(timeout: float) -> float:
    """How long the host waits for a plugin: ``timeout`` plus a grace of 1 s (or of ``timeout``
    if shorter), so that a plugin that honours ``request.timeout`` reports its own error (a
    timed-out endpoint is "here but broken") before the host gives up on it."""
    return timeout + min(MAX_GRACE_SECONDS, timeout)


@dataclass(frozen=True)
class TimedOut:
    """What :meth:`ProviderEntry.call` and :meth:`ProviderEntry.acall` answer for a plugin that
    did not answer within :func:`answer_limit` of ``request.timeout`` (its late answer is
    dropped)."""

    timeout: float

    @property
    def reason(self) -> str:
        return (
            f"did not answer in time (CredentialRequest.timeout is {self.timeout:g} s; the host "
            f"waited {answer_limit(self.timeout):g} s)"
        )


@dataclass(frozen=True)
class ProviderEntry:
    """One provider as the host sees it."""

    name: str
    builtin: bool
    info: ProviderInfo
    origin: str
    """Where it comes from, for humans (``built-in``, or the entry point and distribution)."""
    get_credential: ProviderCall | None
    """Calls this plugin's ``agent_sandbox_get_credential`` implementation (and only it)."""
    present: Callable[[Mapping[str, str]], str | None] | None = None
    """Built-ins only: a cheap presence test used to log shadowed sources without reading."""
    get_credential_async: AsyncProviderCall | None = None
    """Calls this plugin's ``agent_sandbox_get_credential_async`` implementation, if any."""

    def call(self, request: CredentialRequest) -> object:
        """The sync path: the sync hook, in a helper thread (inline for the built-ins: an
        environment lookup or one small local file read); for an async-only plugin, its async
        hook run to completion on a fresh event loop in a helper thread. A plugin gets
        :func:`answer_limit` seconds: then the answer is :class:`TimedOut` (the thread is left
        to end on its own; an async hook is cancelled on its loop)."""
        sync_hook = self.get_credential
        if sync_hook is not None and self.builtin:
            return sync_hook(request)
        limit = answer_limit(request.timeout)
        try:
            if sync_hook is not None:
                return result(in_thread(lambda: sync_hook(request)), limit)
            assert self.get_credential_async is not None
            return result(awaited_in_thread(self.get_credential_async(request), limit), limit)
        except FetchTimeout:
            return TimedOut(request.timeout)

    async def acall(self, request: CredentialRequest) -> object:
        """The async path: the async hook if the plugin has one (cancelled after
        :func:`answer_limit` seconds); else the sync hook, in a helper thread (it may block on
        the network; awaited as long), or inline for the built-ins (a few µs, never worth a
        thread). A plugin that takes longer is answered :class:`TimedOut`."""
        sync_hook = self.get_credential
        if sync_hook is not None and self.builtin:
            return sync_hook(request)
        limit = answer_limit(request.timeout)
        try:
            if self.get_credential_async is not None:
                return await within(self.get_credential_async(request), limit)
            assert sync_hook is not None
            return await aresult(in_thread(lambda: sync_hook(request)), limit)
        except FetchTimeout:
            return TimedOut(request.timeout)


@dataclass(frozen=True)
class PluginProblem:
    """An entry point that was not used, and why."""

    name: str
    origin: str
    status: Literal["failed to load", "not loaded"]
    detail: str


@dataclass(frozen=True)
class ProviderRegistry:
    """The result of the factory: the plugin manager and the providers in consultation order."""

    plugin_manager: pluggy.PluginManager
    providers: tuple[ProviderEntry, ...]
    problems: tuple[PluginProblem, ...]


def create_plugin_manager() -> pluggy.PluginManager:
    """A bare plugin manager with this project's hook specifications."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def plugin_selection(environ: Mapping[str, str]) -> tuple[frozenset[str] | None, str]:
    """Which entry points may load: ``(None, "")`` = all, else ``(allowed names, why)``.

    Pure: reads only the two control variables from ``environ``.
    """
    if environ.get(DISABLE_AUTOLOAD_ENV, ""):
        return frozenset(), f"{DISABLE_AUTOLOAD_ENV} is set"
    value = environ.get(LOAD_PLUGINS_ENV)
    if value is None:
        return None, ""
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    if not names:
        return frozenset(), f"{LOAD_PLUGINS_ENV} is empty"
    return names, f"{LOAD_PLUGINS_ENV} does not name it"


def order_providers(
    builtins_first: Sequence[ProviderEntry],
    third_party: Iterable[ProviderEntry],
    builtins_last: Sequence[ProviderEntry],
) -> tuple[ProviderEntry, ...]:
    """The documented order: env token, token file, third party (priority desc, then entry-point
    name), default projected path. Pure."""
    ranked = sorted(third_party, key=lambda p: (-p.info.priority, p.name))
    return (*builtins_first, *ranked, *builtins_last)


def warn_plugin(message: str, stacklevel: int = 4) -> None:
    """Report a plugin problem once: a :class:`CredentialPluginWarning` (shown once per process
    by Python's default filter; ``logging.captureWarnings(True)`` routes it to logging), never
    also a log record, so that nobody sees it twice."""
    warnings.warn(message, CredentialPluginWarning, stacklevel=stacklevel)


def _describe_error(exc: BaseException, environ: Mapping[str, str]) -> str:
    secrets = [environ.get(TOKEN_ENV, "")]
    return f"{type(exc).__name__}: {redact(str(exc), secrets)}"


def _impl_for(hook: Any, plugin_name: str) -> Any | None:
    for impl in hook.get_hookimpls():
        if impl.plugin_name == plugin_name and not (impl.hookwrapper or impl.wrapper):
            return impl
    return None


def _bind(impl: Any) -> ProviderCall:
    function = impl.function
    argnames = tuple(impl.argnames)
    if argnames == ("request",):
        return function  # type: ignore[no-any-return]
    if not argnames:
        return lambda request: function()
    return lambda request: function(**{name: request for name in argnames})


def _register(
    pm: pluggy.PluginManager,
    name: str,
    plugin: object,
    *,
    builtin: bool,
    origin: str,
) -> ProviderEntry:
    """Register one plugin and build its entry; raises on any problem (caller reports it)."""
    pm.register(plugin, name=name)
    try:
        impl = _impl_for(pm.hook.agent_sandbox_get_credential, name)
        async_impl = _impl_for(pm.hook.agent_sandbox_get_credential_async, name)
        if impl is None and async_impl is None:
            raise TypeError(
                "it implements neither agent_sandbox_get_credential nor "
                "agent_sandbox_get_credential_async"
            )
        if impl is not None and inspect.iscoroutinefunction(impl.function):
            raise TypeError(
                "its agent_sandbox_get_credential is an async def; name it "
                "agent_sandbox_get_credential_async (the async hook)"
            )
        if async_impl is not None and not inspect.iscoroutinefunction(async_impl.function):
            raise TypeError(
                "its agent_sandbox_get_credential_async is not an async def; make it one, or "
                "name it agent_sandbox_get_credential (the sync hook)"
            )
        info_impl = _impl_for(pm.hook.agent_sandbox_provider_info, name)
        info = ProviderInfo() if info_impl is None else info_impl.function()
        if not isinstance(info, ProviderInfo):
            raise TypeError(
                f"agent_sandbox_provider_info returned {type(info).__name__}, not ProviderInfo"
            )
        if isinstance(info.priority, bool) or not isinstance(info.priority, int):
            raise TypeError("ProviderInfo.priority must be an int")
    except BaseException:
        pm.unregister(name=name)
        raise
    present = getattr(plugin, "present", None) if builtin else None
    return ProviderEntry(
        name=name,
        builtin=builtin,
        info=info,
        origin=origin,
        get_credential=None if impl is None else _bind(impl),
        present=present,
        get_credential_async=None if async_impl is None else _bind(async_impl),  # type: ignore[arg-type]
    )


def _entry_point_origin(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    where = f" from distribution {dist.name} {dist.version}" if dist is not None else ""
    return f"entry point {ep.name!r} = {ep.value!r}{where}"


def _normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503: case and ``-_.`` runs ignored)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _provided_by(ep: importlib.metadata.EntryPoint, name: str) -> bool:
    """Whether ``name`` is the distribution (in any spelling pip accepts) or the module of
    ``ep``."""
    module = ep.value.split(":", 1)[0]
    if name in (module, module.split(".", 1)[0]):
        return True
    return ep.dist is not None and _normalized(ep.dist.name) == _normalized(name)


def _missing_entry_point(missing: str, entry_points: list[importlib.metadata.EntryPoint]) -> str:
    """Why ``AGENT_SANDBOX_LOAD_PLUGINS``'s ``missing`` loads nothing, and what to write: the
    entry points of the distribution or module so named, else the installed ones."""
    detail = (
        f"{LOAD_PLUGINS_ENV} names {missing!r}, but no installed distribution has an entry "
        f"point of that name in the group {hookspecs.ENTRY_POINT_GROUP!r} (the variable takes "
        "entry-point names, not distribution or module names)"
    )
    names = sorted({ep.name for ep in entry_points if _provided_by(ep, missing)})
    if names:
        listed = ", ".join(repr(n) for n in names)
        plural, them = ("s", "them") if len(names) > 1 else ("", "it")
        return (
            f"{detail}: {missing!r} provides the entry point{plural} {listed}; name {them} "
            f"instead ({LOAD_PLUGINS_ENV}={','.join(names)})"
        )
    installed = sorted({ep.name for ep in entry_points})
    if installed:
        return f"{detail}; the installed entry points are {', '.join(map(repr, installed))}"
    return f"{detail}; no plugin is installed in this environment"


class _Loader:
    """Registers third-party providers (refusing reserved and duplicate names) and records
    why any was not used."""

    def __init__(self, pm: pluggy.PluginManager, environ: Mapping[str, str]) -> None:
        self.pm, self.environ = pm, environ
        self.third: list[ProviderEntry] = []
        self.problems: list[PluginProblem] = []
        self.names = set(RESERVED_NAMES)

    def refuse(self, name: str, origin: str, detail: str) -> None:
        warn_plugin(f"Credential provider plugin {origin} {detail}.")
        self.problems.append(PluginProblem(name, origin, "failed to load", detail))

    def add(self, name: str, origin: str, load: Callable[[], object]) -> None:
        if name in RESERVED_NAMES:
            self.refuse(
                name,
                origin,
                f"refused: {name!r} is a reserved name of a built-in provider; the plugin must "
                "use another entry-point name",
            )
            return
        if name in self.names:
            self.refuse(name, origin, f"refused: a provider named {name!r} is already registered")
            return
        try:
            self.third.append(_register(self.pm, name, load(), builtin=False, origin=origin))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit at import included: skip, never exit
            detail = f"skipped: {_describe_error(exc, self.environ)}"
            warn_plugin(f"Credential provider plugin {origin} could not be loaded and is {detail}.")
            self.problems.append(PluginProblem(name, origin, "failed to load", detail))
            return
        self.names.add(name)

    def entry_points(self) -> None:
        """Load the entry points the autoload controls allow."""
        allowed, why = plugin_selection(self.environ)
        entry_points = sorted(
            importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP),
            key=lambda ep: (ep.name, ep.value),
        )
        counts: dict[str, int] = {}
        for ep in entry_points:
            counts[ep.name] = counts.get(ep.name, 0) + 1
        seen_eps: set[str] = set()
        for ep in entry_points:
            origin = _entry_point_origin(ep)
            if allowed is not None and ep.name not in allowed:
                self.problems.append(
                    PluginProblem(ep.name, origin, "not loaded", f"not loaded: {why}")
                )
                continue
            seen_eps.add(ep.name)
            if counts[ep.name] > 1 and ep.name not in RESERVED_NAMES:
                self.refuse(
                    ep.name,
                    origin,
                    f"refused: {counts[ep.name]} installed entry points are named {ep.name!r}, "
                    "so none of them is loaded (uninstall all but one)",
                )
                continue
            self.add(ep.name, origin, ep.load)
        for missing in sorted((allowed or set()) - seen_eps):
            detail = _missing_entry_point(missing, entry_points)
            warn_plugin(detail + ".")
            self.problems.append(PluginProblem(missing, "", "failed to load", detail))


def load_providers(
    environ: Mapping[str, str],
    *,
    plugins: Iterable[tuple[str, object]] = (),
    token_path: str = DEFAULT_TOKEN_PATH,
) -> ProviderRegistry:
    """Build the plugin manager and the ordered provider list for ``environ``.

    ``plugins``: ``(name, plugin)`` pairs registered as third-party providers before entry
    points (for tests and embedding; not subject to the autoload controls, but reserved names
    are refused). ``token_path`` replaces the default projected token path (tests).
    """
    pm = create_plugin_manager()
    env_provider, file_provider = EnvTokenProvider(), TokenFileProvider()
    projected = ProjectedTokenProvider(token_path)
    first = [
        _register(pm, p.name, p, builtin=True, origin="built-in")
        for p in (env_provider, file_provider)
    ]
    last = [_register(pm, projected.name, projected, builtin=True, origin="built-in")]
    loader = _Loader(pm, environ)
    for name, plugin in plugins:
        loader.add(name, "registered by the host", lambda plugin=plugin: plugin)  # type: ignore[misc]
    loader.entry_points()
    providers = order_providers(first, loader.third, last)
    logger.debug("credential providers in order: %s", ", ".join(p.name for p in providers))
    return ProviderRegistry(pm, providers, tuple(loader.problems))


_default_registries: dict[tuple[str | None, str | None], ProviderRegistry] = {}
_default_lock = threading.Lock()


def default_registry(environ: Mapping[str, str]) -> ProviderRegistry:
    """The registry for the process environment, built once per value of the control variables
    (entry points are scanned and imported once per process, warnings are issued once)."""
    key = (environ.get(DISABLE_AUTOLOAD_ENV), environ.get(LOAD_PLUGINS_ENV))
    with _default_lock:
        registry = _default_registries.get(key)
        if registry is None:
            registry = _default_registries[key] = load_providers(environ)
        return registry


def reset_default_registry() -> None:
    """Forget the memoised process registry (tests; after installing a plugin at run time)."""
    with _default_lock:
        _default_registries.clear()
