"""The value rules several tables share: URLs, names, the listen address."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from ..._urls import masked_url
from ._reader import REQUIRED, Table, show

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LISTEN = re.compile(r"\[(?P<v6>[^\[\]]+)\]:(?P<p6>\d{1,5})|(?P<host>[^:\[\]]+):(?P<port>\d{1,5})")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def dotted(name: str) -> str:
    """A key as TOML writes it in a dotted key (quoted unless bare)."""
    return name if _BARE_KEY.fullmatch(name) else '"' + name.replace('"', '\\"') + '"'


def dns_label(value: str) -> str | None:
    """What is wrong with ``value`` as a DNS-1123 label (``None``: nothing)."""
    if len(value) > 63 or not _DNS_LABEL.fullmatch(value):
        return (
            "is not a DNS-1123 label (at most 63 characters: lower-case letters, digits, '-', "
            "starting and ending with a letter or digit)"
        )
    return None


def dns_subdomain(value: str) -> str | None:
    """What is wrong with ``value`` as a Kubernetes object name (a DNS-1123 subdomain)."""
    if len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value):
        return (
            "is not a Kubernetes object name (a DNS-1123 subdomain: lower-case letters, "
            "digits, '-' and '.', at most 253 characters)"
        )
    return None


def name(table: Table, key: str, *, example: str) -> str:
    """A table's ``name``: a DNS-1123 label (policies and logs refer to it)."""
    value: str = table.string(key, example=example)
    why = dns_label(value) if value else None
    if why:
        table.problem(key, f"{show(value)} {why}", f"e.g. {key} = {example}")
        return ""
    return value


def _shown(raw: str) -> str:
    """A URL for a message: its user info, query and fragment (maybe a password or a token:
    ``?private_token=...``) shown as ``***``."""
    return show(masked_url(raw))


def url_problem(raw: str, schemes: tuple[str, ...]) -> str | None:
    """What is wrong with ``raw`` as an absolute URL of one of ``schemes``, with a host and no
    user info, query or fragment (``None``: nothing)."""
    shown = _shown(raw)
    if any(c.isspace() or not c.isprintable() for c in raw):
        return f"{shown} contains a space or a control character"
    try:
        parts = urlsplit(raw)
        parts.port  # noqa: B018 (parsed to refuse a bad port)
    except ValueError:
        return f"{shown} is not a valid URL (its host or port does not parse)"
    wanted = " or ".join(f"{s}://" for s in schemes)
    if parts.scheme.lower() not in schemes or not parts.hostname:
        return f"{shown} is not an absolute {wanted} URL with a host"
    if parts.username is not None or parts.password is not None:
        return f"{shown} contains a user name or password (credentials are given by file path)"
    if parts.query or parts.fragment:
        return f"{shown} has a query or fragment"
    host = parts.hostname
    if ":" not in host and any(not x or len(x) > 63 for x in host.rstrip(".").split(".")):
        return f"{shown} has an invalid host name (an empty part or one over 63 characters)"
    return None


def url(
    table: Table, key: str, *, schemes: tuple[str, ...], example: str, required: bool = False
) -> str | None:
    """A URL key (``None``: absent, or a problem was recorded)."""
    value: str | None = table.string(key, REQUIRED if required else None, example=example)
    if not value:
        return None
    why = url_problem(value, schemes)
    if why:
        table.problem(key, why, f"write it as {key} = {example}")
        return None
    return value


def listen(table: Table, default: str = "0.0.0.0:8443") -> tuple[str, int]:
    """``listen``: ``host:port`` or ``[ipv6]:port`` (port 0: any free port)."""
    port_text = default.rpartition(":")[2]
    example = f'"0.0.0.0:{port_text}" (IPv4), "[::]:{port_text}" (IPv6) or "127.0.0.1:{port_text}"'
    value: str = table.string("listen", default, example=example)
    if not value:
        return "", 0
    match = _LISTEN.fullmatch(value)
    if match is None:
        bare_v6 = value.count(":") > 1 and "[" not in value
        rule = "an IPv6 address needs brackets" if bare_v6 else "is not host:port"
        table.problem("listen", f"{show(value)}: {rule}", f"write listen = {example}")
        return "", 0
    host = match["v6"] or match["host"]
    port = int(match["p6"] or match["port"])
    if match["v6"] is not None:
        try:
            ipaddress.IPv6Address(host.partition("%")[0])
        except ValueError:
            table.problem(
                "listen", f"{show(value)}: {host!r} is not an IPv6 address", f"e.g. {example}"
            )
            return "", 0
    if port > 65535:
        table.problem("listen", f"{show(value)}: port {port} is over 65535", f"e.g. {example}")
        return "", 0
    return host, port
