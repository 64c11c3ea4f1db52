"""Local OIDC issuers: signing keys, JWKS, discovery documents and token minting."""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from ..broker.identity._policy import Policy
from ..broker.identity._providers import GITLAB_ATTRIBUTES, kubernetes_attributes
from ..broker.identity._settings import ALLOWED_ALGORITHMS, IssuerSettings

__all__ = [
    "GITLAB_ATTRIBUTES",
    "SUPPORTED_ALGORITHMS",
    "AttributesRule",
    "ClaimsRule",
    "Issuer",
    "kubernetes_attributes",
]

SUPPORTED_ALGORITHMS = ("RS256", "ES256")
_REGISTERED = frozenset({"iss", "sub", "aud", "exp", "nbf", "iat", "jti"})

ClaimsRule = Mapping[str, Any] | Callable[[str], Mapping[str, Any]] | None
AttributesRule = Sequence[str] | Callable[[Mapping[str, Any]], Mapping[str, Any]] | None


class _SigningKey:
    def __init__(self, algorithm: str) -> None:
        if algorithm == "RS256":
            self.private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        elif algorithm == "ES256":
            self.private = ec.generate_private_key(ec.SECP256R1())
        else:
            raise ValueError(
                f"unsupported issuer algorithm {algorithm!r}: use one of {SUPPORTED_ALGORITHMS}"
            )
        self.algorithm = algorithm
        self.kid = uuid.uuid4().hex[:16]

    def public_jwk(self) -> dict[str, Any]:
        algo = jwt.get_algorithm_by_name(self.algorithm)
        jwk: dict[str, Any] = algo.to_jwk(self.private.public_key(), as_dict=True)
        jwk.update(kid=self.kid, use="sig", alg=self.algorithm)
        return jwk


class Issuer:
    """A local OIDC issuer served at ``<broker url>/issuers/<name>``.

    It publishes ``/.well-known/openid-configuration`` and a JWKS (``/jwks``) and mints tokens
    with :meth:`issue_token`. Create one with ``LocalBroker.add_issuer``; the broker trusts it and
    applies its :attr:`policy` to callers whose tokens it signed.
    """

    def __init__(
        self,
        name: str,
        url: str,
        *,
        provider: str,
        policy: Policy,
        default_audience: str,
        algorithm: str = "RS256",
        claims: ClaimsRule = None,
        attributes: AttributesRule = None,
        audience_as_list: bool = False,
        on_keys_changed: Callable[[Issuer], None] | None = None,
    ) -> None:
        self.name = name
        self.url = url
        self.provider = provider
        self.policy = policy
        self.algorithm = algorithm
        self.default_audience = default_audience
        self.audience_as_list = audience_as_list
        self._claims_rule = claims
        self._attributes_rule = attributes
        self._lock = threading.Lock()
        self._keys: list[_SigningKey] = [_SigningKey(algorithm)]
        self._on_keys_changed = on_keys_changed

    def __repr__(self) -> str:
        return f"Issuer(name={self.name!r}, url={self.url!r}, provider={self.provider!r})"

    @functools.cached_property
    def settings(self) -> IssuerSettings:
        """How the broker verifies its tokens: discovery at its URL, the broker's audience
        and skew, RS256/384/512, PS256/384/512 and ES256/384 (the local broker's allow-list),
        an unknown kid refetched every time (tests rotate keys on purpose)."""
        return IssuerSettings(
            name=self.name,
            url=self.url,
            provider=self.provider,
            algorithms=tuple(sorted(ALLOWED_ALGORITHMS - {"ES512", "EdDSA"})),  # as ever
            jwks_min_refetch_seconds=0.0,
        )

    # -- documents -------------------------------------------------------------------------
    @property
    def jwks_uri(self) -> str:
        return f"{self.url}/jwks"

    def openid_configuration(self) -> dict[str, Any]:
        return {
            "issuer": self.url,
            "jwks_uri": self.jwks_uri,
            "response_types_supported": ["id_token"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": [self.algorithm],
        }

    def jwks(self) -> dict[str, Any]:
        with self._lock:
            return {"keys": [key.public_jwk() for key in self._keys]}

    @property
    def current_kid(self) -> str:
        with self._lock:
            return self._keys[-1].kid

    # -- keys ------------------------------------------------------------------------------
    def rotate_key(self, *, retire_old: bool = False) -> str:
        """Sign new tokens with a fresh key; return its ``kid``.

        The old key stays in the JWKS (tokens it signed stay valid) unless ``retire_old``: then
        it is removed and the broker forgets its cached copy, so those tokens fail with
        ``bad_signature``.
        """
        new = _SigningKey(self.algorithm)
        with self._lock:
            self._keys = [new] if retire_old else [*self._keys, new]
        if retire_old and self._on_keys_changed is not None:
            self._on_keys_changed(self)
        return new.kid

    # -- tokens ----------------------------------------------------------------------------
    def sign(
        self,
        payload: Mapping[str, Any],
        *,
        headers: Mapping[str, Any] | None = None,
        kid: str | None = None,
    ) -> str:
        """Sign ``payload`` exactly as given with the current key (tests use it to forge tokens)."""
        with self._lock:
            key = self._keys[-1] if kid is None else next(k for k in self._keys if k.kid == kid)
        hdrs = {"kid": key.kid, "typ": "JWT", **(headers or {})}
        return jwt.encode(dict(payload), key.private, algorithm=key.algorithm, headers=hdrs)

    def issue_token(
        self,
        subject: str,
        claims: Mapping[str, Any] | None = None,
        audience: str | Sequence[str] | None = None,
        ttl: int = 3600,
    ) -> str:
        """A signed token for ``subject``: standard claims, this issuer's claims, then ``claims``.

        ``audience`` defaults to the broker URL. ``ttl`` is in seconds from now (it may be
        negative to mint an expired token).
        """
        now = int(time.time())
        aud: str | list[str]
        if audience is None:
            aud = [self.default_audience] if self.audience_as_list else self.default_audience
        elif isinstance(audience, str):
            aud = [audience] if self.audience_as_list else audience
        else:
            aud = list(audience)
        payload: dict[str, Any] = {
            "iss": self.url,
            "sub": subject,
            "aud": aud,
            "iat": now,
            "nbf": now,
            "exp": now + ttl,
            "jti": str(uuid.uuid4()),
        }
        rule = self._claims_rule
        if rule is not None:
            payload.update(rule(subject) if callable(rule) else rule)
        if claims:
            payload.update(claims)
        return self.sign(payload)

    def attributes_from(self, claims: Mapping[str, Any]) -> dict[str, Any]:
        """The provider's key attributes of a verified token (stamped and shown by whoami)."""
        rule = self._attributes_rule
        if callable(rule):
            return dict(rule(claims))
        if rule is not None:
            return {name: claims[name] for name in rule if name in claims}
        return {
            name: value
            for name, value in claims.items()
            if name not in _REGISTERED and isinstance(value, str | int | float | bool)
        }
