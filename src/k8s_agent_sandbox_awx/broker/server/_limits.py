"""The broker's limit on a request's head, shared by :mod:`._http` and :mod:`._httptools`."""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_HEAD_BYTES", "MAX_PIPELINED"]

MAX_HEAD_BYTES: Final = 16 * 1024
"""The most a request's line and headers may take (as h11's default, which served before)."""

MAX_PIPELINED: Final = 16
"""The most requests a connection may have waiting behind the one being answered (pipelined):
the last of them is its last answer (llhttp parses every request a read brings, each then held
with its scope until its turn)."""
