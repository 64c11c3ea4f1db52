"""Revoked tokens: refused from now on (``401 token_revoked``), whatever their signature says."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

import jwt

from ._verify import token_fingerprint

__all__ = ["Revocations"]


class Revocations:
    """The tokens no longer accepted, by their ``jti`` and by their digest (the token itself
    is not kept); thread-safe. ``is_revoked`` is a ``TokenVerifier``'s ``is_revoked``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._revoked: set[str] = set()

    def revoke(self, token: str) -> None:
        """Refuse ``token`` from now on (its ``jti`` read without verifying it: a revocation
        only ever refuses)."""
        with self._lock:
            self._revoked.add("sha256:" + token_fingerprint(token))
            with contextlib.suppress(jwt.PyJWTError, RecursionError):  # revoked by digest
                jti = jwt.decode(token, options={"verify_signature": False}).get("jti")
                if isinstance(jti, str):
                    self._revoked.add(f"jti:{jti}")

    def is_revoked(self, claims: Mapping[str, Any], token: str) -> bool:
        jti = claims.get("jti")
        with self._lock:
            if isinstance(jti, str) and f"jti:{jti}" in self._revoked:
                return True
            return "sha256:" + token_fingerprint(token) in self._revoked
