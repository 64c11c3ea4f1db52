"""What the broker needs of a trusted issuer: verification and policy, never signing.

The local broker's issuers (``k8s_agent_sandbox_awx.testing.Issuer``) also hold signing keys and
mint tokens; the broker only reads what is described here, so it never depends on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ._policy import Policy
from ._settings import IssuerSettings

__all__ = ["PublishedIssuer", "TrustedIssuer", "VerifiableIssuer"]


class VerifiableIssuer(Protocol):
    """What the verifier needs of an issuer whose tokens the broker accepts."""

    @property
    def url(self) -> str:
        """The ``iss`` claim of its tokens, and where its OpenID configuration is found."""
        ...

    @property
    def provider(self) -> str:
        """The provider its callers are attributed to (``Caller.provider``)."""
        ...

    @property
    def settings(self) -> IssuerSettings:
        """How its tokens are verified (audiences, algorithms, skew, keys; see
        ``IssuerSettings``)."""
        ...

    def attributes_from(self, claims: Mapping[str, Any]) -> dict[str, Any]:
        """The provider's key attributes of a verified token (stamped and shown by whoami)."""
        ...


class TrustedIssuer(VerifiableIssuer, Protocol):
    """An issuer whose tokens the broker accepts, with the policy of its callers (the local
    broker's; a configured broker finds the policy with ``PolicySet.policy_for``)."""

    @property
    def policy(self) -> Policy:
        """The policy applied to its callers."""
        ...


class PublishedIssuer(TrustedIssuer, Protocol):
    """A trusted issuer whose documents the broker itself serves (``/issuers/<name>/...``): the
    local broker's own issuers."""

    def openid_configuration(self) -> dict[str, Any]: ...

    def jwks(self) -> dict[str, Any]: ...
