"""What the sync and async ``commands`` shells share (no I/O): a background command's handle
(:class:`HandleBase`: its id and what was read of its output, one reader at a time), the wait's
time limit, and where an output event goes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from ..wire import _dataplane as dp
from ._command_output import CommandEvent, CommandOutput, follow
from ._steps import Op

__all__ = [
    "HandleBase",
    "followed_elsewhere",
    "output_callback",
    "wait_deadline",
    "wait_seconds",
]


def followed_elsewhere(command_id: str, what: str) -> ValueError:
    """``what`` (a ``wait`` with callbacks, an iteration) on a handle whose output already goes
    to the callbacks given at its start: one reader at a time."""
    return ValueError(
        f"{what}: the output of command {command_id!r} goes to the on_stdout/on_stderr given "
        "when it started (read while it runs). Call wait() without callbacks for its result, or "
        "close() the handle first to stop those callbacks."
    )


def output_callback(
    event: CommandEvent,
    on_stdout: Callable[[str], Any] | None,
    on_stderr: Callable[[str], Any] | None,
) -> Callable[[str], Any] | None:
    """The callback an output event goes to (``None``: none, or the exit event)."""
    return {"stdout": on_stdout, "stderr": on_stderr}.get(event.type)


def wait_seconds(timeout: float) -> float:
    """``wait(timeout=)`` checked: a number of seconds >= 0."""
    limit = float(timeout)
    if math.isnan(limit) or limit < 0:
        raise ValueError(f"wait(timeout=) must be a number of seconds >= 0 or None, got {timeout}.")
    return limit


def wait_deadline(
    timeout: float | None, clock: Callable[[], float] = time.monotonic
) -> float | None:
    if timeout is None:
        return None
    return clock() + wait_seconds(timeout)


class HandleBase:
    """What a background command's sync and async handles share: its id and what was read of
    its output so far (one reader at a time)."""

    def __init__(self, transport: Any, target: dp.DataTarget, command_id: str) -> None:
        self._transport = transport
        self._target = target
        self.command_id = command_id
        self._output = CommandOutput(command_id)

    def __repr__(self) -> str:
        end = self._output.exit
        state = f"{end.state}, exit {end.exit_code}" if end is not None else "not seen ended"
        return f"{type(self).__name__}(command_id={self.command_id!r}, {state})"

    def _follow(self, timeout: float | None) -> Op[Any]:
        return follow(self._target, self._output, wait_deadline(timeout), timeout=timeout)
