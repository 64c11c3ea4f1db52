"""A command's stdin (``POST /commands/{id}/stdin``, no I/O): the request, the runtime's limit
per request (checked before sending), the chunk that always fits, and a refusal for its size
as :class:`~...errors.StdinTooLargeError`.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Any

from ...errors import BrokerError, StdinTooLargeError
from ._commands_wire import command_path
from ._dataplane import DataTarget
from ._dataplane import data_request as _data
from ._protocol import RequestSpec, json_body

__all__ = [
    "STDIN_MAX_BODY",
    "command_stdin",
    "stdin_chunk",
    "stdin_refusal",
]


STDIN_MAX_BODY = 1024 * 1024
"""The largest request body the sandbox runtime reads (the local runtime's limit for its JSON
requests, ``POST /commands/{id}/stdin`` included): a stdin write's body is its data
JSON-encoded, so a write is checked against it before it is sent."""


_SIZE = re.compile(r"(?i)too large|larger than|\bover \d+ bytes")


_BYTES = re.compile(r"(\d+)\s*bytes")


def command_stdin(target: DataTarget, command_id: str, data: str | bytes, eof: bool) -> RequestSpec:
    """``POST /commands/{id}/stdin``: never retried (the data would be written twice); a body
    over :data:`STDIN_MAX_BODY` is refused before it is sent (:class:`StdinTooLargeError`).
    ``data``: text (``"data"``), or bytes (``"data_base64"``: a runtime with terminals)."""
    path = command_path(command_id, "/stdin")
    spec = _data("POST", path, f"write to the stdin of command {command_id!r}", target)
    if isinstance(data, bytes):
        body: dict[str, Any] = {"data_base64": base64.b64encode(data).decode("ascii")}
    else:
        body = {"data": data}
    spec = json_body(spec, {**body, "eof": bool(eof)})
    size = len(spec.content or b"")  # the body exactly as the runtime counts it
    if size > STDIN_MAX_BODY:
        raise _stdin_too_large(spec, size, STDIN_MAX_BODY, "", request_sent=False)
    return spec


def stdin_chunk(limit: int) -> int:
    """Characters of text that always fit one stdin write under ``limit`` bytes of body (JSON
    escaping makes a character at most 12 bytes), as a power of two (65536 for 1 MiB)."""
    room = max(1, (limit - 64) // 12)
    return 1 << (room.bit_length() - 1)


def _stdin_too_large(
    spec: RequestSpec, size: int, limit: int | None, answered: str, **common: Any
) -> StdinTooLargeError:
    chunk = stdin_chunk(limit if limit is not None else max(1, size // 2))
    over = (
        f"over the sandbox runtime's limit of {limit} bytes per request"
        if limit is not None
        else "too large for the sandbox runtime, which did not say its limit"
    )
    return StdinTooLargeError(
        f"Could not {spec.what}: the request would be {size} bytes (the data JSON-encoded), "
        f"{over}{answered}. Send it in chunks of at most {chunk} characters: one "
        "send_stdin(piece) per piece, eof=True with the last one (or send_stdin('', eof=True)).",
        limit=limit,
        size=size,
        method=spec.method,
        path=spec.path,
        **common,
    )


def stdin_refusal(spec: RequestSpec) -> Callable[[Exception], Exception | None]:
    """The ``fail`` of a stdin write: a refusal for its size (``413``, or ``400`` naming the
    size) is a :class:`StdinTooLargeError` with the limit the answer names, if any."""

    def fail(exc: Exception) -> Exception | None:
        status = getattr(exc, "status_code", None)
        detail = getattr(exc, "detail", None) or ""
        if not isinstance(exc, BrokerError) or not (
            status == 413 or (status == 400 and _SIZE.search(detail))
        ):
            return None
        found = _BYTES.search(detail)
        answered = f" (it answered {status}: {detail})" if detail else f" (it answered {status})"
        size = len(spec.content or b"")
        limit = int(found.group(1)) if found else None
        return _stdin_too_large(
            spec, size, limit, answered, status_code=status, code=exc.code, detail=exc.detail
        )

    return fail
