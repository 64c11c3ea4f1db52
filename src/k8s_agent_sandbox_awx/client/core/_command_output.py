"""A command's output (no I/O): its events (:class:`CommandEvent`), the reader's cursor and
the contiguity of the event stream (:class:`CommandOutput`), and :func:`follow`, which reads a
stream from its cursor to the last event, re-requesting it when it ends, drops or stalls.

:func:`follow` reads any :class:`EventCursor`: a command's :class:`CommandOutput`, a
terminal's (``_pty_flow``) or a ``run_code`` execution's (``_code_flow``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ... import errors
from ..._upstream import ExecutionResult
from ..wire import _commands_wire as cw
from ..wire import _dataplane as dp
from ..wire import _protocol as proto
from ._steps import NEXT_EVENT, Emit, Op, OpenEvents, Sleep

__all__ = [
    "COLLECT_LIMIT",
    "MAX_STREAM_FAILURES",
    "CommandEvent",
    "CommandOutput",
    "EventCursor",
    "follow",
    "next_event",
    "wait_timed_out",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")


COLLECT_LIMIT = 16 * 1024 * 1024
"""Characters of output (stdout and stderr together) a result keeps; beyond it the output still
reaches the callbacks but the result's ``output_truncated`` is ``True``."""


MAX_STREAM_FAILURES = 5
"""Re-requests of an event stream in a row that fail without a new event before giving up."""


@dataclass(frozen=True)
class CommandEvent:
    """One event of a command's output: ``type`` is ``stdout``, ``stderr`` or ``exit``; ``data``
    the text (empty for ``exit``); ``seq`` its sequence number; ``exit_code`` and ``state`` are
    set on the ``exit`` event."""

    type: str
    data: str
    seq: int
    exit_code: int | None = None
    state: str | None = None


class CommandOutput:
    """The reader's side of one command's event stream: the cursor, the contiguity check, the
    collected output and the exit event."""

    def __init__(self, command_id: str, *, collect: bool = True) -> None:
        self.command_id = command_id
        self.cursor = 0
        self.collect = collect
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.collected = 0
        self.truncated = False
        self.exit: CommandEvent | None = None

    def accept(self, value: Any) -> CommandEvent | None:
        """The event ``value`` is (``None`` for a heartbeat); a gap, a repeat or a malformed
        line is a :class:`BrokerProtocolError`."""
        what = f"follow the output of command {self.command_id!r}"
        checked = next_event(value, self.cursor, ("stdout", "stderr", "exit"), what, _MANAGED)
        if checked is None:
            return None
        kind, seq = checked
        self.cursor = seq
        data = value.get("data") or ""
        if kind == "exit":
            code = value.get("exit_code")
            self.exit = CommandEvent(
                "exit", "", seq, code if isinstance(code, int) else -1, str(value.get("state"))
            )
            return self.exit
        if not isinstance(data, str):
            raise proto.protocol_error(what, f"event {seq} has non-text data", _MANAGED)
        self._keep(kind, data)
        return CommandEvent(kind, data, seq)

    def _keep(self, kind: str, data: str) -> None:
        if not self.collect:
            return
        room = COLLECT_LIMIT - self.collected
        if len(data) > room:
            self.truncated = True
            data = data[: max(room, 0)]
        if data:
            (self.stdout if kind == "stdout" else self.stderr).append(data)
            self.collected += len(data)

    @property
    def ended(self) -> bool:
        return self.exit is not None

    def lost(self, exc: errors.CommandOutputLostError) -> None:
        """Events up to ``exc.resume_after`` are gone (not retained): go on after them."""
        if exc.resume_after is None or exc.resume_after < self.cursor:
            raise exc
        self.cursor = exc.resume_after
        self.truncated = True

    def result(self) -> ExecutionResult:
        end = self.exit
        state = end.state if end is not None and end.state else "running"
        return ExecutionResult(
            stdout="".join(self.stdout),
            stderr="".join(self.stderr),
            exit_code=end.exit_code if end is not None and end.exit_code is not None else -1,
            timed_out=state == "timed_out",
            output_truncated=self.truncated,
            command_id=self.command_id,
            state=state,
        )


_MANAGED = "the managed-command protocol"


