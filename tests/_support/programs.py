"""Programs the tests run in sandboxes (a local sandbox's commands are host processes), what
they print, and helpers that watch them."""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def managed_only_options() -> list[tuple[str, dict[str, Any]]]:
    """``(name, run options)`` for each ``commands.run`` option only the managed-command
    protocol honours: an old runtime (``/execute`` only) refuses each of them."""
    return [
        ("on_stdout", {"on_stdout": print}),
        ("on_stderr", {"on_stderr": print}),
        ("envs", {"envs": {"A": "b"}}),
        ("cwd", {"cwd": "/tmp"}),
        ("background", {"background": True}),
        ("stdin", {"background": True, "stdin": True}),
        ("timeout", {"background": True, "timeout": 0}),  # no time limit
    ]


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not; a process that ends while its stat is read is
    gone: the read then fails with ``ProcessLookupError``)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def process_gone(pid: int, within: float = 10.0) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``within`` s (a wait, not a speed test)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return not process_alive(pid)


LONG_OUTPUT = """
import sys, time
for i in range(1, 3001):
    sys.stdout.write(f"line {i} of the long output\\n")
    if i % 10 == 0:
        sys.stdout.flush()
        time.sleep(0.003)  # a pause every 10 lines: hundreds of events, not a few big reads
"""


def long_output() -> tuple[list[str], str]:
    """``(argv, expected)``: a command printing 3000 lines in 300 flushes 3 ms apart (about 300
    events) and the exact output it prints."""
    argv = [sys.executable, "-c", LONG_OUTPUT]
    return argv, "".join(f"line {i} of the long output\n" for i in range(1, 3001))


LONG_STREAM = """
import sys, time
out = sys.stdout.buffer
for i in range(1, 1601):
    out.write(f"line {i} of a long stream \u00e9\u20ac {'x' * (i % 7)}\\n".encode())
    out.flush()
    time.sleep(0.002)  # one write per event: 1600 events, not a few big reads
"""


@dataclass(frozen=True)
class LongStream:
    """A command that prints 1600 lines, one write 2 ms apart (so about 1600 events, each
    line with two multi-byte characters that a mid-line drop may split), and what it prints."""

    argv: list[str]
    expected: str
    lines: int = 1600


def long_stream() -> LongStream:
    expected = "".join(
        f"line {i} of a long stream \u00e9\u20ac {'x' * (i % 7)}\n" for i in range(1, 1601)
    )
    return LongStream([sys.executable, "-c", LONG_STREAM], expected)


LOGGING_SERVER = r"""
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        sys.stderr.write(("served " + self.path + " ").ljust(131072, ".") + "\n")
        sys.stderr.flush()  # a dev server's request log: 128 KiB per request
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@dataclass(frozen=True)
class LoggingServer:
    """A background dev server (a command: ``argv``) that logs every request it serves to its
    stderr, 128 KiB each; its first output line is its port (it listens on 127.0.0.1: a local
    sandbox's commands are host processes)."""

    argv: list[str]

    @staticmethod
    def serves(port: int, requests: int, within: float = 10.0) -> float:
        """Send ``requests`` requests one after the other, each answered within ``within`` s
        (else the test fails: the server is blocked); the slowest answer's seconds."""
        slowest = 0.0
        for i in range(requests):
            started = time.monotonic()
            url = f"http://127.0.0.1:{port}/{i}"
            with urllib.request.urlopen(url, timeout=within) as resp:
                assert resp.read() == b"ok"
            slowest = max(slowest, time.monotonic() - started)
        return slowest


def logging_server() -> LoggingServer:
    return LoggingServer([sys.executable, "-c", LOGGING_SERVER])


def mid_line_drops(broker: Any, sandbox: str) -> Callable[[int], None]:
    """``inject(events_seen)``: called by an output callback; every 200 events it makes the
    broker drop the next event stream of ``sandbox`` inside a line (half of it sent, then the
    connection cut) after a varying number of whole lines, so that drops happen all along a
    long stream, mixed with the cuts."""
    done: set[int] = set()

    def inject(seen: int) -> None:
        step = seen // 200
        if step and step not in done:
            done.add(step)
            broker.drop_event_stream_mid_line(1, after_events=(step * 17) % 50, sandbox=sandbox)

    return inject


def make_bashless_path(directory: Path) -> str:
    """Fill ``directory`` with links to every program on this process's ``PATH`` but ``bash``
    and ``rbash``; returns it, a ``PATH`` without bash (see the ``bashless_path`` fixture)."""
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(entry):
            continue
        for name in os.listdir(entry):
            link, program = directory / name, os.path.join(entry, name)
            if name in ("bash", "rbash") or link.exists() or link.is_symlink():
                continue
            if os.path.isfile(program) and os.access(program, os.X_OK):
                link.symlink_to(program)
    assert not (directory / "bash").exists() and (directory / "tr").exists()
    return str(directory)


def watch_streams(monkeypatch: pytest.MonkeyPatch, sandbox: Any) -> list[str]:
    """The list of the event streams ``sandbox``'s commands (sync or async) open from now on:
    ``"POST"`` for a streamed start, the ``after`` cursor of each
    ``GET /commands/{id}/events``."""
    transport = sandbox.commands._transport
    opened: list[str] = []
    name = "open_events" if hasattr(transport, "open_events") else "events"  # async: opened
    events = getattr(transport, name)

    def counting(spec: Any, **options: Any) -> Any:
        opened.append(spec.params.get("after", spec.method))
        return events(spec, **options)

    monkeypatch.setattr(transport, name, counting)
    return opened
