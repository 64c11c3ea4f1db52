"""A watch of the Kubernetes API: ``Watch``, an async iterator of ``(type, object)`` over
one streamed answer, and ``WatchEnd``, why it stopped.

The semantics (``_api``'s docstring): an ERROR event raises its typed error (code 410:
``WatchExpired``, as 1.20 sends it after an HTTP 200; the start's own HTTP 410 too); the
iterator ends cleanly when the server closes the stream (``TIMEOUT``) or when the connection
drops or stalls (``DROPPED``: each read waits at most the watch's timeoutSeconds plus a
margin); ``resource_version`` is then the last one seen, from an event or a BOOKMARK.
"""

from __future__ import annotations

import enum
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

import httpx

from ._api_errors import KubeError, WatchExpired, error_for_status

__all__ = ["Watch", "WatchEnd"]


class WatchEnd(enum.Enum):
    """Why a watch's iterator stopped (``Watch.end``)."""

    TIMEOUT = "the server ended the watch (its timeoutSeconds elapsed)"
    DROPPED = "the connection dropped or stalled (a server restart, the network)"
    ERROR = "the server sent an ERROR event (raised)"
    CLOSED = "the caller closed the watch"


class Watch:
    """One watch request: an async iterator of ``(type, object)`` (``ADDED``, ``MODIFIED``,
    ``DELETED``, ``BOOKMARK``: an object with only ``metadata.resourceVersion``). The events of
    an object come in order; ``resource_version`` is the last one seen, to resume from; when
    iteration stops, ``end`` says why (``WatchEnd``). An ERROR event raises its typed error
    (``WatchExpired`` for 410: list again)."""

    def __init__(
        self,
        start: Callable[[], Awaitable[httpx.Response]],
        *,
        what: str,
        resource: str,
        namespace: str | None,
        since: str | None,
    ) -> None:
        """``start`` sends the watch request (with its retries and read timeout) and returns
        the answer unread; ``what`` describes it for messages (``watch sandboxclaims... NS``)."""
        self._send, self._what = start, what
        self._resource, self._namespace = resource, namespace
        self._response: httpx.Response | None = None
        self._lines: AsyncIterator[str] | None = None
        self.resource_version = since
        self.end: WatchEnd | None = None
        self.detail = ""
        self.events = 0

    def __repr__(self) -> str:
        return f"Watch({self._what}, resource_version={self.resource_version!r}, end={self.end})"

    async def __aenter__(self) -> Watch:
        await self._start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _start(self) -> None:
        if self._response is not None or self.end is not None:
            return
        try:
            self._response = await self._send()
        except KubeError as exc:
            if exc.status == 410:
                raise WatchExpired(
                    f"{exc}: list again, then watch from the list's resourceVersion",
                    status=410,
                    reason=exc.reason,
                    message=exc.message,
                    verb="watch",
                    resource=exc.resource,
                    namespace=exc.namespace,
                ) from None
            raise
        self._lines = self._response.aiter_lines()

    async def aclose(self) -> None:
        """Stop watching (the connection is released)."""
        if self.end is None:
            self.end = WatchEnd.CLOSED
        response, self._response = self._response, None
        if response is not None:
            await response.aclose()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> tuple[str, dict[str, Any]]:
        await self._start()
        while self.end is None and self._lines is not None:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                await self._stop(WatchEnd.TIMEOUT, "")
                break
            except (httpx.TransportError, httpx.StreamError) as exc:  # also a read that waited
                if self.end is None:  # too long; a StreamError: closed meanwhile by aclose()
                    await self._stop(WatchEnd.DROPPED, f"{type(exc).__name__}: {exc}")
                break
            if line.strip():
                return await self._event(line)
        raise StopAsyncIteration

    async def _stop(self, end: WatchEnd, detail: str) -> None:
        self.end, self.detail = end, detail
        await self.aclose()

    async def _event(self, line: str) -> tuple[str, dict[str, Any]]:
        try:
            event = json.loads(line)
            kind, obj = str(event["type"]), event["object"]
            if not isinstance(obj, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            await self._stop(WatchEnd.ERROR, "a line that is not a watch event")
            raise KubeError(
                f"{self._what}: the API server sent a line that is not a watch event",
                reason="InvalidResponse",
                verb="watch",
                resource=self._resource,
                namespace=self._namespace,
            ) from None
        if kind == "ERROR":
            await self._stop(WatchEnd.ERROR, str(obj.get("message", "")))
            raise self._error_event(obj)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self.resource_version = str(version)
        self.events += 1
        return kind, obj

    def _error_event(self, status: Mapping[str, Any]) -> KubeError:
        """The typed error an ERROR event's Status stands for."""
        raw = status.get("code")
        code = raw if isinstance(raw, int) else 500
        reason, message = str(status.get("reason") or ""), str(status.get("message") or "")
        text = f"{self._what} from resourceVersion {self.resource_version}: " + (
            f"ERROR event {code} {reason}: {message}"
        )
        kwargs: dict[str, Any] = dict(
            status=code,
            reason=reason,
            message=message,
            verb="watch",
            resource=self._resource,
            namespace=self._namespace,
        )
        if code == 410:
            return WatchExpired(
                text + ": list again, then watch from the list's resourceVersion", **kwargs
            )
        cls, extra = error_for_status(code, status)
        return cls(text, **kwargs, **extra)
