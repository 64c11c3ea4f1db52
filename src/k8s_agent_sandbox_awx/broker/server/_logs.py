"""The broker's lines, JSON or text: :func:`format_line` for the access and audit logs
(``broker.observability``) and :class:`JsonFormatter` for its diagnostic messages (the
``logging`` records of ``k8s_agent_sandbox_awx`` and uvicorn) under ``[logging] format =
"json"``."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

__all__ = ["FORMATS", "JsonFormatter", "format_line", "timestamp"]

FORMATS: Final = ("json", "text")


def timestamp(at: float | None = None) -> str:
    """``at`` (default: now) as RFC 3339 UTC with milliseconds: ``2026-01-02T03:04:05.678Z``."""
    moment = datetime.fromtimestamp(time.time() if at is None else at, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


def format_line(record: Mapping[str, Any], fmt: str = "json") -> str:
    """One record as one line (no newline): compact JSON, or ``key=value`` pairs in order."""
    if fmt == "text":
        return " ".join(f"{k}={_text_value(v)}" for k, v in record.items() if v is not None)
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False, default=str)


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
