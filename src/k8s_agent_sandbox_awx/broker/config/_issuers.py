"""``[[issuers]]``."""

from __future__ import annotations

import dataclasses
import difflib
import re

from . import _checks
from ._reader import Table, show
from ._schema import ALGORITHMS, PROVIDERS, IssuerConfig

_PROVIDER = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_URL_EXAMPLE = '"https://gitlab.example.com" (exactly the tokens\' iss)'


def _algorithm(value: str) -> str | None:
    if value.lower() == "none" or value.upper().startswith("HS"):
        return (
            "is never accepted: a JWKS publishes public keys, and a token signed with a "
            "shared secret (or none) is the algorithm-confusion attack"
        )
    if value not in ALGORITHMS:
        return f"is not a signature algorithm the broker accepts ({', '.join(ALGORITHMS)})"
    return None


def _provider(table: Table) -> str:
    value: str = table.string("provider", example='"kubernetes" (or gitlab, github-actions, ...)')
    if not value:
        return ""
    near = difflib.get_close_matches(value, PROVIDERS, n=1, cutoff=0.85)
    if not _PROVIDER.fullmatch(value):
        table.problem(
            "provider",
            f"{show(value)} is not a provider name (lower-case letters, digits and '-')",
            f"use one of {', '.join(PROVIDERS)}, or another name of that form",
        )
    elif near and near[0] != value:
        table.problem(
            "provider",
            f"{show(value)} is not a known provider but is close to {near[0]!r}",
            f"did you mean {near[0]!r}? (another name is allowed, but not one this close)",
        )
    else:
        return value
    return ""


def issuer(table: Table, public_url: str) -> IssuerConfig:
    name = _checks.name(table, "name", example='"cluster"')
    table.context = f'issuer "{name}"' if name else ""
    audience = public_url or "https://sandbox-broker.example.com"
    config = IssuerConfig(
        name=name,
        url=_checks.url(table, "url", schemes=("https",), example=_URL_EXAMPLE, required=True)
        or "",
        provider=_provider(table),
        audiences=table.strings(
            "audiences", (public_url,) if public_url else (), example=f'["{audience}"]'
        ),
        algorithms=table.strings("algorithms", ("RS256",), example='["RS256"]', item=_algorithm),
        clock_skew_seconds=table.number("clock_skew_seconds", 30.0, maximum=300),
        discovery=table.boolean("discovery", True),
        jwks_url=_checks.url(
            table, "jwks_url", schemes=("https",), example='"https://issuer.example/jwks"'
        ),
        jwks_cache_seconds=table.number("jwks_cache_seconds", 300.0, above=True),
        jwks_min_refetch_seconds=table.number("jwks_min_refetch_seconds", 30.0),
        jwks_max_stale_seconds=table.number("jwks_max_stale_seconds", None),
        ca_file=table.path("ca_file", what="CA bundle (PEM)"),
        token_file=table.path("token_file", what="token file"),
        verification=table.string(
            "verification", "jwks", example='"jwks"', choices=("jwks", "tokenreview")
        ),
        attributes=_attributes(table),
    )
    table.finish()
    return _key_source(table, config)


def _attributes(table: Table) -> tuple[str, ...] | None:
    """The claims kept as caller attributes (``None``: the provider's default; ``[]``: none)."""
    value: tuple[str, ...] | None = table.strings(
        "attributes",
        None,
        example='["project_path", "ref"]',
        item=lambda v: None if v.strip() else "is not a claim name",
        allow_empty=True,
    )
    return value


def _key_source(table: Table, config: IssuerConfig) -> IssuerConfig:
    """The rules between the keys that say where the signing keys come from."""
    if config.verification == "tokenreview":
        if config.provider and config.provider != "kubernetes" and table.ok("provider"):
            table.problem(
                "verification",
                f'"tokenreview" needs provider = "kubernetes" (this issuer is {config.provider!r})',
                'set verification = "jwks" for this issuer',
            )
        for key in ("jwks_url", "discovery", "ca_file", "token_file", "jwks_max_stale_seconds"):
            if table.given(key):
                table.problem(
                    key,
                    'is not used with verification = "tokenreview" (the API server reviews '
                    "each token through the backend's connection; no keys are read)",
                    f'remove {key}, or set verification = "jwks"',
                )
        return config
    if config.jwks_url and table.given("discovery") and config.discovery:
        table.problem(
            "discovery",
            "discovery = true and jwks_url are both given (one way to find the keys)",
            "remove discovery (a jwks_url turns discovery off), or remove jwks_url",
        )
    elif not config.discovery and not config.jwks_url and table.ok("jwks_url"):
        table.problem(
            "discovery",
            "is false but no jwks_url is given: the broker cannot find the issuer's keys",
            'add jwks_url = "https://..." or remove discovery = false',
        )
    if config.jwks_min_refetch_seconds > config.jwks_cache_seconds:
        table.problem(
            "jwks_min_refetch_seconds",
            f"({config.jwks_min_refetch_seconds:g}) is longer than jwks_cache_seconds "
            f"({config.jwks_cache_seconds:g})",
            "make it at most jwks_cache_seconds",
        )
    stale = config.jwks_max_stale_seconds
    if stale is not None and stale < config.jwks_cache_seconds:
        table.problem(
            "jwks_max_stale_seconds",
            f"({stale:g}) is shorter than jwks_cache_seconds ({config.jwks_cache_seconds:g}): "
            "the keys would be dropped before their first refresh",
            "make it at least jwks_cache_seconds (default: 12 x jwks_cache_seconds)",
        )
    if config.jwks_url:
        return dataclasses.replace(config, discovery=False)
    return config
