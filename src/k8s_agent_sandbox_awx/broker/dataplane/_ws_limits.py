"""The broker's bounds on the WebSockets it relays (docs/broker/security.md, "The broker's
resource limits"): how many one caller holds open at once, and how much one holds in memory.

- **Per caller**: :class:`CallerSlots` counts the WebSockets each caller (issuer and subject)
  holds open through this broker process, from the handshake's checks to the close; one more
  than ``max_per_caller`` is refused ``429 websocket_limit``, naming the limit and its setting.
  Several replicas count each on its own.
- **Per connection**: a message is at most ``max_message_bytes`` either way (the caller's side
  is uvicorn's ``ws_max_size``, the sandbox's ``websockets``' ``max_size``: a larger one closes
  the WebSocket with 1009 as soon as its frame's head says so), and the relay reads the next
  one only when the last was handed on (:mod:`._websocket`'s flow control). What one WebSocket
  holds while its receiver reads nothing is then a few messages of that size (docs/broker/
  security.md: the figures measured). Messages are relayed as they came, in one frame each.
- **A connection that fails on its own** (a server's message over the limit, a protocol error)
  is dropped after the relay's ``close_timeout`` (:func:`upstream_connection`): ``websockets``
  enforces that deadline only while something is being sent, so such a connection was held
  until TCP gave up, its caller's WebSocket with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..common._errors import ApiError
from ..config._schema import WEBSOCKET_MAX_MESSAGE_BYTES, WEBSOCKET_MAX_PER_CALLER
from ..identity._policy import Caller

__all__ = [
    "CallerSlots",
    "WebSocketLimits",
    "own_close",
    "upstream_connection",
]


@dataclass(frozen=True)
class WebSocketLimits:
    """``[server] websocket_max_per_caller`` and ``websocket_max_message_bytes``."""

    max_per_caller: int = WEBSOCKET_MAX_PER_CALLER
    max_message_bytes: int = WEBSOCKET_MAX_MESSAGE_BYTES


class CallerSlots:
    """The WebSockets each caller holds open (one event loop: no lock needed)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[tuple[str, str], int] = {}

    def held(self, caller: Caller) -> int:
        return self._held.get(caller.key, 0)

    @contextlib.contextmanager
    def hold(self, caller: Caller) -> Iterator[None]:
        """One of ``caller``'s slots for the block, or ``429 websocket_limit``."""
        key = caller.key
        held = self._held.get(key, 0)
        if held >= self.limit:
            raise ApiError(
                429,
                "websocket_limit",
                f"caller {caller.subject!r} holds {held} open WebSockets through this broker, "
                f"its maximum (websocket_max_per_caller = {self.limit}); close one first",
            )
        self._held[key] = held + 1
        try:
            yield
        finally:
            left = self._held[key] - 1
            if left:
                self._held[key] = left
            else:
                del self._held[key]


@functools.cache
def upstream_connection() -> type[Any]:
    """``websockets``' client connection (``connect(create_connection=...)``) that drops its
    transport at its close deadline once it is closing on its own, whether or not anything is
    sent (imported on first use: ``websockets`` is the ``[broker]`` extra's)."""
    from websockets.asyncio.client import ClientConnection

    class UpstreamConnection(ClientConnection):
        _dropper: asyncio.TimerHandle | None = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._dropper is None and self.close_deadline is not None:
                self._dropper = self.loop.call_at(self.close_deadline, self.transport.abort)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._dropper is not None:
                self._dropper.cancel()
            super().connection_lost(exc)

    return UpstreamConnection


def own_close(upstream: Any) -> tuple[int, str] | None:
    """The close the broker sent ``upstream`` when it failed the connection itself (1009: a
    message over the limit; 1002, 1007: a protocol error) and got none back: what to tell the
    caller (``None``: the server closed, or the connection just broke)."""
    sent, received = upstream.protocol.close_sent, upstream.protocol.close_rcvd
    if received is None and sent is not None and sent.code in (1002, 1007, 1009):
        return int(sent.code), str(sent.reason)
    return None
