"""Fault injection for the local broker: a layer around it, never a part of it.

:class:`Faults` (``LocalBroker.faults``: ``inject_unavailable``,
``drop_connection_after_execute``, ``cut_event_streams``, ``drop_event_stream_mid_line``,
``crash_next_start``, ``set_readiness_delay``, ``clear``) adds rules to one :class:`FaultRules`,
which two wrappers apply:

- :class:`FaultLayer`, an ASGI application around the broker's: the request-level faults. A
  ``503`` instead of the answer (before the broker acts: the request does nothing), the answer
  to a command's start lost after the command ran (the connection drops), and event streams
  (NDJSON answers of ``GET /commands/{id}/events`` and of a streamed ``POST /commands``) ended
  at a line boundary after N lines or S seconds, as a proxy that times out ends them, or cut
  inside a line (the connection drops). It decides with the broker's own rules (its routing,
  its gate's checks of a data-plane request: a request the broker refuses is left alone) and
  tells the runtime's answers from the broker's by the broker's error header.
- :class:`FaultyRuntimes`, a :class:`~..broker.backends.local._launcher.RuntimeLauncher` around the
  one the local backend runs runtimes with: the next starts crash, a started runtime is Ready
  only after the readiness delay (bound meanwhile, as a pod that is not ready yet).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..broker._app import plane_of
from ..broker.backends.local._launcher import (
    READY_METHOD,
    RuntimeHandle,
    RuntimeLauncher,
    RuntimeStartError,
    SandboxSpec,
)
from ..broker.common._errors import BROKER_ERROR_HEADER_RAW, ApiError
from ..broker.common._gate import origin_form
from ..broker.common._observed import note_error
from ..broker.control._rpc import plain_error
from ..broker.dataplane._data_request import data_request
from ..broker.dataplane._relay import DroppedConnection

EVENTS_PATH = re.compile(r"^/(commands|code/executions)/[^/]+/events$")
_COMMAND_PATHS = ("/execute", "/commands", "/code/execute")


# -- the rules ---------------------------------------------------------------------------------
@dataclass
class UnavailableRule:
    remaining: int
    retry_after: int
    scope: str
    path: str | None
    sandbox: str | None


@dataclass
class CutRule:
    """End every matching event stream after ``after_events`` lines or ``after_seconds``."""

    after_events: int | None
    after_seconds: float | None
    sandbox: str | None


@dataclass
class DropRule:
    """The next ``remaining`` matching streams: after ``after_events`` lines, half a line, drop."""

    remaining: int
    after_events: int
    sandbox: str | None


@dataclass
class StreamPlan:
    """What to do to one event stream."""

    cut: CutRule | None
    drop_after: int | None
    take_drop: Callable[[], bool]
    """Consumes one use of the drop rule; ``False`` when another stream used it up meanwhile."""


class FaultRules:
    """The injected faults' rules, set from any thread (by :class:`Faults`, the public side)."""

    def __init__(self, readiness_delay: float = 0.0) -> None:
        self.lock = threading.Lock()
        self.readiness_delay = readiness_delay
        self.unavailable: list[UnavailableRule] = []
        self.drops: list[list[Any]] = []  # [remaining, sandbox or None]
        self.event_cuts: list[CutRule] = []
        self.event_drops: list[DropRule] = []
        self.crashes = 0  # the next N sandboxes crash at startup

    def request_faults(self) -> bool:
        """Whether any request-level rule is set (else requests pass untouched)."""
        return bool(self.unavailable or self.drops or self.event_cuts or self.event_drops)

    def take_unavailable(self, scope: str, path: str, sandbox: str | None) -> int | None:
        with self.lock:
            for rule in self.unavailable:
                if rule.remaining <= 0:
                    continue
                if rule.scope not in ("any", scope):
                    continue
                if rule.path is not None and not path.startswith(rule.path):
                    continue
                if rule.sandbox is not None and rule.sandbox != sandbox:
                    continue
                rule.remaining -= 1
                return rule.retry_after
            return None

    def take_drop(self, sandbox: str) -> bool:
        with self.lock:
            for rule in self.drops:
                if rule[0] > 0 and rule[1] in (None, sandbox):
                    rule[0] -= 1
                    return True
            return False

    def event_stream_plan(self, sandbox: str) -> StreamPlan | None:
        """How to damage one event stream of ``sandbox`` (``None``: pass it through)."""
        with self.lock:
            cut = next((r for r in self.event_cuts if r.sandbox in (None, sandbox)), None)
            drop = next(
                (r for r in self.event_drops if r.remaining > 0 and r.sandbox in (None, sandbox)),
                None,
            )
        if cut is None and drop is None:
            return None

        def take_drop() -> bool:
            with self.lock:
                if drop is None or drop.remaining <= 0:
                    return False
                drop.remaining -= 1
                return True

        return StreamPlan(cut, drop.after_events if drop is not None else None, take_drop)

    def take_crash(self) -> bool:
        with self.lock:
            if self.crashes > 0:
                self.crashes -= 1
                return True
            return False

    def clear(self) -> None:
        with self.lock:
            self.unavailable.clear()
            self.drops.clear()
            self.event_cuts.clear()
            self.event_drops.clear()
            self.crashes = 0


