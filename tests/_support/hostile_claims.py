"""Hostile time claims for the fuzzing tests of the claim rules (issue 26, item 10): every
numeric claim (``exp``, ``nbf``, ``iat``) with NaN, infinities, huge, negative, fractional and
non-numeric values, written as the JSON text a forger would send (``1e999`` and a 400-digit
integer cannot be made with ``json.dumps``), and tokens really signed with those payloads.

``CASES`` maps a case's name to its JSON literal and whether a NumericDate with that value is
acceptable (a fractional date is; everything else is ``401 token_malformed``).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from typing import Any, Final

import jwt

TIME_CLAIMS: Final = ("exp", "nbf", "iat")

CASES: Final[dict[str, tuple[str, bool]]] = {
    "NaN": ("NaN", False),
    "Infinity": ("Infinity", False),
    "-Infinity": ("-Infinity", False),
    "1e999 (overflows to infinity)": ("1e999", False),
    "-1e999": ("-1e999", False),
    "1e308 (finite, far past year 9999)": ("1e308", False),
    "a 400-digit integer": ("1" + "0" * 400, False),
    "2**64": (str(2**64), False),
    "year 10000": ("253402300800", False),
    "negative": ("-1", False),
    "very negative": ("-1e10", False),
    "a string": ('"1900000000"', False),
    "true": ("true", False),
    "a list": ("[1]", False),
    "an object": ('{"t": 1}', False),
    "fractional": ("", True),  # filled in by literal(): a fractional date that is valid
}


def literal(case: str, claim: str) -> str:
    """The JSON text of ``case`` for ``claim`` (the valid fractional case: just past for
    ``nbf``/``iat``, ten minutes ahead for ``exp``)."""
    text, _ = CASES[case]
    if text:
        return text
    now = time.time()
    return repr(now + 600.25 if claim == "exp" else now - 60.75)


def payload_text(claims: Mapping[str, Any], claim: str, text: str) -> bytes:
    """``claims`` as JSON with ``claim`` set to the JSON text ``text`` as it is."""
    marker = "__hostile_value__"
    body = json.dumps({**claims, claim: marker})
    return body.replace(json.dumps(marker), text).encode()


def signed(
    claims: Mapping[str, Any], claim: str, text: str, key: Any, algorithm: str, kid: str
) -> str:
    """A JWT of ``claims`` with ``claim`` = ``text``, really signed with ``key``."""
    return jwt.api_jws.encode(
        payload_text(claims, claim, text), key, algorithm=algorithm, headers={"kid": kid}
    )


def unsigned(claims: Mapping[str, Any], claim: str, text: str, alg: str = "RS256") -> str:
    """A JWT of ``claims`` with ``claim`` = ``text`` and a made-up signature (as an anonymous
    caller sends it: in TokenReview mode the claim rules run on it before any review)."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    header = b64(json.dumps({"alg": alg, "kid": "k", "typ": "JWT"}).encode())
    return f"{header}.{b64(payload_text(claims, claim, text))}.{b64(b'x' * 64)}"
