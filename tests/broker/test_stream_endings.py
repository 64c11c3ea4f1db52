"""A peer that goes away mid-stream is an expected event for the broker: one INFO or WARNING
line that says what happened, never an "Exception in ASGI application" traceback.

- a runtime killed while the broker streams its answer (a command's events): WARNING, and the
  client's connection is dropped (it sees a broken answer, not a complete one);
- a client closing ``watch_dir`` early (``contextlib.closing``, as docs/client.md says): INFO,
  and the broker stops reading from the runtime at once (not at the runtime's next event or
  heartbeat, nor when the sandbox is deleted later).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker

LOGGERS = ("uvicorn", "k8s_agent_sandbox_awx.broker", "k8s_agent_sandbox_awx.testing")


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(LOGGERS)]


def _assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    bad = [
        f"{r.name} {r.levelname}: {r.getMessage()[:120]}"
        for r in _records(caplog)
        if r.exc_info
        or "Exception in ASGI application" in r.getMessage()
        or r.levelno >= logging.ERROR
    ]
    assert bad == []


def _wait_for_lines(
    caplog: pytest.LogCaptureFixture, match: Callable[[str], bool], timeout: float = 10.0
) -> list[logging.LogRecord]:
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in _records(caplog) if match(r.getMessage())]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_a_runtime_killed_mid_stream_is_one_warning_line(
    broker: LocalBroker, alice: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sandbox = alice.ready()
    headers = alice.data_headers(sandbox)
    script = "for i in $(seq 200); do echo tick; sleep 0.02; done"  # ends by itself
    started = alice.http.post(
        "/commands", json={"command": ["/bin/sh", "-c", script]}, headers=headers
    )
    assert started.status_code == 200, started.text
    command_id = started.json()["command_id"]
    pid = broker.runtime_pid(sandbox["name"])
    assert pid is not None
    lines = 0
    with (
        pytest.raises(httpx.RemoteProtocolError),  # a broken answer, not a clean end
        alice.http.stream(
            "GET",
            f"/commands/{command_id}/events",
            params={"after": 0, "duration": 20},
            headers=headers,
        ) as events,
    ):
        for _ in events.iter_lines():
            lines += 1
            if lines == 3:
                os.kill(pid, signal.SIGKILL)
    found = _wait_for_lines(caplog, lambda m: "mid-stream" in m)
    assert len(found) == 1, [r.getMessage() for r in _records(caplog)]
    (line,) = found
    assert line.levelno == logging.WARNING
    assert line.exc_info is None
    message = line.getMessage()
    assert sandbox["name"] in message
    assert "GET {data} /commands/{id}/events" in message  # the route, never the raw path
    assert command_id not in message
    assert "dropped the client's connection" in message
    time.sleep(0.3)  # anything the broker would log after it
    _assert_no_traceback(caplog)


def test_closing_watch_dir_early_is_one_info_line(
    sandbox_broker: LocalBroker, caplog: pytest.LogCaptureFixture
) -> None:
    from k8s_agent_sandbox_awx import Sandbox

    caplog.set_level(logging.INFO)
    with Sandbox.create() as sandbox:
        sandbox.files.make_dir("w")
        name = sandbox_broker.sandbox_name(sandbox.name)

        def touch_later() -> None:
            time.sleep(1.0)  # after the watch's snapshot
            sandbox.files.write("w/new.txt", b"x")

        writer = threading.Thread(target=touch_later)
        with contextlib.closing(sandbox.files.watch_dir("w", timeout=None)) as events:
            writer.start()
            first = next(events)
        writer.join(10)
        assert (first.type, first.path) == ("created", "/app/w/new.txt")
        # the broker notices at once, not at the runtime's next heartbeat (seconds later)
        found = _wait_for_lines(caplog, lambda m: "went away" in m, timeout=2.0)
        assert len(found) == 1, [r.getMessage() for r in _records(caplog)]
        (line,) = found
        assert line.levelno == logging.INFO
        assert name in line.getMessage()
        assert "GET {data} /fs/watch" in line.getMessage()
    # the sandbox is deleted (its runtime stopped) after the client left: nothing more to say
    time.sleep(0.5)
    _assert_no_traceback(caplog)


def test_a_sandbox_deleted_mid_stream_is_one_info_line(
    broker: LocalBroker, alice: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sandbox = alice.ready()
    headers = alice.data_headers(sandbox)
    script = "for i in $(seq 200); do echo tick; sleep 0.02; done"
    started = alice.http.post(
        "/commands", json={"command": ["/bin/sh", "-c", script]}, headers=headers
    )
    command_id = started.json()["command_id"]
    lines = 0
    with (
        pytest.raises(httpx.RemoteProtocolError),
        alice.http.stream(
            "GET",
            f"/commands/{command_id}/events",
            params={"after": 0, "duration": 20},
            headers=headers,
        ) as events,
    ):
        for _ in events.iter_lines():
            lines += 1
            if lines == 3:
                deleted = alice.http.delete(f"/v1/sandboxes/{sandbox['name']}")
                assert deleted.status_code == 202, deleted.text
    found = _wait_for_lines(caplog, lambda m: "mid-stream" in m)
    assert len(found) == 1, [r.getMessage() for r in _records(caplog)]
    assert found[0].levelno == logging.INFO
    assert "as the sandbox is being deleted" in found[0].getMessage()
    time.sleep(0.3)
    _assert_no_traceback(caplog)
