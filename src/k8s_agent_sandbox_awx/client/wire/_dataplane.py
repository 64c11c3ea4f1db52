"""The data plane: the sandbox runtime's endpoints, proxied by the broker (no I/O).

Shared by every dialect: a dialect only says which headers route a request to its sandbox
(:meth:`Dialect.data_target`); the paths, bodies, answers and the runtime's own errors are
decided once, by endpoint: the managed commands (``/commands``, see
``docs/broker-api.md#managed-commands``) and the legacy ``/execute`` in ``_commands_wire``, a
command's stdin in ``_stdin_wire``, the legacy file endpoints (``/upload``, ``/download``,
``/list``, ``/exists``) and the path rules in ``_files_wire`` (the file API is in
``core/_fsapi``), an upload's body framing in ``_multipart``, and the runtime's error answers in
``_runtime_errors``. Here: where a data-plane request goes (:class:`DataTarget`, with its
activity keepalive: :class:`KeptAlive`) and the one builder of its requests
(:func:`data_request`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ._protocol import Call, RequestSpec, compact_json, rfc3339_seconds

__all__ = [
    "DataTarget",
    "Keepalive",
    "KeptAlive",
    "data_request",
]


class DataTarget(Protocol):
    """Where a data-plane request goes: a dialect's routing headers for one sandbox."""

    @property
    def sandbox_id(self) -> str: ...

    def headers(self) -> dict[str, str]: ...


class Keepalive:
    """One sandbox's opt-in activity keepalive (``keepalive=`` seconds): data-plane activity
    moves the sandbox's deadline to now + ``seconds``, when that is later than the deadline
    it knows, and at most once per half window. Thread-safe; owned by the sandbox's data
    target (:class:`KeptAlive`). The extension itself is sent by the transport of the
    sandbox's data plane, best effort: one short attempt, a failure is logged (never raised)
    and the extension tried again by the next request (:meth:`failed`)."""

    def __init__(
        self,
        name: str,
        seconds: int,
        deadline: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self.seconds = seconds
        self.deadline = deadline
        """The sandbox's deadline as last reported (epoch seconds), ``None``: unknown."""
        self._clock = clock
        self._last: float | None = None
        self._lock = threading.Lock()

    def claim(self) -> bool:
        """Whether this request should extend the lifetime now (then it counts as done)."""
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last < self.seconds / 2:
                return False
            if self.deadline is not None and now + self.seconds <= self.deadline:
                return False
            self._last = now
            return True

    def extended(self, expires_at: str | None) -> None:
        """Record the deadline an extension's answer reports."""
        self.deadline = rfc3339_seconds(expires_at)

    def failed(self) -> None:
        """The extension :meth:`claim` asked for failed: the next request tries it again."""
        with self._lock:
            self._last = None


@dataclass(frozen=True)
class KeptAlive:
    """A sandbox's data target with its activity keepalive, the one owner of it: the
    transport of the sandbox's data plane (``transport.to(target)``) asks :meth:`due` before
    each data-plane request, and sends the extension it returns; ``extend`` is the dialect's
    (``Dialect.extend``)."""

    target: DataTarget
    keepalive: Keepalive
    extend: Callable[[str, int], Call[Any]]

    def due(self) -> Call[Any] | None:
        """The extension to send before a data-plane request now, if one is due (it then
        counts as sent: report its outcome to :attr:`keepalive`)."""
        if not self.keepalive.claim():
            return None
        return self.extend(self.keepalive.name, self.keepalive.seconds)

    @property
    def sandbox_id(self) -> str:
        return self.target.sandbox_id

    def headers(self) -> dict[str, str]:
        return self.target.headers()


def data_request(
    method: str,
    endpoint: str,
    what: str,
    target: DataTarget,
    subject: str | None = None,
    *,
    headers: Mapping[str, str] | None = None,
    read_timeout: float | None = None,
    retryable: bool | None = None,
    params: Mapping[str, str] | None = None,
    json: Any = None,
) -> RequestSpec:
    """A data-plane request to ``target`` (``GET``s are retryable unless ``retryable`` says;
    ``subject``: the sandbox path it is about; ``json``: its body, compact JSON, as
    :func:`~._protocol.json_body` makes it, without a second spec)."""
    merged = {**target.headers(), **(headers or {})}
    content = None
    if json is not None:
        content = compact_json(json)
        merged["Content-Type"] = "application/json"
    return RequestSpec(
        method,
        endpoint,
        what,
        params=dict(params or {}),
        headers=merged,
        content=content,
        retryable=method == "GET" if retryable is None else retryable,
        read_timeout=read_timeout,
        data_plane=True,
        subject=subject,
    )
