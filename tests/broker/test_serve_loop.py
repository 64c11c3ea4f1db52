"""``serve`` (``broker serve``) runs on uvloop's event loop where ``uvloop`` is installed (the
``[broker]`` extra), else on asyncio's own with one message saying so; the TLS handshake
deadline (``_http.handshake_deadline``) holds on either loop."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("uvicorn", reason="needs the [broker] extra")
pytest.importorskip("uvloop", reason="needs the [broker] extra")

import trustme
import uvloop

from k8s_agent_sandbox_awx.broker.server import _run
from k8s_agent_sandbox_awx.broker.server._http import handshake_deadline


def _served_on(monkeypatch: Any) -> type[asyncio.AbstractEventLoop]:
    loops: list[type[asyncio.AbstractEventLoop]] = []

    async def fake_run_server(served: Any, settings: Any, **kwargs: Any) -> None:
        loops.append(type(asyncio.get_running_loop()))

    monkeypatch.setattr(_run, "run_server", fake_run_server)
    monkeypatch.setattr(_run, "_configure_logging", lambda *args: None)
    _run.serve(object(), SimpleNamespace(log_level="info"))  # type: ignore[arg-type]
    [loop] = loops
    return loop


def test_serve_runs_on_uvloop_when_it_is_installed(monkeypatch: Any) -> None:
    assert issubclass(_served_on(monkeypatch), uvloop.Loop)


def test_without_uvloop_serve_runs_on_asyncios_loop_and_says_so_once(
    monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop: ImportError
    with caplog.at_level(logging.INFO, logger="k8s_agent_sandbox_awx.broker.server"):
        loop = _served_on(monkeypatch)
    assert not issubclass(loop, uvloop.Loop) and issubclass(loop, asyncio.BaseEventLoop)
    said = [r.getMessage() for r in caplog.records if "uvloop" in r.getMessage()]
    assert said == ["uvloop is not installed: serving on asyncio's own event loop"]


@pytest.mark.parametrize(
    "factory", [_run.event_loop_factory, lambda: None], ids=["uvloop", "asyncio"]
)
def test_the_tls_handshake_deadline_holds_on_either_loop(
    factory: Callable[[], Callable[[], asyncio.AbstractEventLoop] | None],
) -> None:
    """A client that connects and never completes TLS is closed at the deadline (asyncio's
    default is 60 s: the test's 20 s timeout would fire first), and the loop's own
    ``create_server`` is back afterwards."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)

    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        listener = socket.create_server(("127.0.0.1", 0))
        with handshake_deadline(loop, 0.2):
            server = await loop.create_server(asyncio.Protocol, sock=listener, ssl=context)
        assert "create_server" not in vars(loop)
        try:
            reader, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            got = await asyncio.wait_for(reader.read(), 20)
            writer.close()
            return got
        finally:
            server.close()

    with asyncio.Runner(loop_factory=factory()) as runner:
        assert runner.run(main()) == b""
