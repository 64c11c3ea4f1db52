"""Credential sources: the objects the client asks for a token on every request."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ._credential import Credential

__all__ = ["CredentialSource"]


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
