"""What the broker needs of a trusted issuer: verification and policy, never signing.

:class:`TrustedIssuer` is the small description the verifier and the broker depend on: its URL,
audiences, provider, algorithms, the attributes it takes from a token's claims, and the policy
lookup for a verified caller.

The local broker's issuers (``k8s_agent_sandbox_awx.testing.Issuer``) also hold signing keys and
mint tokens; the broker only reads what is described here, so it never depends on them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from ._policy import Caller, Policy

__all__ = ["PublishedIssuer", "TrustedIssuer"]


class TrustedIssuer(Protocol):
    """An issuer whose tokens the broker accepts."""

    @property
    def url(self) -> str:
        """The ``iss`` claim of its tokens, and where its OpenID configuration is found."""
        ...

    @property
    def provider(self) -> str:
        """The provider its callers are attributed to (``Caller.provider``)."""
        ...

    @property
    def audiences(self) -> Sequence[str]:
        """The audiences its tokens are accepted for (one of them must be in ``aud``)."""
        ...

    @property
    def algorithms(self) -> Collection[str]:
        """The signing algorithms its tokens may use (never beyond the verifier's
        ``ALLOWED_ALGORITHMS``: no ``none``, no HMAC)."""
        ...

    def attributes_from(self, claims: Mapping[str, Any]) -> dict[str, Any]:
        """The provider's key attributes of a verified token (stamped and shown by whoami)."""
        ...

    def policy_for(self, caller: Caller) -> Policy:
        """The policy applied to ``caller`` (one of this issuer's); ``LookupError`` or
        ``ValueError`` when none applies (the broker answers ``403 policy_denied``)."""
        ...


class PublishedIssuer(TrustedIssuer, Protocol):
    """A trusted issuer whose documents the broker itself serves (``/issuers/<name>/...``): the
    local broker's own issuers."""

    def openid_configuration(self) -> dict[str, Any]: ...

    def jwks(self) -> dict[str, Any]: ...
