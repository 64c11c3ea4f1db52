"""Requests written byte for byte to the broker (no client library rewrites them): what the
broker counts is what it forwards (a lowercase ``post /execute`` reaches the runtime as
``POST`` and is counted like it), and a body the broker frames differently from a client (a
``GET`` with a body, a chunked body that also declares a ``Content-Length``) is no ``500`` and
no traceback."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.broker_api import raw_request


def _raw(
    broker: LocalBroker,
    api: Any,
    sandbox: dict[str, Any],
    method: str,
    target: str,
    body: bytes = b"",
    extra: tuple[str, ...] = (),
    *,
    content_length: bool = True,
) -> tuple[int, bytes, bytes]:
    """``method target`` byte for byte over TLS as ``api``'s caller, to ``sandbox``."""
    return raw_request(
        broker,
        method,
        target,
        body,
        api.data_headers(sandbox),
        token=api.token,
        content_length=content_length,
        extra=extra,
    )


# -- item 1: what is counted is what is forwarded -------------------------------------------------


@pytest.mark.parametrize("path", ["/execute", "/commands"])
def test_a_lowercase_method_is_counted_or_refused(
    broker: LocalBroker, alice: Any, path: str
) -> None:
    """``post /execute`` (h11 accepts any token as a method) reaches the runtime as ``POST``:
    it must be counted like ``POST`` (or refused); else a test's "never runs twice" check, and
    ``drop_connection_after_execute``, miss it."""
    sandbox = alice.ready()
    marker = Path(tempfile.mkdtemp()) / "ran"
    command: Any = f"touch {marker}" if path == "/execute" else ["touch", str(marker)]
    status, _, body = _raw(
        broker, alice, sandbox, "post", path, json.dumps({"command": command}).encode()
    )
    deadline = time.monotonic() + 5
    while status == 200 and not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not marker.exists() or broker.execution_count(sandbox["name"]) == 1, (status, body)
    shutil.rmtree(marker.parent, ignore_errors=True)


# -- item 13: no traceback for a body the broker frames differently -------------------------------

FRAMINGS = {
    "a GET with a body": ("GET", "/fs/list?path=/app", b"hello", (), True),
    "chunked and a Content-Length": (
        "POST",
        "/fs/mkdir",
        b'1a\r\n{"path": "/app/d", "x": 1}\r\n0\r\n\r\n',
        ("Transfer-Encoding: chunked", "Content-Length: 5"),
        False,
    ),
}


@pytest.mark.parametrize("framing", list(FRAMINGS))
def test_a_body_framed_differently_is_no_500_and_no_traceback(
    broker: LocalBroker, alice: Any, framing: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    method, target, body, extra, content_length = FRAMINGS[framing]
    sandbox = alice.ready()
    status, _, answer = _raw(
        broker, alice, sandbox, method, target, body, extra, content_length=content_length
    )
    assert status < 500, answer[:200]
    assert "Exception in ASGI application" not in caplog.text
