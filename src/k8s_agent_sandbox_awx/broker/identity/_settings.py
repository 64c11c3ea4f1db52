"""What the broker trusts of one issuer: plain, checked settings (a configuration file's
``[[issuers]]`` table maps onto :class:`IssuerSettings` field for field).

Every rule broken raises :class:`SettingsError` (a ``ValueError``) naming the issuer, the
field, the rule and the fix. The configuration loader reports its own errors with the file and
the dotted key first; these checks are the last line, so that settings built in code are held
to the same rules.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn
from urllib.parse import urlsplit

from ..._urls import masked_url

__all__ = [
    "ALLOWED_ALGORITHMS",
    "DEFAULT_STALE_FACTOR",
    "VERIFICATIONS",
    "IssuerSettings",
    "SettingsError",
]

ALLOWED_ALGORITHMS: Final = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
"""The asymmetric JWS algorithms the broker can verify; ``none`` and HMAC (``HS*``) never."""

VERIFICATIONS: Final = ("jwks", "tokenreview")
DEFAULT_STALE_FACTOR: Final = 12
"""Without ``jwks_max_stale_seconds``, the last good keys of an issuer whose JWKS cannot be
refreshed are kept for at most this many cache lifetimes (1 h with the default 300 s)."""

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class SettingsError(ValueError):
    """An issuer or policy setting breaks a rule: ``where`` (``issuer 'cluster'``), ``field``
    (``jwks_url``) and a message that says the rule and the fix."""

    def __init__(self, where: str, field: str, message: str) -> None:
        super().__init__(f"{where}: {field}: {message}")
        self.where = where
        self.field = field


def _https(value: object) -> bool:
    if not isinstance(value, str):
        return False
    parts = urlsplit(value)
    return parts.scheme == "https" and bool(parts.hostname) and not parts.fragment


@dataclass(frozen=True)
class IssuerSettings:
    """One trusted issuer.

    - ``name``: how policies refer to it (a DNS-1123 label); ``url``: exactly the tokens'
      ``iss`` (``https://``); ``provider``: the provider its callers are attributed to
      (``kubernetes``, ``gitlab``, ``github-actions``, ``google`` or any other name).
    - ``audiences``: the accepted ``aud`` values; empty = the broker's own URL.
    - ``algorithms``: the pinned JWS algorithms (a subset of :data:`ALLOWED_ALGORITHMS`).
    - ``clock_skew_seconds``: allowed on ``exp``/``nbf``/``iat`` (``None``: the verifier's).
    - Keys: ``discovery`` (``{url}/.well-known/openid-configuration`` names ``jwks_uri``; the
      document's ``issuer`` must equal ``url``) or ``jwks_url`` (used when set);
      ``jwks_cache_seconds`` (refreshed after this), ``jwks_min_refetch_seconds`` (an unknown
      ``kid`` refetches at most this often), ``jwks_max_stale_seconds`` (the last good keys
      are kept this long when refreshes fail; ``None``: :data:`DEFAULT_STALE_FACTOR` times the
      cache lifetime), ``ca_file`` (TLS trust; ``None``: the system's), ``token_file`` (a
      bearer token read again on every fetch), ``timeout_seconds`` and
      ``max_document_bytes`` for each fetch.
    - ``verification``: ``jwks``, or ``tokenreview`` (provider ``kubernetes`` only: the API
      server reviews each token; ``tokenreview_cache_seconds`` caches a positive answer, at
      most until the token's ``exp``; ``tokenreview_negative_cache_seconds`` a negative one).
    - ``attributes``: the claims kept as caller attributes (dotted names reach nested claims;
      a name the provider derives, like Kubernetes' ``namespace``, is taken as derived);
      ``None``: the provider's defaults; ``()``: none.
    """

    name: str
    url: str
    provider: str
    audiences: tuple[str, ...] = ()
    algorithms: tuple[str, ...] = ("RS256",)
    clock_skew_seconds: float | None = None
    discovery: bool = True
    jwks_url: str | None = None
    jwks_cache_seconds: float = 300.0
    jwks_min_refetch_seconds: float = 30.0
    jwks_max_stale_seconds: float | None = None
    ca_file: str | None = None  # a path (os.PathLike is accepted and kept as str)
    token_file: str | None = None
    timeout_seconds: float = 10.0
    max_document_bytes: int = 256 * 1024
    verification: str = "jwks"
    tokenreview_cache_seconds: float = 10.0
    tokenreview_negative_cache_seconds: float = 2.0
    attributes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("ca_file", "token_file"):
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for name in ("audiences", "algorithms", "attributes"):
            value = getattr(self, name)
            if value is None and name == "attributes":
                continue
            if isinstance(value, str) or not isinstance(value, Sequence):
                self._fail(name, f"must be a list of strings, not {value!r}")
            object.__setattr__(self, name, tuple(value))
        self._check_identity()
        self._check_algorithms()
        self._check_keys()
        self._check_durations()
        self._check_verification()

    # -- checks ------------------------------------------------------------------------------
    def _fail(self, field: str, message: str) -> NoReturn:
        raise SettingsError(f"issuer {self.name!r}", field, message)

    def _check_identity(self) -> None:
        if not isinstance(self.name, str) or not _LABEL.match(self.name):
            self._fail("name", "must be a DNS-1123 label (a-z, 0-9, '-'), e.g. 'cluster'")
        if not _https(self.url):
            shown = masked_url(self.url) if isinstance(self.url, str) else self.url
            self._fail("url", f"{shown!r} must be an https:// URL: exactly the tokens' iss")
        if not isinstance(self.provider, str) or not self.provider.strip():
            self._fail("provider", "must name the provider (kubernetes, gitlab, ...)")
        for field in ("audiences", "attributes"):
            bad = [v for v in getattr(self, field) or () if not isinstance(v, str) or not v]
            if bad:
                self._fail(field, f"every entry must be a non-empty string, not {bad[0]!r}")

    def _check_algorithms(self) -> None:
        if not self.algorithms:
            self._fail("algorithms", "must pin at least one algorithm, e.g. ['RS256']")
        for alg in self.algorithms:
            if not isinstance(alg, str) or alg.lower() == "none" or alg.upper().startswith("HS"):
                self._fail(
                    "algorithms",
                    f"{alg!r} is never allowed (no signature, or a shared secret that the "
                    f"public key would be); use one of {sorted(ALLOWED_ALGORITHMS)}",
                )
            if alg not in ALLOWED_ALGORITHMS:
                self._fail(
                    "algorithms", f"{alg!r} is not supported; use {sorted(ALLOWED_ALGORITHMS)}"
                )

    def _check_keys(self) -> None:
        if self.jwks_url is not None and not _https(self.jwks_url):
            shown = masked_url(self.jwks_url) if isinstance(self.jwks_url, str) else self.jwks_url
            self._fail("jwks_url", f"{shown!r} must be an https:// URL")
        if self.verification == "jwks" and self.jwks_url is None and not self.discovery:
            self._fail(
                "discovery", "is off and no jwks_url is given: set jwks_url or discovery = true"
            )
        for field in ("ca_file", "token_file"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                self._fail(field, f"must be a file path, not {value!r}")
        if isinstance(self.max_document_bytes, bool) or not isinstance(
            self.max_document_bytes, int
        ):
            self._fail("max_document_bytes", "must be an integer number of bytes")
        if self.max_document_bytes < 1024:
            self._fail("max_document_bytes", "must be at least 1024 bytes")

    def _number(self, field: str, low: float, high: float | None = None) -> float:
        value: Any = getattr(self, field)
        if isinstance(value, bool) or not isinstance(value, int | float):
            self._fail(field, f"must be a number of seconds, not {value!r}")
        if value < low or (high is not None and value > high):
            bound = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
            self._fail(field, f"{value!r} must be {bound} seconds")
        return float(value)

    def _check_durations(self) -> None:
        if self.clock_skew_seconds is not None:
            self._number("clock_skew_seconds", 0, 300)
        if self._number("jwks_cache_seconds", 0) <= 0:
            self._fail("jwks_cache_seconds", "must be more than 0 seconds")
        self._number("jwks_min_refetch_seconds", 0, 3600)
        if self.jwks_max_stale_seconds is not None:
            self._number("jwks_max_stale_seconds", self.jwks_cache_seconds)
        if self._number("timeout_seconds", 0, 300) <= 0:
            self._fail("timeout_seconds", "must be more than 0 seconds")
        self._number("tokenreview_cache_seconds", 0, 60)
        self._number("tokenreview_negative_cache_seconds", 0, 5)

    def _check_verification(self) -> None:
        if self.verification not in VERIFICATIONS:
            self._fail("verification", f"{self.verification!r} must be 'jwks' or 'tokenreview'")
        if self.verification == "tokenreview" and self.provider != "kubernetes":
            self._fail(
                "verification",
                "'tokenreview' asks the Kubernetes API server, so it needs provider = "
                "'kubernetes'; use 'jwks' for other issuers",
            )

    # -- derived -----------------------------------------------------------------------------
    @property
    def discovery_url(self) -> str:
        return f"{self.url.rstrip('/')}/.well-known/openid-configuration"

    @property
    def keep_stale_seconds(self) -> float:
        """How long the last good keys are kept while refreshes fail (see the fields)."""
        if self.jwks_max_stale_seconds is not None:
            return float(self.jwks_max_stale_seconds)
        return DEFAULT_STALE_FACTOR * float(self.jwks_cache_seconds)
