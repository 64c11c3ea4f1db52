"""Data-plane request targets in normal form: what the broker checks is what it forwards.

The broker decides a data-plane request's scope, counts its executions and forwards it, all
from one target. That only holds if nothing on the way reads the target differently: httpx
removes dot segments from the URL it sends (``/fs/../execute`` becomes ``/execute``), the
runtime's HTTP server turns a leading ``//`` into ``/``, and other servers and proxies decode
percent-encodings (``%2e%2e``, ``%2F``, ``%65``) or read ``\\`` as ``/`` and ``;...`` as a
path parameter. So the broker refuses every target whose path is not already in normal form
(docs/broker-api.md, "Normal form"):

- no ``\\`` and no ``;`` anywhere in the path (the query is not a path and is not checked);
- no malformed ``%`` and no percent-encoded unreserved character (``%2E``, ``%41``, ``%7E``...:
  their normal form is the character itself);
- no empty segment (``//``, a trailing ``/``) and no ``.`` or ``..`` segment;
- the route (every segment, except the file path after ``/download/``, ``/list/`` or
  ``/exists/``) is not percent-encoded at all;
- that file path may be empty (``/list/``: the base directory) and may hold any other
  percent-encoding (upstream's client and this SDK encode it whole, ``/`` as ``%2F``): it is
  forwarded as it is, so it stays that route's argument, and the runtime resolves it (a path
  that escapes the base directory, ``..%2F..%2Fetc``, is the runtime's ``403``).

A refusal is :class:`NonNormalTarget`; the broker answers it ``400 path_not_normalized``.

A port request (``X-Sandbox-Port`` other than the runtime's) goes to the user's own server,
whose routes the broker does not decide anything on: its target is forwarded exactly as sent
(``%2F``, ``%2e%2e``, ``;`` and ``//`` included, :func:`port_target`); only a target the
router's HTTP client would send changed (a ``.`` or ``..`` segment, a character that must be
percent-encoded) is refused, never rewritten.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import httpx

CODE = "path_not_normalized"
"""The broker's error code for a target that is not in normal form."""

LEGACY_FILE_ROUTES = frozenset({"download", "list", "exists"})
"""Legacy routes whose tail is one percent-encoded file path (``GET /download/{path}``)."""

_ESCAPE = re.compile(r"%(.?.?)")
_HEX = re.compile(r"^[0-9A-Fa-f]{2}$")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_SHOWN = 120
MEMO_SIZE = 1024
"""How many checked targets (those of at most :data:`MEMO_TARGET` bytes) are remembered: a
client sends the same few (``/execute``, ``/files?path=...``) again and again."""
MEMO_TARGET = 256


class NonNormalTarget(ValueError):
    """A data-plane target that is not in normal form; ``detail`` names it and the rule."""

    def __init__(self, path: str, reason: str, *, port: bool = False) -> None:
        shown = path if len(path) <= _SHOWN else path[: _SHOWN - 3] + "..."
        if port:
            self.detail = f"the request path {shown!r} cannot be forwarded to the port: {reason}"
            super().__init__(self.detail)
            return
        self.detail = (
            f"the request path {shown!r} is not in normal form: {reason}. The broker forwards "
            "exactly the path it checks, so send it resolved: no '.', '..' or empty segments, "
            "no '\\' or ';', and percent-encoding only in the query or in the file path after "
            "/download/, /list/ or /exists/"
        )
        super().__init__(self.detail)


@dataclass(frozen=True)
class Target:
    """A checked data-plane target: ``raw`` (path and query) is forwarded byte for byte;
    ``path`` (its path, percent-encoded as received) decides scope and counting."""

    raw: bytes
    path: str


def checked_target(raw: bytes) -> Target:
    """``raw`` (an origin-form target: path, then ``?`` and the query) if it is in normal
    form; else :class:`NonNormalTarget`. The answer for a short ``raw`` is remembered (a
    refusal is not: it is checked again each time)."""
    if len(raw) <= MEMO_TARGET:
        return _remembered_checked(raw)
    return _checked(raw)


def port_target(raw: bytes) -> Target:
    """``raw`` (origin-form) as a port request's target: forwarded byte for byte, so refused
    (:class:`NonNormalTarget`) only when the router's httpx would send it changed (remembered
    as :func:`checked_target`'s)."""
    if len(raw) <= MEMO_TARGET:
        return _remembered_port(raw)
    return _port(raw)


def _checked(raw: bytes) -> Target:
    path = raw.partition(b"?")[0].decode("ascii")
    _check_characters(path)
    segments = [] if path == "/" else path[1:].split("/")
    route = segments[:1] if segments[0:1] and segments[0] in LEGACY_FILE_ROUTES else segments
    for segment in route:
        _check_segment(path, segment)
        if "%" in segment:
            raise NonNormalTarget(
                path,
                f"its route segment {segment!r} is percent-encoded (only the query and a "
                "legacy file path may be)",
            )
    argument = segments[len(route) :]
    if argument != [""]:  # else the empty file path of /download/, /list/ or /exists/
        for segment in argument:
            _check_segment(path, segment)
    if _forwarded(raw) != raw:  # what the router's httpx would send instead
        raise NonNormalTarget(
            path,
            "it has characters that must be percent-encoded (such as '\"', '<', '{', '`' or "
            "a space in the query)",
        )
    return Target(raw, path)


def _port(raw: bytes) -> Target:
    path = raw.partition(b"?")[0].decode("ascii")
    segments = path.split("/")
    if "." in segments or ".." in segments:
        raise NonNormalTarget(
            path,
            "a port request's path is forwarded exactly as sent, and a '.' or '..' segment "
            "would be resolved on the way; send it resolved (or percent-encoded, '%2e%2e', if "
            "the server in the sandbox is to see the dots)",
            port=True,
        )
    if _forwarded(raw) != raw:
        raise NonNormalTarget(
            path,
            "it has characters that must be percent-encoded (such as '\"', '<', '{', '`' or "
            "a space in the query)",
            port=True,
        )
    return Target(raw, path)


_remembered_checked = functools.lru_cache(maxsize=MEMO_SIZE)(_checked)
_remembered_port = functools.lru_cache(maxsize=MEMO_SIZE)(_port)


def _forwarded(raw: bytes) -> bytes:
    """The target the router's httpx sends for ``raw`` (``b""``: none)."""
    try:
        return httpx.URL(scheme="http", host="127.0.0.1", raw_path=raw).raw_path
    except httpx.InvalidURL:
        return b""


def _check_characters(path: str) -> None:
    if "\\" in path:
        raise NonNormalTarget(path, "it has a backslash ('\\'), which some servers read as '/'")
    if ";" in path:
        raise NonNormalTarget(
            path, "it has a ';' (a path parameter, which some servers cut from its segment)"
        )
    for match in _ESCAPE.finditer(path):
        digits = match.group(1)
        if not _HEX.match(digits):
            raise NonNormalTarget(path, "it has a '%' that does not start a %XX escape")
        char = chr(int(digits, 16))
        if char in _UNRESERVED:
            raise NonNormalTarget(
                path, f"it percent-encodes {char!r} (%{digits}), which is sent as itself"
            )


def _check_segment(path: str, segment: str) -> None:
    if segment == "":
        raise NonNormalTarget(path, "it has an empty segment ('//' or a trailing '/')")
    if segment in (".", ".."):
        raise NonNormalTarget(path, f"it has a {segment!r} segment")
