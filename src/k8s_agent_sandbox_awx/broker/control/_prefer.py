"""The ``Prefer`` request header (RFC 7240) as the broker reads it.

The one preference it honours is ``clamp-lifetime`` on a create (both dialects): the lifetime
asked for is the client's default, not its caller's choice, so a lifetime past the policy's cap
is cut at the cap instead of refused. The answer then carries ``Preference-Applied:
clamp-lifetime``. Any other preference is ignored, as RFC 7240 asks of a server.
"""

from __future__ import annotations

from typing import Final

from starlette.datastructures import Headers

__all__ = ["CLAMP_LIFETIME", "applied", "prefers"]

CLAMP_LIFETIME: Final = "clamp-lifetime"


def prefers(headers: Headers, token: str) -> bool:
    """Whether a ``Prefer`` header of the request names the preference ``token`` (a list of
    ``token[=value][; parameter]`` items, case-insensitive, in one or several headers)."""
    for value in headers.getlist("prefer"):
        for item in value.split(","):
            name = item.split(";", 1)[0].split("=", 1)[0].strip().lower()
            if name == token:
                return True
    return False


def applied(token: str, was_applied: bool) -> dict[str, str]:
    """The answer's ``Preference-Applied`` header when the preference ``token`` was applied."""
    return {"Preference-Applied": token} if was_applied else {}
