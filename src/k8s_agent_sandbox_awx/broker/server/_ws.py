"""Whether the broker's server accepts WebSocket upgrades (port requests, issue 23)."""

from __future__ import annotations

import importlib.util


def ws_protocol() -> str:
    """uvicorn's ``ws=`` setting: WebSockets when ``websockets`` is installed (the [broker] and
    [local] extras), else none (a handshake is then a plain request: the broker's ``501
    websocket_unsupported``)."""
    return "websockets-sansio" if importlib.util.find_spec("websockets") else "none"
