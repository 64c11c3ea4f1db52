"""The issuers of a configured broker (``broker serve``): :class:`ConfiguredIssuer` from
:class:`IssuerSettings`, and :func:`configured_verifier`, the verifier over them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._providers import attributes_for
from ._settings import IssuerSettings, SettingsError
from ._tokenreview import TokenReviewer
from ._verify import TokenVerifier

__all__ = ["ConfiguredIssuer", "configured_verifier"]


@dataclass(frozen=True)
class ConfiguredIssuer:
    """A trusted issuer from the configuration: what the verifier needs, nothing that signs.
    Its callers' policy is the broker's ``PolicySet``, not the issuer's."""

    settings: IssuerSettings

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def url(self) -> str:
        return self.settings.url

    @property
    def provider(self) -> str:
        return self.settings.provider

    def attributes_from(self, claims: Mapping[str, Any]) -> dict[str, Any]:
        """The provider's default attributes and the configured ``attributes``."""
        return attributes_for(self.settings.provider, self.settings.attributes, claims)


def configured_verifier(
    issuers: Sequence[IssuerSettings],
    *,
    audience: str,
    reviewer: TokenReviewer | None = None,
    skew_seconds: int = 30,
    max_token_bytes: int = 16 * 1024,
) -> TokenVerifier[ConfiguredIssuer]:
    """The verifier of a configured broker: ``audience`` is its public URL (the audience of
    issuers that name none), ``reviewer`` the Kubernetes API client (``tokenreview``
    issuers need it). Two issuers with one name or one URL are refused."""
    by_url: dict[str, ConfiguredIssuer] = {}
    names: set[str] = set()
    for settings in issuers:
        if settings.name in names:
            raise SettingsError(
                f"issuer {settings.name!r}", "name", "is used twice; give each issuer its own"
            )
        if settings.url in by_url:
            raise SettingsError(
                f"issuer {settings.name!r}",
                "url",
                f"{settings.url!r} is the url of issuer {by_url[settings.url].name!r} too: "
                "tokens name one issuer, so configure it once",
            )
        if settings.verification == "tokenreview" and reviewer is None:
            raise SettingsError(
                f"issuer {settings.name!r}",
                "verification",
                "'tokenreview' needs the kubernetes backend (its API client reviews tokens)",
            )
        names.add(settings.name)
        by_url[settings.url] = ConfiguredIssuer(settings)
    return TokenVerifier(
        audience=audience,
        issuers=lambda: by_url,
        reviewer=reviewer,
        skew_seconds=skew_seconds,
        max_token_bytes=max_token_bytes,
    )
