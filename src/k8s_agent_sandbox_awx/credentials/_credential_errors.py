"""Typed errors of the credential framework.

All derive from the upstream ``SandboxError`` so that one ``except SandboxError`` catches every
failure of the SDK. Messages name the input, the rule and the fix, and never contain a token.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._upstream import SandboxError

__all__ = [
    "AudienceMismatchError",
    "CredentialError",
    "CredentialPluginWarning",
    "CredentialSourceError",
    "EmptyCredentialError",
    "ForbiddenTokenSourceError",
    "MalformedTokenError",
    "NoCredentialsError",
    "TokenExpiredError",
    "UnreadableCredentialError",
]


class CredentialError(SandboxError):
    """Base class: no usable token could be produced for the broker.

    ``provider`` is the name of the provider (or explicit source) concerned, ``source`` where it
    looked (a variable name, a path, a URL); both are empty when not applicable. Neither is ever
    the token.
    """

    def __init__(self, message: str, *, provider: str = "", source: str = "") -> None:
        super().__init__(message)
        self.provider = provider
        self.source = source


class NoCredentialsError(CredentialError):
    """No provider applied; the message lists every provider tried and why.

    ``tried`` holds ``(provider name, why it did not apply)`` pairs in discovery order.
    """

    def __init__(
        self,
        message: str,
        *,
        tried: Sequence[tuple[str, str]] = (),
        provider: str = "",
        source: str = "",
    ) -> None:
        super().__init__(message, provider=provider, source=source)
        self.tried: tuple[tuple[str, str], ...] = tuple(tried)


class CredentialSourceError(CredentialError):
    """A provider applies but is broken ("here but broken"); discovery stops with this error."""


class EmptyCredentialError(CredentialSourceError):
    """A variable or file that should hold a token is set/present but empty."""


class UnreadableCredentialError(CredentialSourceError):
    """A token file is present (or explicitly named) but cannot be read."""


class MalformedTokenError(CredentialSourceError):
    """A token looks like a JWT but its header or claims cannot be decoded, or it cannot be sent."""


class TokenExpiredError(CredentialError):
    """The token's ``exp`` is in the past; it would be rejected by the broker."""


class AudienceMismatchError(CredentialError):
    """The token's ``aud`` does not contain the broker URL; it is not sent."""


class ForbiddenTokenSourceError(CredentialError):
    """A source that must never be presented to the broker (the automounted API-server token)."""


class CredentialPluginWarning(UserWarning):
    """A credential provider plugin was refused or could not be loaded; it is skipped."""
