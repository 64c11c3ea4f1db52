"""The ``Date`` of every answer, of the wall clock at the server's last tick (every 0.1 s).

uvicorn re-makes its ``Date`` header every tenth tick of its main loop, from ``time.time()``
as the ``time`` module has it then: after a pause of the event loop its answers stayed dated
from before the pause for up to nine more ticks, and in a process whose tests patch
``time.time`` (the local broker runs in its caller's test process) they carried the patched
time. :class:`FreshDateServer` re-makes it at every tick, from the wall clock the process had
at import (:func:`wall_clock`); a ``formatdate`` costs a few microseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from email.utils import formatdate
from typing import Final

import uvicorn

__all__ = ["FreshDateServer", "monotonic_clock", "wall_clock"]

# in a tuple, not module attributes: a monkeypatch of the time module does not reach them, nor a
# tool that swaps every module's reference to time.time for its own (freezegun)
_CLOCKS: Final[tuple[Callable[[], float], Callable[[], float]]] = (time.time, time.monotonic)


def wall_clock() -> float:
    """``time.time()`` of the function the process had when this module was imported."""
    return _CLOCKS[0]()


def monotonic_clock() -> float:
    """``time.monotonic()`` of the function the process had when this module was imported."""
    return _CLOCKS[1]()


class FreshDateServer(uvicorn.Server):
    """uvicorn's server, its ``Date`` header re-made at every tick from :func:`wall_clock`."""

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        dated = [(b"date", formatdate(wall_clock(), usegmt=True).encode())]
        self.server_state.default_headers = (
            dated if self.config.date_header else []
        ) + self.config.encoded_headers
        return should_exit
