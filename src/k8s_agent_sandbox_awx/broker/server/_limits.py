"""The broker's limit on a request's head, shared by :mod:`._http` and :mod:`._httptools`."""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_HEAD_BYTES"]

MAX_HEAD_BYTES: Final = 16 * 1024
"""The most a request's line and headers may take (as h11's default, which served before)."""
