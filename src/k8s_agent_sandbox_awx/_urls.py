"""The one URL rule, shared by the client (the broker URL, token audiences) and the broker (its
``public_url``, the default audience of the tokens it accepts): both sides must agree on it, and
neither imports the other."""

from __future__ import annotations

import functools
from urllib.parse import urlsplit

__all__ = ["masked_url", "normalise_url"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalise_url(url: str) -> str:
    """The comparison form of a URL: scheme and host lower-cased, default port dropped.

    A trailing slash is ignored (``https://b.example/`` equals ``https://b.example``); the path is
    otherwise compared exactly and a query or fragment is kept. A string that is not an absolute
    URL is only stripped of surrounding whitespace and one trailing slash.
    """
    return _normalise_url(url)


@functools.lru_cache(maxsize=256)
def _normalise_url(url: str) -> str:
    text = url.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return text.rstrip("/")
    if not parts.scheme or not parts.netloc or parts.hostname is None:
        return text.rstrip("/")
    scheme = parts.scheme.lower()
    host = parts.hostname.lower()
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    if parts.username is not None:
        netloc = f"{parts.username}@{netloc}"
    path = parts.path.rstrip("/")
    result = f"{scheme}://{netloc}{path}"
    if parts.query:
        result += f"?{parts.query}"
    if parts.fragment:
        result += f"#{parts.fragment}"
    return result


def masked_url(text: str) -> str:
    """``text`` (a URL, or what was given as one) for a message or a printed configuration: its
    user info, query and fragment, any of which may hold a credential (``user:password@``,
    ``?private_token=...``, ``#access_token=...``), each shown as ``***``; the scheme, host,
    port and path stay. Works on text that does not parse as a URL too."""
    scheme, sep, rest = text.partition("://")
    head = scheme + sep if sep else ""
    if not sep:
        rest = text
    rest, fragment, _ = rest.partition("#")
    rest, query, _ = rest.partition("?")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    masked = head + authority + slash + path
    return masked + ("?***" if query else "") + ("#***" if fragment else "")
