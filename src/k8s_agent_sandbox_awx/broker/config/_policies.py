"""``[[policies]]``: which identities (issuer, subject glob, claims) get what."""

from __future__ import annotations

import re
from typing import Any

from ..identity._policy import SCOPES
from ..identity._ports import DEFAULT_PORTS, parse_ports
from . import _checks
from ._reader import REQUIRED, Table, show, type_name
from ._schema import CALLER_NAMESPACE, PolicyConfig

_PLACEHOLDER = re.compile(r"\{[^{}]*\}")


def policy(table: Table) -> PolicyConfig:
    name = _checks.name(table, "name", example='"team-a"')
    table.context = f'policy "{name}"' if name else ""
    config = PolicyConfig(
        name=name,
        issuer=table.string("issuer", example='"cluster" (the name of an [[issuers]] table)'),
        subject=_subject(table),
        claims=_claims(table),
        warm_pools=table.strings(
            "warm_pools",
            REQUIRED,
            example='["python-sandbox-warmpool"]',
            item=_checks.dns_subdomain,
        ),
        namespace=_namespace(table),
        max_sandboxes=table.number("max_sandboxes", 5, integer=True),
        max_lifetime_seconds=table.number("max_lifetime_seconds", 3600, integer=True, above=True),
        scopes=table.strings(
            "scopes",
            SCOPES,
            example=f"[{', '.join(map(repr, SCOPES))}]".replace("'", '"'),
            item=lambda v: None if v in SCOPES else f"is not a scope ({', '.join(SCOPES)})",
        ),
        ports=_ports(table),
    )
    table.finish()
    return config


def _ports(table: Table) -> tuple[int | str, ...]:
    """``ports``: ports and inclusive ``"LOW-HIGH"`` ranges (``[]``: none)."""
    example = '[8000, "3000-3999"]'
    present, value = table._raw("ports", DEFAULT_PORTS, f"add ports = {example}")
    if not present:
        return tuple(value)
    try:
        return tuple(parse_ports(value, "ports").describe())
    except ValueError as exc:
        table.problem("ports", str(exc).removeprefix("ports: "), f"write ports = {example}")
        return DEFAULT_PORTS


def _subject(table: Table) -> str:
    value: str = table.string("subject", "*", example='"system:serviceaccount:team-a:*"')
    if table.given("subject") and table.ok("subject") and not value:
        table.problem("subject", "is empty", 'use subject = "*" for any subject, or a glob')
    return value


def _namespace(table: Table) -> str:
    example = f'"team-a", or "{CALLER_NAMESPACE}" (the caller\'s own namespace)'
    value: str = table.string("namespace", example=example)
    if not value or value == CALLER_NAMESPACE:
        return value
    if _PLACEHOLDER.search(value):
        table.problem(
            "namespace",
            f"{show(value)} has a placeholder other than {CALLER_NAMESPACE}, the only one",
            f"write namespace = {example}",
        )
        return ""
    why = _checks.dns_label(value)
    if why:
        table.problem("namespace", f"{show(value)} {why}", f"write namespace = {example}")
        return ""
    return value


def _claims(table: Table) -> dict[str, tuple[str, ...]]:
    """``claims``: claim name -> a string or a list of strings (fnmatch globs)."""
    example = '{ project_path = "group/project", ref = ["main", "release-*"] }'
    raw: dict[str, Any] = table.mapping("claims", {}, example=example)
    claims: dict[str, tuple[str, ...]] = {}
    for claim, value in raw.items():
        key = f"claims.{_checks.dotted(claim)}"
        values = [value] if isinstance(value, str) else value
        if not claim.strip():
            table.problem(key, "is not a claim name (empty)", "name the claim to match")
        elif isinstance(value, dict):
            table.problem(
                key,
                "is a table: TOML reads an unquoted dotted name as nested tables",
                f'quote the claim name: "{_dotted_name(claim, value)}" = ...',
            )
        elif claim.startswith("kubernetes.io/"):
            table.problem(
                key,
                "names no claim of a Kubernetes token: its claim kubernetes.io is an object "
                "(namespace, serviceaccount.name, pod.name), read with a dotted name",
                f'write "kubernetes.io.{claim.removeprefix("kubernetes.io/")}"',
            )
        elif isinstance(value, bool | int | float):
            table.problem(
                key,
                f"is {type_name(value)}: claim values are matched as text (a non-string claim "
                "by its JSON text)",
                f'write it as a string: {_checks.dotted(claim)} = "{str(value).lower()}"'
                if isinstance(value, bool)
                else f'write it as a string: {_checks.dotted(claim)} = "{value}"',
            )
        elif not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            table.problem(
                key, f"must be a string or an array of strings, not {type_name(value)}", example
            )
        elif not values:
            table.problem(key, "is an empty array (it would match nothing)", "list the values")
        else:
            claims[claim] = tuple(values)
    return claims


def _dotted_name(claim: str, value: Any) -> str:
    """The dotted name an unquoted ``a.b.c = ...`` in a TOML inline table stood for."""
    parts = [claim]
    while isinstance(value, dict) and len(value) == 1:
        (key, value), *_ = value.items()
        parts.append(str(key))
    return ".".join(parts)
