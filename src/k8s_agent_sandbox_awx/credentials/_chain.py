"""The zero-configuration discovery chain (:class:`DefaultCredentials`) and :func:`explain`.

Order (decided here, never by registration or entry-point iteration order):

1. ``agent-sandbox-token``: ``AGENT_SANDBOX_TOKEN`` (cached);
2. ``agent-sandbox-token-file``: ``AGENT_SANDBOX_TOKEN_FILE`` (re-read on every request);
3. third-party providers from entry points, by ``ProviderInfo.priority`` (higher first), then
   by entry-point name;
4. ``kubernetes-projected``: ``/var/run/secrets/tokens/agent-sandbox-token`` (re-read).

The first provider that returns a credential wins; one that raises ("here but broken") stops
discovery with its error. A third-party provider that does not answer within the request's
timeout is skipped with one warning and discovery goes on (it never answered, so nothing says it
is here); once selected, a provider that does not answer in time is an error (no silent switch
to another identity). Discovery and the per-request fetch are written once, as I/O-free
generators that yield ``(provider, request)`` steps; the sync path answers each step with
:meth:`ProviderEntry.call`, the async path with ``await`` :meth:`ProviderEntry.acall`. One
discovery runs per instance and audience at a time (a single flight in ``_cache``, shared by
threads and tasks). A provider whose non-file credential for the audience is still in the
process cache (selected earlier by another ``DefaultCredentials`` on ``os.environ``) is answered
from the cache during discovery too. The winner is remembered per audience, so later requests
call only that provider: file-backed ones read their file again, the others are served from the
cache.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .._driver import Steps, adrive, drive
from . import _cache
from ._auth import CredentialSource, ProviderGuard, accept_credential, plain_answer
from ._bridge import aresult, in_thread
from ._ci_fixes import fixes as ci_fixes
from ._credential import Credential, CredentialRequest
from ._credential_errors import (
    CredentialError,
    CredentialSourceError,
    NoCredentialsError,
)
from ._explanation import Explanation, ProviderDecision, Record, selected_detail
from ._jwt import CLOCK_SKEW_SECONDS, DecodedToken, cache_deadline, decode_token, normalise_url
from ._plugins import (
    DISABLE_AUTOLOAD_ENV,
    LOAD_PLUGINS_ENV,
    PluginProblem,
    ProviderEntry,
    ProviderRegistry,
    TimedOut,
    default_registry,
    load_providers,
    warn_plugin,
)
from ._providers import DEFAULT_TOKEN_PATH, TOKEN_ENV

__all__ = ["DefaultCredentials", "Explanation", "ProviderDecision", "explain"]

logger = logging.getLogger("k8s_agent_sandbox_awx.credentials")

T = TypeVar("T")
Step = tuple[ProviderEntry, CredentialRequest]
Discovery = Steps[Step, T]
"""An I/O-free computation that yields the provider calls it needs and receives their results
(the one step-generator type, ``_driver.Steps``)."""


@dataclass(frozen=True)
class _RequestPlan:
    """What one credential request does: run ``steps`` through the cache under ``key``
    (``None``: a file-backed source, read every time, never cached), storing the result unless
    ``store`` is off (the single flight of a discovery stores nothing itself)."""

    key: _cache.CacheKey | None
    steps: Callable[[], Discovery[_cache.Fetched]]
    store: bool


@dataclass(frozen=True)
class _Selection:
    provider: ProviderEntry
    file_backed: bool
    key: _cache.CacheKey


def _reason(provider: ProviderEntry, request: CredentialRequest) -> str:
    """Why a provider did not apply: its ``not_here`` reasons, else its hint."""
    reasons = "; ".join(request.reasons)
    hint = provider.info.hint
    if reasons and hint and not provider.builtin:
        return f"{reasons} (to use it: {hint})"
    if reasons:
        return reasons
    if hint:
        return f"not here (to use it: {hint})"
    return "not here (it gave no reason)"


def _no_credentials(
    audience: str,
    tried: Sequence[tuple[str, str]],
    problems: Iterable[PluginProblem],
    token_path: str,
    environ: Mapping[str, str],
) -> NoCredentialsError:
    broker = f"the broker {audience!r}" if audience else "a broker (no broker URL is set)"
    lines = [f"No credential found for {broker}. Providers tried, in order:"]
    lines += [f"  - {name}: {why}" for name, why in tried]
    failed = [p for p in problems if p.status == "failed to load"]
    if failed:
        lines.append("Plugins not used:")
        lines += [f"  - {p.name}: {p.detail}" for p in failed]
    lines += ci_fixes(environ, audience, token_path)  # a GitLab job: its id_tokens
    return NoCredentialsError("\n".join(lines), tried=tried)


def _same_answer(before: Credential, answer: object) -> bool:
    """Whether a provider's ``answer`` is a :class:`Credential` with the same fields as
    ``before`` (``Credential`` compares by identity)."""
    return (
        type(answer) is Credential
        and answer.token == before.token
        and answer.provider == before.provider
        and answer.source == before.source
        and answer.file_backed == before.file_backed
    )


def _unexpired(decoded: DecodedToken | None, now: float) -> bool:
    """Whether a token accepted before is still within its ``exp`` at ``now`` (the one check of
    :func:`check_credential` that changes with time)."""
    return decoded is None or decoded.exp is None or now <= decoded.exp + CLOCK_SKEW_SECONDS


def _guard(provider: ProviderEntry, request: CredentialRequest) -> ProviderGuard:
    secrets = (request.environ.get(TOKEN_ENV, ""),)
    return ProviderGuard(provider=provider.name, source=provider.origin, secrets=secrets)


def _perform(step: Step) -> object:
    """Answer one step with a sync provider call (its guard around it)."""
    provider, request = step
    with _guard(provider, request) as guard:
        return plain_answer(provider.call(request))
    guard.reraise()


async def _aperform(step: Step) -> object:
    """Answer one step with an awaited provider call (its guard around it)."""
    provider, request = step
    with _guard(provider, request) as guard:
        return plain_answer(await provider.acall(request))
    guard.reraise()


def _run(steps: Discovery[T]) -> T:
    """Drive ``steps`` with sync provider calls."""
    return drive(steps, _perform)


async def _arun(steps: Discovery[T]) -> T:
    """Drive ``steps`` with awaited provider calls."""
    return await adrive(steps, _aperform)


class DefaultCredentials:
    """The zero-config discovery chain; a :class:`CredentialSource`.

    ``environ``: the environment to discover in (default: ``os.environ``, read when used).
    Discovery (loading plugins, choosing a provider) happens lazily on first use and once per
    audience; see the module docstring for the order.

    ``_token_path`` and ``_plugins`` are for tests: they replace the default projected token path
    and register extra ``(name, plugin)`` providers as third-party plugins (and then this
    instance loads its own plugins; otherwise entry points are loaded once per process and per
    value of the two control variables).
    """

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        timeout: float = 5.0,
        _token_path: str | None = None,
        _plugins: Sequence[tuple[str, object]] | None = None,
    ) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(
                f"DefaultCredentials(timeout=...) takes a number of seconds, not "
                f"{type(timeout).__name__}"
            )
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(
                f"DefaultCredentials(timeout={timeout!r}): the timeout is how many seconds each "
                "credential plugin may take to answer; it must be a finite number greater than "
                "0 (default 5.0)"
            )
        self._environ_arg = environ
        self._timeout = float(timeout)
        self._token_path = DEFAULT_TOKEN_PATH if _token_path is None else _token_path
        self._plugins = tuple(_plugins or ())
        self._custom = environ is not None or _token_path is not None or bool(self._plugins)
        self._scope = (
            _cache.new_instance_key("DefaultCredentials") if self._custom else ("os.environ", 0)
        )
        """The scope of this chain's cache keys (see :meth:`_key`): shared by every chain on
        ``os.environ`` (they consult the same providers), its own for a custom one."""
        self._registry: ProviderRegistry | None = None
        self._selected: dict[str, _Selection] = {}
        self._last_read: dict[str, tuple[Credential, Credential, DecodedToken | None]] = {}
        """Per audience, a built-in file source's last answer (the file re-read, the text as
        read), the credential it was accepted as and its decoded token: an equal answer is the
        same credential (the checks are of its text and the audience), unless it has expired."""
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        where = "os.environ" if self._environ_arg is None else "a custom environment"
        return f"DefaultCredentials({where})"

    @property
    def environ(self) -> Mapping[str, str]:
        return os.environ if self._environ_arg is None else self._environ_arg

    def registry(self) -> ProviderRegistry:
        """The loaded providers in consultation order (loads plugins on first call)."""
        registry = self._registry
        if registry is None:
            with self._lock:
                registry = self._registry
                if registry is None:
                    if self._plugins or self._token_path != DEFAULT_TOKEN_PATH:
                        registry = load_providers(
                            self.environ, plugins=self._plugins, token_path=self._token_path
                        )
                    else:
                        registry = default_registry(self.environ)
                    self._registry = registry
        return registry

    # -- per request ------------------------------------------------------------------------

    def get_credential(self, audience: str) -> Credential:
        read = self._read_inline(audience)
        if read is not None:
            return self._read_file(read, audience)
        plan = self._plan(audience)
        if plan.key is None:
            return _run(plan.steps())[0]
        return _cache.get_or_fetch(plan.key, lambda: _run(plan.steps()), store=plan.store)

    async def aget_credential(self, audience: str) -> Credential:
        """:meth:`get_credential` for asyncio code: same order, cache and checks.

        Built-in providers run inline (an environment lookup, one small file read); a plugin's
        async hook is awaited; a plugin with only the sync hook runs in a helper thread. The
        first discovery loads the plugins (imports entry points) in a helper thread, in the one
        task that runs it (the others wait for its result without a thread).
        """
        read = self._read_inline(audience)
        if read is not None:
            return self._read_file(read, audience)
        plan = self._plan(audience)
        if plan.key is None:
            return (await _arun(plan.steps()))[0]
        fetch = lambda: self._arun_loaded(plan.steps)  # noqa: E731
        return await _cache.aget_or_fetch(plan.key, fetch, store=plan.store)

    async def _arun_loaded(self, steps: Callable[[], Discovery[T]]) -> T:
        if self._registry is None:
            await aresult(in_thread(self.registry))
        return await _arun(steps())

    def _read_inline(self, audience: str) -> ProviderEntry | None:
        """The selected provider when it is a built-in file source (re-read on every request,
        inline on both paths: :meth:`ProviderEntry.call` and ``acall`` both call its hook
        directly), so that a request reads the file without the driver of the steps."""
        selection = self._selected.get(audience)
        if selection is None or not selection.file_backed:
            return None
        provider = selection.provider
        return provider if provider.builtin and provider.get_credential is not None else None

    def _read_file(self, provider: ProviderEntry, audience: str) -> Credential:
        """:meth:`_fetch` of a built-in file source, without its steps: the same guard, read
        and checks (no cache deadline: a file is never cached). A built-in's answer is a plain
        :class:`Credential` already (``plain_answer`` copies a plugin's, whose code must not
        run later), so it is checked as it is; an answer with the same fields as the last one
        accepted (the file unchanged) is that credential, its expiry checked again."""
        request = self._request(audience)
        with _guard(provider, request) as guard:
            answer = provider.call(request)
        if guard.error is not None:
            guard.reraise()
        now = _cache.now()
        last = self._last_read.get(audience)
        if last is not None and _same_answer(last[0], answer) and _unexpired(last[2], now):
            return last[1]  # the same answer as the last read: the same checks passed
        accepted, decoded = self._accepted(provider, request, answer, audience, now)
        if isinstance(answer, Credential):  # it is, once accepted
            self._last_read[audience] = (answer, accepted, decoded)
        return accepted

    def invalidate(self, audience: str) -> None:
        """Drop the cached credential of the selected provider for ``audience`` (after a 401).

        Non-blocking (no I/O): async code calls it directly.
        """
        selection = self._selected.get(audience)
        if selection is not None and not selection.file_backed:
            _cache.invalidate(selection.key)

    def _plan(self, audience: str) -> _RequestPlan:
        """What a request does (see :class:`_RequestPlan`).

        Before a provider is selected: one discovery at a time per audience (a single flight that
        stores nothing) for this instance, or for all instances on ``os.environ`` with the same
        plugin controls (they consult the same chain, so many zero-argument clients created at
        once cause one fetch). After: the selected provider, through the cache unless
        file-backed.
        """
        selection = self._selected.get(audience)
        if selection is None:
            environ = self.environ
            controls = (environ.get(DISABLE_AUTOLOAD_ENV), environ.get(LOAD_PLUGINS_ENV))
            key = self._key(audience, "discovery", controls)
            return _RequestPlan(key, lambda: self._discover(audience), store=False)
        provider = selection.provider
        steps = lambda: self._fetch(provider, audience)  # noqa: E731
        return _RequestPlan(None if selection.file_backed else selection.key, steps, store=True)

    def _key(self, audience: str, *what: Hashable) -> _cache.CacheKey:
        """This chain's cache keys, all of one shape: ``((scope, *what), audience)``. ``what``
        is a provider's name (its credential), or ``("discovery", plugin controls)`` for the
        discovery flight (the controls decide what a chain on ``os.environ`` consults; two parts,
        so it never equals a provider's key)."""
        return ((self._scope, *what), audience)

    def _request(self, audience: str) -> CredentialRequest:
        return CredentialRequest(audience, self.environ, self._timeout)

    def _fetch(self, provider: ProviderEntry, audience: str) -> Discovery[_cache.Fetched]:
        request = self._request(audience)
        return self._checked(provider, request, (yield provider, request), audience)

    def _checked(
        self, provider: ProviderEntry, request: CredentialRequest, result: object, audience: str
    ) -> _cache.Fetched:
        """The selected provider's answer to ``request``, checked (:meth:`_accepted`), with
        its cache deadline."""
        now = _cache.now()
        credential, decoded = self._accepted(provider, request, result, audience, now)
        return credential, cache_deadline(decoded, now)

    @staticmethod
    def _accepted(
        provider: ProviderEntry,
        request: CredentialRequest,
        result: object,
        audience: str,
        now: float,
    ) -> tuple[Credential, DecodedToken | None]:
        """The selected provider's answer to ``request``, checked at ``now``: an answer in
        time, a credential that passes :func:`accept_credential`."""
        if isinstance(result, TimedOut):
            raise CredentialSourceError(
                f"The credential provider {provider.name!r} was selected for {audience!r} but "
                f"{result.reason}. Discovery is not repeated, so that this process never "
                "switches identity silently; check the provider's platform (or give it more "
                "time: DefaultCredentials(timeout=...)), or create a new credential source.",
                provider=provider.name,
            )
        if result is None:
            raise CredentialSourceError(
                f"The credential provider {provider.name!r} was selected for {audience!r} but no "
                f"longer applies ({_reason(provider, request)}). Discovery is not repeated, so "
                "that this process never switches identity silently; restore the source or "
                "create a new credential source.",
                provider=provider.name,
            )
        return accept_credential(result, provider=provider.name, audience=audience, now=now)

    # -- discovery --------------------------------------------------------------------------

    def _discover(self, audience: str) -> Discovery[_cache.Fetched]:
        """Consult the providers in order; remember and return the first credential."""
        selection = self._selected.get(audience)
        if selection is not None:  # selected by another caller just before this flight began
            cached = None if selection.file_backed else _cache.get_cached(selection.key)
            if cached is not None:
                return cached, 0.0
            fetched = yield from self._fetch(selection.provider, audience)
            _cache.put(selection.key, *fetched)
            return fetched
        found = yield from self._consult(audience, None)
        assert found is not None  # discovery raises when no provider applies
        provider, credential, key = found
        self._selected[audience] = _Selection(provider, credential.file_backed, key)
        logger.debug(
            "credential provider %r selected for %s (%s, %s)",
            provider.name,
            audience,
            credential.source,
            "file-backed, re-read on every request"
            if credential.file_backed
            else "cached until shortly before exp",
        )
        providers = self.registry().providers
        self._log_shadowed(providers[providers.index(provider) + 1 :], provider.name)
        return credential, 0.0

    def _consult(
        self, audience: str, record: Record | None
    ) -> Discovery[tuple[ProviderEntry, Credential, _cache.CacheKey] | None]:
        """Consult the providers in order: the one discovery.

        Without ``record`` (a request): the first credential wins (served from the cache if it
        is there, stored otherwise); a broken provider stops discovery with its error; none:
        :class:`NoCredentialsError`. With ``record`` (:meth:`explain`): every provider is asked,
        nothing is cached, and each decision is recorded instead."""
        registry = self.registry()
        tried: list[tuple[str, str]] = []
        for provider in registry.providers:
            key = self._key(audience, provider.name)
            if record is None and (cached := _cache.get_cached(key)) is not None:
                return provider, cached, key
            request = self._request(audience)
            try:
                result = yield provider, request
            except CredentialError as exc:
                if record is None:
                    raise
                record.broken(provider, exc)
                continue
            if isinstance(result, TimedOut):
                tried.append((provider.name, _skipped(result)))
                if record is not None:
                    record.add(provider.name, "timed out", tried[-1][1])
                    continue
                warn_plugin(
                    f"Credential provider plugin {provider.name!r} ({provider.origin}) "
                    f"{result.reason} and is skipped: discovery goes on with the next "
                    "provider. Fix or uninstall the plugin, leave it out of "
                    f"{LOAD_PLUGINS_ENV}, or give it more time with "
                    "DefaultCredentials(timeout=...).",
                    stacklevel=2,
                )
                continue
            if result is None:
                tried.append((provider.name, _reason(provider, request)))
                if record is not None:
                    record.add(provider.name, "not here", tried[-1][1])
                continue
            if record is not None and record.stopped_by:
                record.shadowed(provider, result)
                continue
            accepted = self._accept(provider, result, audience, key, record)
            if accepted is not None and record is None:
                return provider, accepted, key
        error = _no_credentials(audience, tried, registry.problems, self._token_path, self.environ)
        if record is None:
            raise error
        record.finish(registry.problems, error)
        return None

    @staticmethod
    def _accept(
        provider: ProviderEntry,
        result: object,
        audience: str,
        key: _cache.CacheKey,
        record: Record | None,
    ) -> Credential | None:
        """Check a provider's result; store it (a request) or record the verdict (explain)."""
        now = _cache.now()
        try:
            credential, decoded = accept_credential(
                result, provider=provider.name, audience=audience, now=now
            )
        except CredentialError as exc:
            if record is None:
                raise
            record.rejected(provider, exc, result)
            return None
        if record is None:
            _cache.put(key, credential, cache_deadline(decoded, now))
        else:
            record.winner(provider, credential, decoded)
        return credential

    def _log_shadowed(self, rest: Iterable[ProviderEntry], winner: str) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        for provider in rest:
            if provider.present is not None:
                why = provider.present(self.environ)
                if why:
                    logger.debug(
                        "credential provider %r is shadowed by %r (%s)", provider.name, winner, why
                    )

    # -- diagnostics ------------------------------------------------------------------------

    def explain(self, audience: str) -> Explanation:
        """Consult every provider for ``audience`` and report each decision (no caching): the
        same discovery as a request (:meth:`_consult`), recording instead of stopping."""
        record = Record()
        _run(self._consult(audience, record))
        return Explanation(audience, record.decisions, record.selected, record.claims, record.error)


BROKER_URL_VARIABLES = ("AGENT_SANDBOX_BROKER_URL", "BROKER_URL")
"""Where the broker URL is read from (ours, then the original package's), as the client does."""


def broker_url_of(environ: Mapping[str, str]) -> str:
    """The broker URL of ``environ`` in its normal form (the token audience), else a
    ``ValueError`` saying where to set it."""
    url = next((environ[n] for n in BROKER_URL_VARIABLES if environ.get(n)), None)
    if url is None:
        raise ValueError(
            "explain() needs the broker URL (the audience a token must carry): pass it, "
            "explain('https://sandbox-broker.example'), or set AGENT_SANDBOX_BROKER_URL "
            "(`agent-sandbox-awx dev` prints it for a broker on this machine)."
        )
    return normalise_url(url)


def _skipped(result: TimedOut) -> str:
    return f"{result.reason}; skipped with a warning, discovery goes on"


def explain(
    audience: str | None = None,
    *,
    auth: CredentialSource | None = None,
    environ: Mapping[str, str] | None = None,
) -> Explanation:
    """Report, for ``audience`` (the broker URL; default: the broker URL of ``environ``, as
    everything else reads it: ``AGENT_SANDBOX_BROKER_URL``), what each credential provider
    decides.

    Without ``auth``, the discovery chain for ``environ`` (default ``os.environ``) is explained:
    every provider is consulted, including those after the winner (reported as "shadowed"), and
    plugins that failed to load are listed. With ``auth=`` (explicit: the chain is bypassed),
    that one source is reported; ``environ`` is then ignored.
    """
    if audience is None:
        audience = broker_url_of(os.environ if environ is None else environ)
    if auth is None:
        auth = DefaultCredentials(environ)
    if isinstance(auth, DefaultCredentials):
        return auth.explain(audience)
    name = type(auth).__name__
    try:
        credential = auth.get_credential(audience)
    except CredentialError as exc:
        return Explanation(
            audience,
            [ProviderDecision(name, "error", f"{type(exc).__name__}: {exc}")],
            None,
            None,
            exc,
        )
    decoded = decode_token(credential.token)
    detail = "explicit auth= (the discovery chain is bypassed); " + selected_detail(
        credential, decoded
    )
    return Explanation(
        audience,
        [ProviderDecision(name, "selected", detail)],
        name,
        decoded.claims() if decoded is not None else None,
        None,
    )