# -- the public side: LocalBroker.faults -------------------------------------------------------
class Faults:
    """Failure injection into a running :class:`LocalBroker`: ``broker.faults``.

    Each method adds a rule (thread-safe, from the test thread); :meth:`clear` removes them all
    (the ``sandbox_broker`` fixture's ``reset`` does, after every test). ``sandbox=`` takes a
    sandbox name or an ``/rpc`` claim name.
    """

    def __init__(self, rules: FaultRules, sandbox_name: Callable[[str], str]) -> None:
        self._rules = rules
        self._sandbox_name = sandbox_name  # an /rpc claim name -> its sandbox's name

    def __repr__(self) -> str:
        return "Faults()"

    def _sandbox(self, name: str | None) -> str | None:
        return None if name is None else self._sandbox_name(name)

    def set_readiness_delay(self, seconds: float) -> None:
        """New sandboxes stay ``Pending`` this long after their runtime is up (slow readiness)."""
        with self._rules.lock:
            self._rules.readiness_delay = seconds

    def inject_unavailable(
        self,
        count: int = 1,
        *,
        retry_after: int = 1,
        scope: str = "data",
        path: str | None = None,
        sandbox: str | None = None,
    ) -> None:
        """The next ``count`` matching requests get ``503 unavailable`` with ``Retry-After``.

        ``scope``: ``"data"`` (data plane), ``"control"`` (``/v1`` except healthz) or ``"any"``;
        ``path``: only requests whose path starts with it; ``sandbox``: only that sandbox.
        """
        if scope not in ("data", "control", "any"):
            raise ValueError("scope must be 'data', 'control' or 'any'")
        sandbox = self._sandbox(sandbox)
        with self._rules.lock:
            self._rules.unavailable.append(
                UnavailableRule(count, retry_after, scope, path, sandbox)
            )

    def drop_connection_after_execute(self, count: int = 1, *, sandbox: str | None = None) -> None:
        """The next ``count`` ``POST /execute``, ``POST /commands`` or ``POST /code/execute``:
        the command (or code) starts, the runtime answers, then the connection drops."""
        sandbox = self._sandbox(sandbox)
        with self._rules.lock:
            self._rules.drops.append([count, sandbox])

    def cut_event_streams(
        self,
        *,
        after_events: int | None = None,
        after_seconds: float | None = None,
        sandbox: str | None = None,
    ) -> None:
        """From now on (until :meth:`clear`), every command event stream
        (``GET /commands/{id}/events``, and ``run_code``'s ``GET /code/executions/{id}/events``
        and streamed start) ends cleanly after ``after_events`` NDJSON lines
        (heartbeats included) or ``after_seconds``, whichever comes first, at a line boundary,
        as a proxy that times out would end it (a streamed start the runtime answered whole is
        relayed chunked, without its ``Content-Length``, so that the cut stays clean).
        ``sandbox``: only that sandbox's streams."""
        if after_events is None and after_seconds is None:
            raise ValueError("give after_events, after_seconds or both")
        if after_events is not None and (isinstance(after_events, bool) or after_events < 1):
            raise ValueError(f"after_events must be an integer >= 1, not {after_events!r}")
        if after_seconds is not None and not after_seconds > 0:
            raise ValueError(f"after_seconds must be a number > 0, not {after_seconds!r}")
        sandbox = self._sandbox(sandbox)
        with self._rules.lock:
            self._rules.event_cuts.insert(0, CutRule(after_events, after_seconds, sandbox))

    def drop_event_stream_mid_line(
        self, count: int = 1, *, after_events: int = 0, sandbox: str | None = None
    ) -> None:
        """The next ``count`` command event streams that get that far: after ``after_events``
        whole NDJSON lines the broker sends half of the next line, then drops the connection
        (no end of the chunked body: the client sees a protocol error). ``sandbox``: only that
        sandbox's streams."""
        if isinstance(after_events, bool) or after_events < 0:
            raise ValueError(f"after_events must be an integer >= 0, not {after_events!r}")
        sandbox = self._sandbox(sandbox)
        with self._rules.lock:
            self._rules.event_drops.append(DropRule(count, after_events, sandbox))

    def crash_next_start(self, count: int = 1) -> None:
        """The next ``count`` sandboxes crash at startup: phase ``Failed``, reason
        ``RuntimeCrashed`` under ``/v1``; condition ``Ready``/``False``/``crashed`` under
        ``/rpc``."""
        if count < 0:
            raise ValueError("count must be >= 0")
        with self._rules.lock:
            self._rules.crashes = count

    def clear(self) -> None:
        """Remove injected 503s, drops, start crashes, event-stream cuts and the readiness
        delay."""
        self._rules.clear()
        self.set_readiness_delay(0.0)