def next_event(
    value: Any, cursor: int, kinds: tuple[str, ...], what: str, protocol: str
) -> tuple[str, int] | None:
    """``(type, seq)`` of the event line ``value`` after ``cursor`` (``None``: a heartbeat);
    a gap, a repeat, another type than ``kinds`` or a malformed line is a
    :class:`BrokerProtocolError` (``what`` failed, under ``protocol``)."""
    if not isinstance(value, dict) or not isinstance(value.get("seq"), int):
        raise proto.protocol_error(what, f"bad event {value!r}"[:200], protocol)
    kind, seq = value.get("type"), value["seq"]
    if kind == "heartbeat":
        return None
    if kind not in kinds or seq != cursor + 1:
        raise proto.protocol_error(
            what, f"event {kind!r} seq {seq} after seq {cursor} (not contiguous)", protocol
        )
    return str(kind), seq


class EventCursor(Protocol):
    """What :func:`follow` reads an event stream into: a command's :class:`CommandOutput`, or
    a ``run_code`` execution's (``_code_flow``)."""

    cursor: int
    exit: Any
    """Its last event once it arrived (``None`` before)."""

    @property
    def command_id(self) -> str:
        """The id of what is followed (named by the errors)."""

    @property
    def ended(self) -> bool:
        """Whether its last event arrived."""

    def accept(self, value: Any) -> Any:
        """The event ``value`` is, checked (``None``: a heartbeat)."""

    def lost(self, exc: errors.CommandOutputLostError) -> None:
        """Events up to ``exc.resume_after`` are gone: go on after them, or raise."""

    def result(self) -> Any:
        """What the operation returns once it ended."""


def follow(
    target: dp.DataTarget,
    output: EventCursor,
    deadline: float | None = None,
    *,
    timeout: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    opened: bool = False,
    events: Callable[[int, float], proto.RequestSpec] | None = None,
) -> Op[Any]:
    """Follow ``output``'s command from its cursor to its exit event, yielding each output event
    (:class:`Emit`); returns its :class:`ExecutionResult`. The stream is re-requested with the
    cursor when it ends (every 20 s) or drops (a fresh token each time); a ``410`` goes on after
    the lost events. Past ``deadline`` (``clock`` time; ``timeout``: the wait's, for the
    message) :class:`CommandWaitTimeoutError` is raised; the command is left running.
    ``opened``: a stream of the command's events from the cursor is open already (the rest of
    a streamed start) and is read first. ``events``: the request of the events after a cursor
    for a duration (default: the command's, ``GET /commands/{id}/events``)."""
    failures = 0
    while output.exit is None:
        remaining = cw.EVENTS_DURATION if deadline is None else deadline - clock()
        if remaining <= 0:
            raise wait_timed_out(output.command_id, timeout)
        duration = min(cw.EVENTS_DURATION, max(remaining, 0.05))
        position = output.cursor
        if not opened:
            spec = (
                cw.command_events(target, output.command_id, position, duration)
                if events is None
                else events(position, duration)
            )
            yield OpenEvents(spec)
        opened = False
        while True:
            try:
                value = yield NEXT_EVENT
            except errors.CommandOutputLostError as exc:
                output.lost(exc)
                break
            except (errors.BrokerUnavailableError, errors.RequestTimeoutError):
                failures += 1
                if failures > MAX_STREAM_FAILURES:
                    raise
                yield Sleep(min(0.1 * 2**failures, 2.0))
                break
            if value is None or output.cursor != position:
                break  # the stream ended, or another reader of this handle went on: resume
            event = output.accept(value)
            position = output.cursor
            if event is not None:
                failures = 0
                yield Emit(event)
            if output.ended:
                yield from _drain_stream()
                break
            if deadline is not None and clock() >= deadline:
                break
    return output.result()


def wait_timed_out(command_id: str, timeout: float | None) -> errors.CommandWaitTimeoutError:
    """The error of a ``wait(timeout=)`` that passed: the command goes on."""
    waited = f" after {timeout:g}s" if timeout is not None else ""
    return errors.CommandWaitTimeoutError(
        f"Command {command_id!r} is still running{waited} (the wait timed out); it goes on. "
        "Call wait() again, or kill() to stop it.",
        command_id=command_id,
        timeout=timeout if timeout is not None else 0.0,
    )


def _drain_stream() -> Op[Any]:
    """Read the stream to its end (the runtime ends it after the exit event), so that its
    connection goes back to the pool instead of being closed (a new TLS handshake per command
    otherwise). The result is complete: a failure here changes nothing and is not raised."""
    try:
        while (yield NEXT_EVENT) is not None:
            pass
    except (errors.BrokerUnavailableError, errors.RequestTimeoutError, errors.BrokerProtocolError):
        logger.debug("an event stream broke after its exit event", exc_info=True)
