"""Where the access and audit lines go: one line per record, JSON (the default) or text.

- :class:`StreamLines`: a stream (standard output by default), flushed after every line;
- :class:`FileLines`: a file, appended to line by line, re-opened when it was moved or removed
  (so that ``logrotate``'s default ``create`` mode, or a ``mv`` and nothing else, rotates it; no
  signal is needed);
- the broker's own diagnostic messages are the same JSON lines under ``broker serve``
  (``"log": "broker"``: :class:`..server._logs.JsonFormatter`).

A line that cannot be written (a full disk, a closed pipe) is counted (``failures``, the
``agent_sandbox_broker_log_write_failures_total`` metric) and reported on the broker's own log
at most once a minute; the request it belongs to goes on.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol, TextIO

from ..server._logs import FORMATS, format_line, timestamp

__all__ = [
    "FORMATS",
    "FileLines",
    "LineWriter",
    "StreamLines",
    "format_line",
    "timestamp",
]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.observability")

_REPORT_EVERY: Final = 60.0


class LineWriter(Protocol):
    """Where one log's records go."""

    failures: int

    def write(self, record: Mapping[str, Any]) -> None: ...


class _Lines:
    def __init__(self, fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r}: use one of {', '.join(FORMATS)}")
        self.fmt = fmt
        self.failures = 0
        self._lock = threading.Lock()
        self._reported = float("-inf")

    def write(self, record: Mapping[str, Any]) -> None:
        line = format_line(record, self.fmt) + "\n"
        with self._lock:
            try:
                self._write(line)
            except (OSError, ValueError) as exc:  # ValueError: a closed file
                self.failures += 1
                self._report(exc)

    def _write(self, line: str) -> None:
        raise NotImplementedError

    def _report(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._reported >= _REPORT_EVERY:
            self._reported = now
            log.error(
                "cannot write to %s (%s: %s); %d line(s) lost so far",
                self,
                type(exc).__name__,
                exc,
                self.failures,
            )


class StreamLines(_Lines):
    """Lines on ``stream``, flushed each time: a text stream, or ``"stdout"`` / ``"stderr"``
    (the process's stream of the moment, looked up at each line)."""

    def __init__(self, stream: TextIO | str = "stdout", fmt: str = "json") -> None:
        super().__init__(fmt)
        if isinstance(stream, str):
            if stream not in ("stdout", "stderr"):
                raise ValueError(f"stream {stream!r}: use 'stdout', 'stderr' or a text stream")
            name = stream
            self._stream: Callable[[], TextIO] = lambda: getattr(sys, name)
        else:
            self._stream = lambda: stream

    def __repr__(self) -> str:
        return f"StreamLines({getattr(self._stream(), 'name', 'a stream')})"

    def _write(self, line: str) -> None:
        stream = self._stream()
        stream.write(line)
        stream.flush()


class FileLines(_Lines):
    """Lines appended to the file ``path`` (made if missing, mode 0600), re-opened when the
    file at ``path`` is no longer the one open (rotated away or removed)."""

    def __init__(self, path: str | os.PathLike[str], fmt: str = "json") -> None:
        super().__init__(fmt)
        self.path = Path(path)
        self._file: TextIO | None = None
        self._identity: tuple[int, int] | None = None
        self._open()  # at start: a path that cannot be opened stops the broker before it serves

    def __repr__(self) -> str:
        return f"FileLines({str(self.path)!r})"

    def _open(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8", buffering=1)
        stat = os.fstat(fd)
        self._identity = (stat.st_dev, stat.st_ino)

    def _moved(self) -> bool:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (stat.st_dev, stat.st_ino) != self._identity

    def _write(self, line: str) -> None:
        if self._file is None or self._moved():
            self.close()
            self._open()
        assert self._file is not None
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
