"""The effective configuration as TOML (``broker check``): defaults filled in and marked, files
shown by path only (the renderer never opens one), URLs without user info, query or fragment
(shown as ``***``: they may hold a credential). The output loads back to the same values (a URL
key never holds those parts; an audience may, and is then shown masked)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..._urls import masked_url
from ._checks import dotted
from ._schema import BrokerConfig

__all__ = ["render_config"]

_NOT_SET = {
    "attributes": "the provider's default",
    "jwks_url": "not set (keys found by discovery)",
    "jwks_max_stale_seconds": "not set (12 x jwks_cache_seconds)",
    "kubeconfig_file": "not set",
}


def render_config(config: BrokerConfig) -> str:
    """``config`` as a TOML document that :func:`load_config` reads back to equal values."""
    lines = [
        f"# The effective broker configuration of {config.path}",
        "# (defaults filled in and marked; secrets and keys are shown as their files' paths, a",
        "# URL's user info, query and fragment as ***)",
        "",
        "[server]",
    ]
    server = config.server
    lines += _pairs(config, "server", [("listen", server.listen)])
    lines += _pairs(config, "server", _fields(server, skip={"host", "port"}))
    for index, issuer in enumerate(config.issuers):
        lines += ["", "[[issuers]]", *_pairs(config, f"issuers[{index}]", _fields(issuer))]
    for index, policy in enumerate(config.policies):
        lines += ["", "[[policies]]", *_pairs(config, f"policies[{index}]", _fields(policy))]
    backend = config.backend
    lines += ["", "[backend]", *_pairs(config, "backend", [("kind", backend.kind)])]
    for name, table in (("kubernetes", backend.kubernetes), ("local", backend.local)):
        if table is not None:
            title = f"[backend.{name}]" + (
                "  # default" if f"backend.{name}" in config.defaulted else ""
            )
            lines += ["", title, *_pairs(config, f"backend.{name}", _fields(table))]
    lines += ["", "[logging]", *_pairs(config, "logging", _fields(config.logging))]
    lines += ["", "[audit]", *_pairs(config, "audit", _fields(config.audit))]
    if config.metrics is None:
        lines += ["", "# [metrics]: not set (no metrics listener)"]
    else:
        lines += ["", "[metrics]", *_pairs(config, "metrics", [("listen", config.metrics.listen)])]
    return "\n".join(lines) + "\n"


def _fields(value: Any, skip: Iterable[str] = ()) -> list[tuple[str, Any]]:
    return [
        (f.name, getattr(value, f.name))
        for f in dataclasses.fields(value)
        if f.name not in set(skip)
    ]


_URL_KEYS = frozenset({"public_url", "url", "jwks_url", "router_url", "audiences"})
"""Keys whose values are URLs (audiences: usually): shown without user info, query or fragment
(``masked_url``), which may hold a credential."""


def _pairs(config: BrokerConfig, prefix: str, pairs: list[tuple[str, Any]]) -> list[str]:
    lines = []
    for key, value in pairs:
        mark = "  # default" if f"{prefix}.{key}" in config.defaulted else ""
        if value is None:
            lines.append(f"# {key}: {_NOT_SET.get(key, 'not set')}")
        else:
            if key in _URL_KEYS:
                value = _masked(value)
            lines.append(f"{dotted(key)} = {_toml(value)}{mark}")
    return lines


def _masked(value: Any) -> Any:
    if isinstance(value, str):
        return masked_url(value)
    if isinstance(value, tuple | list):
        return type(value)(_masked(v) for v in value)
    return value


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a TOML string
    if isinstance(value, Mapping):
        items = ", ".join(f"{dotted(k)} = {_toml(v)}" for k, v in value.items())
        return f"{{ {items} }}" if items else "{}"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")
