"""``--http [HOST:]PORT``: the address HTTP mode listens on, and whether it is loopback only
(standard library only: the CLI checks it before the SDK is imported)."""

from __future__ import annotations

import ipaddress

__all__ = ["DEFAULT_HOST", "LOOPBACK_NAMES", "ListenError", "is_loopback", "parse_listen"]

DEFAULT_HOST = "127.0.0.1"
LOOPBACK_NAMES = ("localhost",)


class ListenError(Exception):
    """HTTP mode cannot listen on its address (in use, not this machine's, ...)."""


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``PORT`` (on :data:`DEFAULT_HOST`) as ``(host, port)``;
    ``ValueError`` naming the rule."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = DEFAULT_HOST, text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f"--http {text!r}: the port must be a number from 0 to 65535 (0: any free one), as "
            "in --http 127.0.0.1:8765 or --http 8765"
        )
    if not host:
        raise ValueError(f"--http {text!r}: no host before the ':'; give 127.0.0.1:{port}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``; a name is
    never resolved: any other name counts as reachable from elsewhere."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
