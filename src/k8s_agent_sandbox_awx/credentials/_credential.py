"""The value types every credential provider speaks: requests in, credentials out.

Nothing here knows about the broker's HTTP API; these types are shared by the built-in
providers, third-party plugins and the client that transports the token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Credential", "CredentialRequest", "ProviderInfo"]


@dataclass(frozen=True, repr=False, eq=False)
class Credential:
    """A token found by a provider, with where it came from.

    ``token`` is the secret; it never appears in ``repr()`` or ``str()``.
    ``file_backed`` credentials are re-read on every request and never cached;
    all others go through the shared credential cache until shortly before ``exp``.
    """

    token: str = field(repr=False)
    provider: str
    file_backed: bool = False
    source: str = ""
    """Where the token came from, for humans: a variable name, a path, a URL. Never the token."""

    def __repr__(self) -> str:
        kind = "file" if self.file_backed else "cached"
        return (
            f"Credential(provider={self.provider!r}, source={self.source!r}, {kind}, "
            "token=<redacted>)"
        )

    __str__ = __repr__

    def __reduce__(self) -> Any:  # pragma: no cover - defensive
        raise TypeError("Credential objects hold a secret and cannot be pickled")


@dataclass(frozen=True)
class ProviderInfo:
    """What a provider plugin declares about itself (``agent_sandbox_provider_info``).

    ``priority``: among third-party providers, higher is consulted first; ties are broken by
    entry-point name. ``hint``: what a user sets to make this provider apply; shown in the
    aggregated error when no provider applies.
    """

    priority: int = 0
    hint: str = ""
    description: str = ""


@dataclass(frozen=True, eq=False)
class CredentialRequest:
    """What the host asks a provider for: a token for ``audience`` (the broker URL).

    ``environ`` is the environment to look in (normally ``os.environ``; tests pass their own).
    ``timeout`` is the time in seconds a provider that fetches over the network may spend.
    A provider that does not apply returns ``request.not_here("why")`` (which is ``None``).
    """

    audience: str
    environ: Mapping[str, str] = field(repr=False)
    """Never shown in ``repr()``: the environment may hold tokens."""
    timeout: float = 5.0
    _reasons: list[str] = field(default_factory=list, repr=False, compare=False)

    def not_here(self, reason: str) -> Credential | None:
        """Record why this provider does not apply, and return ``None`` (its answer).

        Always returns ``None``; it is typed ``Credential | None`` so that the idiom
        ``return request.not_here("why")`` type-checks in a hook implementation.
        """
        self._reasons.append(reason)
        return None

    @property
    def reasons(self) -> tuple[str, ...]:
        """The reasons recorded by :meth:`not_here`, in order."""
        return tuple(self._reasons)
