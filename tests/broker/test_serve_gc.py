"""``serve`` (``broker serve``'s own server) freezes what start-up made out of the garbage
collector's full collections once it accepts connections, and still tells its caller."""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("uvicorn", reason="needs the [broker] extra")

from k8s_agent_sandbox_awx.broker.server import _run


def test_serve_freezes_start_up_objects_once_it_accepts(monkeypatch: Any) -> None:
    seen: list[tuple[str, int]] = []

    async def fake_run_server(served: Any, settings: Any, **kwargs: Any) -> None:
        assert gc.get_freeze_count() == 0  # nothing frozen before the server accepts
        kwargs["on_started"]("https://127.0.0.1:1")

    monkeypatch.setattr(_run, "run_server", fake_run_server)
    monkeypatch.setattr(_run, "_configure_logging", lambda *args: None)
    gc.unfreeze()
    try:
        _run.serve(
            object(),  # type: ignore[arg-type]
            SimpleNamespace(log_level="info"),
            on_started=lambda url: seen.append((url, gc.get_freeze_count())),
        )
        [(url, frozen)] = seen
        assert url == "https://127.0.0.1:1"
        assert frozen > 1000  # the modules and what start-up made
    finally:
        gc.unfreeze()