# -- the request-level faults: an ASGI layer ---------------------------------------------------
class FaultLayer:
    """The broker's ASGI application ``app`` with the request-level faults of ``faults``
    (``protocols``: the dialects the broker serves, to route as it does)."""

    def __init__(self, app: ASGIApp, faults: FaultRules, protocols: tuple[str, ...]) -> None:
        self.app = app
        self.faults = faults
        self.protocols = protocols

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.faults.request_faults():
            await self.app(scope, receive, send)
            return
        try:
            origin_form(scope)
        except ApiError:
            await self.app(scope, receive, send)  # refused by the broker before anything
            return
        plane = plane_of(scope, self.protocols)
        if plane == "data":
            await self._data_plane(scope, receive, send)
            return
        retry_after = None
        if plane == "v1" and scope["path"] != "/v1/healthz":
            retry_after = self.faults.take_unavailable("control", scope["path"], None)
        elif plane == "rpc" and scope["method"] == "POST":
            retry_after = self.faults.take_unavailable("control", "/rpc", None)
        if retry_after is None:
            await self.app(scope, receive, send)
            return
        error = _unavailable(retry_after)
        response = (
            error.response() if plane == "v1" else plain_error(503, error.detail, error.headers)
        )
        await response(scope, receive, send)

    async def _data_plane(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            data = data_request(Request(scope, receive))
        except ApiError:
            await self.app(scope, receive, send)  # the broker refuses it: no fault applies
            return
        method, path, sandbox = scope["method"], data.target.path, data.sandbox_id
        retry_after = self.faults.take_unavailable("data", path, sandbox)
        if retry_after is not None:
            await _unavailable(retry_after).response()(scope, receive, send)
            return
        command = method == "POST" and path in _COMMAND_PATHS
        events = (method == "GET" and EVENTS_PATH.match(path)) or (
            method == "POST" and path in ("/commands", "/code/execute")
        )
        plan = self.faults.event_stream_plan(sandbox) if events else None
        if not command and plan is None:
            await self.app(scope, receive, send)
            return
        answer = _Answer(send, lambda: command and self.faults.take_drop(sandbox), plan)
        await answer.run(self.app, scope, receive)


def _unavailable(retry_after: int) -> ApiError:
    """The injected ``503`` (its code noted for the access line, as the broker's own are)."""
    error = ApiError(
        503,
        "unavailable",
        f"the broker is temporarily unavailable (injected); retry after {retry_after} s",
        {"Retry-After": str(retry_after)},
    )
    note_error(error.code, error.detail)
    return error


class _Cut(Exception):
    """Raised into the broker's relay: the stream it sends to was ended (or dropped) here."""


class _Answer:
    """The broker's answer to one data-plane request, on its way to the client through the
    faults: the runtime's answer to a command's start lost (``lose()``: decided when it
    arrives), or an event stream damaged by ``plan``. The broker's own answers (its error
    header) pass untouched."""

    def __init__(self, send: Send, lose: Callable[[], bool], plan: StreamPlan | None) -> None:
        self.send = send
        self.lose = lose
        self.plan = plan
        self.mode = "pass"
        self.held: Message | None = None
        self.lock = asyncio.Lock()
        self.ended = False
        self.dropped_in: int | None = None  # the line a drop cut
        self.pending = b""
        self.lines = 0
        self.inner: asyncio.Future[None] | None = None
        self.watchdog: asyncio.Task[None] | None = None

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive) -> None:
        """Run the broker on the request with this answer as its ``send``."""
        inner = self.inner = asyncio.ensure_future(app(scope, receive, self._send))
        try:
            await asyncio.wait({inner})
        except asyncio.CancelledError:  # the server stops: so does the broker's handling
            inner.cancel()
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.cancel()
        failure = None if inner.cancelled() else inner.exception()
        if failure is not None and not isinstance(failure, _Cut):
            raise failure
        if self.mode == "lose":  # the command ran; now its answer is lost
            assert self.held is not None
            await self.send({**self.held, "status": 200})
            raise DroppedConnection("injected: connection dropped after the command ran")
        if self.dropped_in is not None:
            raise DroppedConnection(f"injected: event stream dropped inside line {self.dropped_in}")

    async def _send(self, message: Message) -> None:
        if self.ended:
            raise _Cut
        if message["type"] == "http.response.start":
            await self._start(message)
        elif self.mode == "lose":
            pass  # read and dropped, never held: an answer may be large
        elif self.mode == "plan":
            async with self.lock:
                await self._feed(message)
        else:
            await self.send(message)

    async def _start(self, message: Message) -> None:
        headers = dict(message.get("headers", ()))
        forwarded = BROKER_ERROR_HEADER_RAW not in headers
        ndjson = headers.get(b"content-type", b"").startswith(b"application/x-ndjson")
        if forwarded and self.lose():
            self.mode, self.held = "lose", message
            return
        planned = forwarded and self.plan is not None and 200 <= message["status"] < 300 and ndjson
        if planned:  # a cut ends it early and cleanly: chunked, whatever length it announced
            kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"content-length"]
            message = {**message, "headers": kept}
        await self.send(message)
        if planned:
            assert self.plan is not None
            self.mode = "plan"
            seconds = self.plan.cut.after_seconds if self.plan.cut is not None else None
            if seconds is not None:
                self.watchdog = asyncio.ensure_future(self._end_after(seconds))

    async def _feed(self, message: Message) -> None:
        """The runtime's next chunk through the plan: whole lines only, until the cut."""
        assert self.plan is not None
        max_lines = self.plan.cut.after_events if self.plan.cut is not None else None
        self.pending += message.get("body", b"")
        while b"\n" in self.pending:
            line, _, self.pending = self.pending.partition(b"\n")
            line += b"\n"
            if self.lines == self.plan.drop_after and self.plan.take_drop():
                await self.send(_body(line[: max(1, len(line) // 2)], more=True))
                self.ended, self.dropped_in = True, self.lines + 1
                raise _Cut
            await self.send(_body(line, more=True))
            self.lines += 1
            if max_lines is not None and self.lines >= max_lines:
                await self._end()
                raise _Cut
        if not message.get("more_body", False):
            if self.pending:  # the runtime ended inside a line: pass that on unchanged
                await self.send(_body(self.pending, more=True))
            await self._end()

    async def _end(self) -> None:
        """End the client's stream cleanly (the caller holds the lock)."""
        self.ended = True
        await self.send(_body(b"", more=False))

    async def _end_after(self, seconds: float) -> None:
        """The cut by time: at a line boundary (the part of a line held back is never sent),
        even while the runtime is silent; the broker's relay is stopped."""
        await asyncio.sleep(seconds)
        async with self.lock:
            if self.ended:
                return
            await self._end()
        if self.inner is not None:
            self.inner.cancel()


def _body(data: bytes, *, more: bool) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more}


# -- the runtime-level faults: a RuntimeLauncher around the local backend's ---------------------
class FaultyRuntimes:
    """The :class:`~..broker.backends.local._launcher.RuntimeLauncher` ``inner`` with the faults of
    ``faults``: the next ``crash_next_start()`` starts fail (``RuntimeCrashed``, nothing
    started), and a started runtime is Ready only after the readiness delay (bound
    meanwhile)."""

    def __init__(self, inner: RuntimeLauncher, faults: FaultRules) -> None:
        self.inner = inner
        self.faults = faults

    async def start(self, spec: SandboxSpec) -> RuntimeHandle:
        if self.faults.take_crash():
            raise RuntimeStartError("RuntimeCrashed", "injected: the sandbox crashed at startup")
        return await self.inner.start(spec)

    async def ready(self, handle: RuntimeHandle) -> None:
        delay = self.faults.readiness_delay
        if delay > 0:
            await asyncio.sleep(delay)
        ready = getattr(self.inner, READY_METHOD, None)
        if ready is not None:
            await ready(handle)

    async def stop(self, handle: RuntimeHandle) -> None:
        await self.inner.stop(handle)

    def is_alive(self, handle: RuntimeHandle) -> bool:
        return self.inner.is_alive(handle)

    async def close(self) -> None:
        await self.inner.close()

    def kill_all_now(self) -> None:
        self.inner.kill_all_now()
