"""Credential sources: the objects the client asks for a token on every request."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
from collections.abc import Awaitable, Callable, Hashable, Mapping
from types import TracebackType
from typing import NoReturn, Protocol, runtime_checkable

from . import _cache
from ._bridge import aresult, awaited_in_thread, in_thread, result
from ._credential import Credential
from ._credential_errors import (
    CredentialError,
    CredentialSourceError,
    NoCredentialsError,
)
from ._jwt import DecodedToken, cache_deadline, check_credential, check_token_text, redact
from ._providers import check_not_automounted, env_setting, read_token_file

__all__ = [
    "CredentialSource",
    "KubernetesAuth",
    "OIDCTokenAuth",
    "accept_credential",
    "plain_answer",
]

TokenCallable = (
    Callable[[], str]
    | Callable[[str], str]
    | Callable[[], Awaitable[str]]
    | Callable[[str], Awaitable[str]]
)


@runtime_checkable
class CredentialSource(Protocol):
    """What ``auth=`` accepts, and what the discovery chain is.

    ``get_credential(audience)`` is called before every request by the sync client,
    ``await aget_credential(audience)`` by the async client; both return a credential that is
    checked for ``audience`` (the broker URL) and expiry, re-reading file-backed sources each time
    and serving non-file ones from the shared cache (one cache for both paths: a token fetched by
    one is served to the other). ``invalidate(audience)`` drops a cached credential (used after a
    broker 401) so that the next call fetches it again; it is synchronous and non-blocking (no
    I/O, one short-held lock), so async code calls it directly and there is no ``ainvalidate``.
    """

    def get_credential(self, audience: str) -> Credential: ...

    async def aget_credential(self, audience: str) -> Credential: ...

    def invalidate(self, audience: str) -> None: ...


def plain_answer(result: object) -> object:
    """A provider's answer read once, as plain data (call it inside the provider's guard): a
    :class:`Credential` of any subclass becomes a plain ``Credential`` whose ``str`` fields are
    exact ``str`` objects, so that no code of the plugin runs later, outside its guard (a
    property, or a ``str`` subclass's method, that raises or answers differently each time).
    A field that is not a ``str`` stays as it is (for :func:`accept_credential` to name it);
    any other answer is returned as it is."""
    if not isinstance(result, Credential):
        return result

    def exact(value: object) -> object:
        return str.__str__(value) if isinstance(value, str) else value

    return Credential(
        exact(result.token),  # type: ignore[arg-type]
        exact(result.provider),  # type: ignore[arg-type]
        file_backed=bool(result.file_backed),
        source=exact(result.source),  # type: ignore[arg-type]
    )


def accept_credential(
    result: object, *, provider: str, audience: str, now: float
) -> tuple[Credential, DecodedToken | None]:
    """Validate what a provider returned (I/O-free; shared by every source and the chain).

    The result must be a :class:`Credential`; its token is stripped and checked for sendable
    characters, then decoded and checked for expiry and audience. A missing provider name is
    filled in.
    """
    if not isinstance(result, Credential):
        raise CredentialSourceError(
            f"The credential provider {provider!r} returned {type(result).__name__}; a provider "
            "must return a Credential or None (see docs/writing-plugins.md).",
            provider=provider,
        )
    for attribute in ("token", "provider", "source"):
        value = getattr(result, attribute)
        if not isinstance(value, str):
            raise CredentialSourceError(
                f"The credential provider {provider!r} returned a Credential whose {attribute} "
                f"is {type(value).__name__}, not str (see docs/writing-plugins.md).",
                provider=provider,
            )
    name = result.provider or provider
    token = check_token_text(result.token, provider=name, source=result.source)
    if token is not result.token or name is not result.provider:
        result = dataclasses.replace(result, token=token, provider=name)
    decoded = check_credential(result, audience, now)
    return result, decoded


def _passes_through(exc: BaseException) -> bool:
    """What a provider call never swallows: an interrupt, the closing of a coroutine, and the
    cancellation of the current asyncio task (a ``CancelledError`` while it is being cancelled)."""
    if isinstance(exc, KeyboardInterrupt | GeneratorExit):
        return True
    if not isinstance(exc, asyncio.CancelledError):
        return False
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop: nobody is cancelling this call
        return False
    return task is not None and task.cancelling() > 0


class ProviderGuard:
    """Around a provider call (sync or awaited): an unexpected exception becomes a
    :class:`CredentialSourceError`.

    Typed credential errors, ``KeyboardInterrupt``, ``GeneratorExit`` and the cancellation of the
    current task pass through. Any other exception, ``BaseException`` included (a provider that
    calls ``sys.exit()``), is reported by type and (redacted) message, and the original is dropped:
    the block is left with the error stored, and the caller raises it after the block with
    :meth:`reraise`, outside any ``except``, so that neither ``__cause__`` nor ``__context__``
    refers to an exception whose message or traceback may carry a secret::

        with ProviderGuard(provider=..., source=...) as guard:
            return fetch()
        guard.reraise()
    """

    def __init__(self, *, provider: str, source: str, secrets: tuple[str, ...] = ()) -> None:
        self.provider, self.source, self.secrets = provider, source, secrets
        self.error: CredentialSourceError | None = None

    def __enter__(self) -> ProviderGuard:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if exc is None or isinstance(exc, CredentialError) or _passes_through(exc):
            return False
        message = redact(str(exc), self.secrets)
        self.error = CredentialSourceError(
            f"The credential provider {self.provider!r} ({self.source}) failed with "
            f"{type(exc).__name__}: {message}. It applies here but is broken, so discovery stops "
            "instead of falling through to another identity.",
            provider=self.provider,
            source=self.source,
        )
        return True

    def reraise(self) -> NoReturn:
        """Raise the stored error (call it right after the block, which it ended)."""
        assert self.error is not None
        raise self.error from None


class KubernetesAuth:
    """A token file (a projected ServiceAccount token), re-read on every request.

    Never caches: each :meth:`get_credential` opens the path again, so the kubelet's atomic
    ``..data`` symlink swap is picked up by the next request. The automounted API-server token
    (``/var/run/secrets/kubernetes.io/serviceaccount/token``, also under ``/run``, also through a
    symlink) is refused with :class:`ForbiddenTokenSourceError`.
    """

    provider_name = "KubernetesAuth"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)
        check_not_automounted(self._path, provider=self.provider_name, source=self._path)

    @property
    def path(self) -> str:
        return self._path

    def __repr__(self) -> str:
        return f"KubernetesAuth({self._path!r})"

    def get_credential(self, audience: str) -> Credential:
        text = read_token_file(
            self._path, provider=self.provider_name, source=self._path, missing_ok=False
        )
        assert text is not None
        token = check_token_text(text, provider=self.provider_name, source=self._path)
        credential = Credential(token, self.provider_name, file_backed=True, source=self._path)
        check_credential(credential, audience, _cache.now())
        return credential

    async def aget_credential(self, audience: str) -> Credential:
        """:meth:`get_credential` for asyncio code: the file is read inline, on the loop.

        One ``open``/``read`` (at most ``MAX_TOKEN_CHARS + 2`` bytes)/``close`` of a small local
        file costs a few µs, far less than handing it to a worker thread (measured in
        ``bench/bench_credentials.py``; see docs/credentials.md, "The async path").
        """
        return self.get_credential(audience)

    def invalidate(self, audience: str) -> None:
        """Nothing to drop: the file is read on every request."""


def _accepts_audience(function: Callable[..., object]) -> bool:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind("audience")
    except TypeError:
        return False
    return True


def _is_async_callable(function: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one (partials included)."""
    if inspect.iscoroutinefunction(function):
        return True
    call = getattr(function, "__call__", None)  # noqa: B004 - the bound method itself is wanted
    return call is not None and inspect.iscoroutinefunction(call)


class OIDCTokenAuth:
    """An explicit OIDC token: a string, or a callable that returns one.

    - ``OIDCTokenAuth("eyJ...")``: that token, checked (expiry, audience) on every request.
    - ``OIDCTokenAuth(fetch)``: ``fetch(audience)`` if it accepts one positional argument, else
      ``fetch()``; the result goes through the shared cache (one fetch per expiry). ``fetch``
      may be an ``async def`` (or return an awaitable, such as a coroutine).
    - ``OIDCTokenAuth.from_env("MY_ID_TOKEN")``: the variable, read when needed, cached.

    How a callable is called on a cache miss:

    ============================  ===========================  ==============================
    callable                      ``get_credential`` (sync)    ``aget_credential`` (async)
    ============================  ===========================  ==============================
    plain function                called in the caller         in a helper thread (it may
                                                               block, e.g. an HTTP fetch)
    ``async def``                 awaited on a fresh loop in   awaited on the running loop
                                  a helper thread
    returns an awaitable          called in the caller; the    called in a helper thread; the
                                  awaitable is awaited in a    awaitable is awaited on the
                                  helper thread                running loop
    ============================  ===========================  ==============================

    A helper thread is a new daemon thread that runs with the caller's context variables.
    A callable that needs the running event loop (creates tasks) must be an ``async def``.
    Each instance has its own cache key, so two instances never see each other's tokens.
    """

    provider_name = "OIDCTokenAuth"

    def __init__(
        self,
        token_or_callable: str | TokenCallable,
        *,
        _source: str = "",
        _blocking: bool = True,
    ) -> None:
        self._key: Hashable = _cache.new_instance_key(self.provider_name)
        self._static: Credential | None = None
        self._fetch: Callable[[str], object] | None = None
        self._async = False
        self._blocking = _blocking
        if isinstance(token_or_callable, str):
            self._source = _source or "a token string"
            token = check_token_text(
                token_or_callable, provider=self.provider_name, source=self._source
            )
            self._static = Credential(token, self.provider_name, source=self._source)
        elif callable(token_or_callable):
            function = token_or_callable
            name = getattr(function, "__qualname__", None) or type(function).__name__
            self._source = _source or f"callable {name}"
            self._async = _is_async_callable(function)
            if _accepts_audience(function):
                self._fetch = function  # type: ignore[assignment]
            else:
                self._fetch = lambda _audience: function()  # type: ignore[call-arg]
        else:
            raise TypeError(
                "OIDCTokenAuth takes a token (str) or a callable returning one, not "
                f"{type(token_or_callable).__name__}"
            )

    @classmethod
    def from_env(cls, name: str, *, environ: Mapping[str, str] | None = None) -> OIDCTokenAuth:
        """A token in the environment variable ``name``, read on first use and cached.

        Reading a variable does not block, so the async path reads it inline.
        """
        env: Mapping[str, str] = os.environ if environ is None else environ
        source = f"environment variable {name}"

        def read() -> str:
            value = env_setting(
                env,
                name,
                provider=cls.provider_name,
                source=source,
                fix="Set it to an OIDC token whose aud is the broker URL.",
            )
            if value is None:
                raise NoCredentialsError(
                    f"{name} is not set, so OIDCTokenAuth.from_env({name!r}) has no token. Set "
                    "it to an OIDC token whose aud is the broker URL.",
                    tried=[(cls.provider_name, f"{name} is not set")],
                    provider=cls.provider_name,
                    source=source,
                )
            return value

        return cls(read, _source=source, _blocking=False)

    def __repr__(self) -> str:
        return f"OIDCTokenAuth(source={self._source!r})"

    def get_credential(self, audience: str) -> Credential:
        if self._static is not None:
            check_credential(self._static, audience, _cache.now())
            return self._static
        return _cache.get_or_fetch((self._key, audience), lambda: self._fetch_checked(audience))

    async def aget_credential(self, audience: str) -> Credential:
        """:meth:`get_credential` for asyncio code (same cache, same checks)."""
        if self._static is not None:
            check_credential(self._static, audience, _cache.now())
            return self._static
        return await _cache.aget_or_fetch(
            (self._key, audience), lambda: self._afetch_checked(audience)
        )

    def _fetch_checked(self, audience: str) -> tuple[Credential, float]:
        fetch = self._fetch
        assert fetch is not None
        with ProviderGuard(provider=self.provider_name, source=self._source) as guard:
            value = fetch(audience)
            if inspect.isawaitable(value):
                value = result(awaited_in_thread(value))
            return self._accept(value, audience)
        guard.reraise()

    async def _afetch_checked(self, audience: str) -> tuple[Credential, float]:
        fetch = self._fetch
        assert fetch is not None
        with ProviderGuard(provider=self.provider_name, source=self._source) as guard:
            if self._async or not self._blocking:
                value = fetch(audience)
            else:
                value = await aresult(in_thread(lambda: fetch(audience)))
            if inspect.isawaitable(value):
                value = await value
            return self._accept(value, audience)
        guard.reraise()

    def _accept(self, value: object, audience: str) -> tuple[Credential, float]:
        """Check what the callable returned (I/O-free; shared by both paths)."""
        if value is None:
            raise NoCredentialsError(
                f"The token callable ({self._source}) returned None: it has no token for "
                f"{audience!r}.",
                tried=[(self.provider_name, f"{self._source} returned None")],
                provider=self.provider_name,
                source=self._source,
            )
        if isinstance(value, str):
            value = Credential(value, self.provider_name, source=self._source)
        elif not isinstance(value, Credential):
            raise CredentialSourceError(
                f"The token callable ({self._source}) returned {type(value).__name__}; it must "
                "return the token as a str.",
                provider=self.provider_name,
                source=self._source,
            )
        now = _cache.now()
        credential, decoded = accept_credential(
            plain_answer(value), provider=self.provider_name, audience=audience, now=now
        )
        return credential, cache_deadline(decoded, now)

    def invalidate(self, audience: str) -> None:
        """Drop this source's cached token for ``audience``; the next request fetches again.

        Non-blocking (no I/O): async code calls it directly.
        """
        if self._static is None:
            _cache.invalidate((self._key, audience))
