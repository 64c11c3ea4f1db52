"""The broker's lines, JSON or text: :func:`format_line` for the access and audit logs
(``broker.observability``) and :class:`JsonFormatter` for its diagnostic messages (the
``logging`` records of ``k8s_agent_sandbox_awx`` and uvicorn) under ``[logging] format =
"json"``."""

from __future__ import annotations

import json
import logging
import math
import time
import unicodedata
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

__all__ = [
    "FORMATS",
    "TEXT_LOGGING",
    "JsonFormatter",
    "TextFormatter",
    "format_line",
    "printable",
    "timestamp",
]

FORMATS: Final = ("json", "text")


_SECOND: list[tuple[int, str]] = [(-1, "")]
"""The last whole second :func:`timestamp` wrote, and its text up to the seconds (one tuple,
replaced whole: a thread reads either the old one or the new one)."""


def timestamp(at: float | None = None) -> str:
    """``at`` (default: now) as RFC 3339 UTC with milliseconds: ``2026-01-02T03:04:05.678Z``.

    The same text as ``datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds")``
    (the fraction rounded half-even to microseconds, then cut to milliseconds), the date and
    time of a second formatted once for all the lines of that second."""
    at = time.time() if at is None else at
    fraction, whole = math.modf(at)
    second, micro = int(whole), round(fraction * 1e6)
    if micro >= 1_000_000 or micro < 0:  # rounded up into the next second, or before 1970
        moment = datetime.fromtimestamp(at, UTC)
        return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    last = _SECOND[0]
    if last[0] != second:
        last = (second, datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
        _SECOND[0] = last
    return f"{last[1]}.{micro // 1000:03d}Z"


_UNPRINTABLE: Final = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
"""The Unicode categories no log line carries as themselves: controls (CR, LF, ESC, BEL, NEL,
CSI, ...), format characters (the bidirectional overrides that reorder what a reader sees),
surrogates, private and unassigned code points, line and paragraph separators."""


def _escaped(char: str) -> str:
    code = ord(char)
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else (f"\\U{code:08x}")
    )


def printable(text: str) -> str:
    """``text`` with every character a log line must not carry as itself (:data:`_UNPRINTABLE`)
    written as a ``\\xNN`` / ``\\uNNNN`` escape, so that what a caller or a sandbox sent can
    neither end the line (CR, LF, NEL, LS), forge the next one, nor drive a terminal (ESC, CSI);
    everything else as it is."""
    if text.isprintable():
        return text
    return "".join(_escaped(c) if unicodedata.category(c) in _UNPRINTABLE else c for c in text)


def _json_printable(text: str) -> str:
    """JSON text (a string literal, or a whole line) with the characters JSON leaves raw and a
    reader would act on (DEL, C1 controls, format characters, LS, PS; :data:`_UNPRINTABLE`)
    written as ``\\uNNNN`` escapes: they occur only inside its strings, where the escape means
    the same character."""
    if text.isprintable():
        return text
    return "".join(
        json.dumps(c)[1:-1] if unicodedata.category(c) in _UNPRINTABLE else c for c in text
    )


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if not text or not text.isprintable() or any(c.isspace() or c in '"=' for c in text):
        return _json_printable(json.dumps(text, ensure_ascii=False))
    return text


def format_line(record: Mapping[str, Any], fmt: str = "json") -> str:
    """One record as one line (no newline): compact JSON, or ``key=value`` pairs in order;
    either way no character in it ends or forges a line (:func:`printable`)."""
    if fmt == "text":
        return " ".join(f"{k}={_text_value(v)}" for k, v in record.items() if v is not None)
    return _json_printable(_JSON.encode(record))


_JSON: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str)
"""What ``json.dumps(record, separators=(",", ":"), ensure_ascii=False, default=str)`` uses,
made once (``json.dumps`` makes an encoder per call for any argument but the defaults)."""


_BASE_KEYS: Final = frozenset({"time", "log", "level", "logger", "message", "exception"})


class JsonFormatter(logging.Formatter):
    """A ``logging`` record as a JSON line: ``{"time", "log": "broker", "level", "logger",
    "message"}`` (and ``"exception"``: its traceback, when it has one), then the record's
    ``fields`` (``extra={"fields": {...}}``: facts of the message as fields of their own, e.g.
    the start-up message's ``pid``; they never replace the keys above)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": timestamp(record.created),
            "log": "broker",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            line.update({k: v for k, v in fields.items() if k not in _BASE_KEYS})
        return format_line(line)


class TextFormatter(logging.Formatter):
    """A ``logging`` record as text, for ``[logging] format = "text"``, the broker's messages
    and uvicorn's alike: ``LEVEL:    message`` as uvicorn writes it, the message escaped
    (:func:`printable`: a value it quotes cannot end the line or forge the next one), and a
    traceback's lines each indented and escaped, so that a line that starts at the margin is
    always a record of its own."""

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelname + ":"
        line = f"{level:<9} {printable(record.getMessage())}"
        if record.exc_info:
            trace = self.formatException(record.exc_info)
            line += "".join("\n    " + printable(part) for part in trace.splitlines())
        return line


TEXT_LOGGING: Final[dict[str, Any]] = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"text": {"()": f"{__name__}.TextFormatter"}},
    "handlers": {
        "text": {
            "formatter": "text",
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stderr",
        }
    },
    "loggers": {
        "uvicorn": {"handlers": ["text"], "level": "INFO", "propagate": False},
        "uvicorn.error": {"level": "INFO"},
        "uvicorn.access": {"handlers": ["text"], "level": "INFO", "propagate": False},
    },
}
"""uvicorn's logging under ``[logging] format = "text"`` (its own default configuration, with
:class:`TextFormatter` in place of its formatters)."""
