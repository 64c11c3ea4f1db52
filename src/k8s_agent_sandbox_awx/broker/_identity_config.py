"""The configuration's issuers and policies as the identity layer's objects: what
``broker serve`` verifies callers and admits them with.

``identity_from_config(config)`` maps each ``[[issuers]]`` table (``IssuerConfig``) onto an
``IssuerSettings`` and each ``[[policies]]`` table (``PolicyConfig``) onto a ``PolicyRule``, key
for key, and builds the verifier (audience: ``server.public_url``) and the ``PolicySet``.
"""

from __future__ import annotations

from .config import BrokerConfig, IssuerConfig, PolicyConfig
from .identity._configured import ConfiguredIssuer, configured_verifier
from .identity._rules import PolicyRule, PolicySet
from .identity._settings import IssuerSettings
from .identity._tokenreview import TokenReviewer
from .identity._verify import TokenVerifier

__all__ = ["identity_from_config", "issuer_settings", "policy_rule"]


def issuer_settings(config: IssuerConfig) -> IssuerSettings:
    """One ``[[issuers]]`` table as the verifier's settings."""
    return IssuerSettings(
        name=config.name,
        url=config.url,
        provider=config.provider,
        audiences=config.audiences,
        algorithms=config.algorithms,
        clock_skew_seconds=config.clock_skew_seconds,
        discovery=config.discovery,
        jwks_url=config.jwks_url,
        jwks_cache_seconds=config.jwks_cache_seconds,
        jwks_min_refetch_seconds=config.jwks_min_refetch_seconds,
        jwks_max_stale_seconds=config.jwks_max_stale_seconds,
        ca_file=None if config.ca_file is None else str(config.ca_file),
        token_file=None if config.token_file is None else str(config.token_file),
        verification=config.verification,
        attributes=config.attributes,
    )


def policy_rule(config: PolicyConfig) -> PolicyRule:
    """One ``[[policies]]`` table as a rule."""
    return PolicyRule(
        name=config.name,
        issuer=config.issuer,
        warm_pools=config.warm_pools,
        namespace=config.namespace,
        subject=config.subject,
        claims=dict(config.claims),
        max_sandboxes=config.max_sandboxes,
        max_lifetime_seconds=config.max_lifetime_seconds,
        scopes=config.scopes,
        ports=config.ports,
    )


def identity_from_config(
    config: BrokerConfig, *, reviewer: TokenReviewer | None = None
) -> tuple[TokenVerifier[ConfiguredIssuer], PolicySet]:
    """The verifier and the policies of ``config``; ``reviewer`` is the kubernetes
    backend's API client (``tokenreview`` issuers need it)."""
    issuers = [issuer_settings(issuer) for issuer in config.issuers]
    verifier = configured_verifier(issuers, audience=config.server.public_url, reviewer=reviewer)
    return verifier, PolicySet([policy_rule(p) for p in config.policies], issuers)
