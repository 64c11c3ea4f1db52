"""Credential sources: the objects the client asks for a token on every request."""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Hashable, Mapping
from typing import Protocol, runtime_checkable

from . import _cache
from ._credential import Credential
from ._credential_errors import (
    CredentialError,
    CredentialSourceError,
    EmptyCredentialError,
    NoCredentialsError,
)
from ._jwt import DecodedToken, cache_deadline, check_credential, check_token_text, redact
from ._providers import check_not_automounted, read_token_file

__all__ = ["CredentialSource", "KubernetesAuth", "OIDCTokenAuth", "accept_credential"]

TokenCallable = Callable[[], str] | Callable[[str], str]


@runtime_checkable
class CredentialSource(Protocol):
    """What ``auth=`` accepts, and what the discovery chain is.

    ``get_credential(audience)`` is called before every request. It returns a credential that is
    checked for ``audience`` (the broker URL) and expiry, re-reading file-backed sources each time
    and serving non-file ones from the shared cache. ``invalidate(audience)`` drops a cached
    credential (used after a broker 401) so that the next call fetches it again.
    """

    def get_credential(self, audience: str) -> Credential: ...

    def invalidate(self, audience: str) -> None: ...


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
    name = result.provider or provider
    token = check_token_text(result.token, provider=name, source=result.source)
    if token is not result.token or name is not result.provider:
        result = dataclasses.replace(result, token=token, provider=name)
    decoded = check_credential(result, audience, now)
    return result, decoded


def call_guarded(
    function: Callable[[], object], *, provider: str, source: str, secrets: tuple[str, ...] = ()
) -> object:
    """Call a provider; an unexpected exception becomes a :class:`CredentialSourceError`.

    Typed credential errors pass through unchanged. Other exceptions are reported by type and
    (redacted) message; the original is not chained, so that a secret it may carry cannot reach
    a traceback.
    """
    try:
        return function()
    except CredentialError:
        raise
    except Exception as exc:
        message = redact(str(exc), secrets)
        raise CredentialSourceError(
            f"The credential provider {provider!r} ({source}) failed with "
            f"{type(exc).__name__}: {message}. It applies here but is broken, so discovery stops "
            "instead of falling through to another identity.",
            provider=provider,
            source=source,
        ) from None


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


class OIDCTokenAuth:
    """An explicit OIDC token: a string, or a callable that returns one.

    - ``OIDCTokenAuth("eyJ...")``: that token, checked (expiry, audience) on every request.
    - ``OIDCTokenAuth(fetch)``: ``fetch(audience)`` if it accepts one positional argument, else
      ``fetch()``; the result goes through the shared cache (one fetch per expiry).
    - ``OIDCTokenAuth.from_env("MY_ID_TOKEN")``: the variable, read when needed, cached.

    Each instance has its own cache key, so two instances never see each other's tokens.
    """

    provider_name = "OIDCTokenAuth"

    def __init__(self, token_or_callable: str | TokenCallable, *, _source: str = "") -> None:
        self._key: Hashable = _cache.new_instance_key(self.provider_name)
        self._static: Credential | None = None
        self._fetch: Callable[[str], object] | None = None
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
        """A token in the environment variable ``name``, read on first use and cached."""
        env: Mapping[str, str] = os.environ if environ is None else environ
        source = f"environment variable {name}"

        def read() -> str:
            value = env.get(name)
            if value is None:
                raise NoCredentialsError(
                    f"{name} is not set, so OIDCTokenAuth.from_env({name!r}) has no token. Set "
                    "it to an OIDC token whose aud is the broker URL.",
                    tried=[(cls.provider_name, f"{name} is not set")],
                    provider=cls.provider_name,
                    source=source,
                )
            if not value.strip():
                raise EmptyCredentialError(
                    f"{name} is set but empty. Set it to an OIDC token whose aud is the broker "
                    "URL.",
                    provider=cls.provider_name,
                    source=source,
                )
            return value

        return cls(read, _source=source)

    def __repr__(self) -> str:
        return f"OIDCTokenAuth(source={self._source!r})"

    def get_credential(self, audience: str) -> Credential:
        if self._static is not None:
            check_credential(self._static, audience, _cache.now())
            return self._static
        return _cache.get_or_fetch((self._key, audience), lambda: self._fetch_checked(audience))

    def _fetch_checked(self, audience: str) -> tuple[Credential, float]:
        fetch = self._fetch
        assert fetch is not None
        value = call_guarded(
            lambda: fetch(audience), provider=self.provider_name, source=self._source
        )
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
            value, provider=self.provider_name, audience=audience, now=now
        )
        return credential, cache_deadline(decoded, now)

    def invalidate(self, audience: str) -> None:
        """Drop this source's cached token for ``audience``; the next request fetches again."""
        if self._static is None:
            _cache.invalidate((self._key, audience))
