"""Terminals (``sandbox.pty``), written once for the sync and the async API (no I/O).

A terminal is a managed command with extras (``docs/broker-api.md#terminals-pty``): its start
carries ``"pty": {"cols", "rows"}``, its output is the command's event stream (with its cursor,
so a terminal survives a reconnect) read as bytes (:class:`PtyOutput`: ``data_base64`` when
the runtime sent the exact bytes, else the text encoded), its input is the stdin endpoint with
bytes, and it is resized with ``POST /commands/{id}/resize``. The operations here reuse the
commands': the start (``_command_start``: sent once, an interrupted one looked up by its request
id and killed), the follow loop (``_command_output``), the kill (``_command_ops``). A runtime
without terminals is found out at the start and is an
:class:`~...errors.UnsupportedByRuntimeError` naming the feature; nothing is left running.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ... import errors
from ..wire import _commands_wire as cw
from ..wire import _dataplane as dp
from ..wire import _protocol as proto
from ..wire import _stdin_wire as stdin_wire
from . import _command_ops as ops
from ._command_output import CommandEvent, CommandOutput
from ._command_rules import StartPlan, check_cwd, check_envs, check_timeout, command_argv
from ._command_start import RuntimeFeatures, send_start
from ._steps import Call, Op, discard_answer, learning

__all__ = [
    "DEFAULT_COMMAND",
    "PTY",
    "PtyEvent",
    "PtyOutput",
    "PtyPlan",
    "not_iterable",
    "other_on_data",
    "plan_pty",
    "resize",
    "send_stdin",
    "sized",
    "start",
]

PTY = "pty"
"""The feature a terminal needs (what :class:`~...errors.UnsupportedByRuntimeError` names)."""
MAX_SIDE = 65535
"""The most columns or rows a terminal has (the kernel's ``winsize`` holds unsigned shorts)."""

LOGIN_SHELL_SCRIPT = (
    'if [ -n "$SHELL" ] && [ -x "$SHELL" ]; then exec "$SHELL" -l; fi; '
    "command -v bash >/dev/null 2>&1 && exec bash -l; exec /bin/sh -l"
)
DEFAULT_COMMAND = ("/bin/sh", "-c", LOGIN_SHELL_SCRIPT, "sh")
"""What a terminal runs without ``command``: the sandbox's login shell (``$SHELL`` if it is
set and executable, else bash, else ``/bin/sh``), decided in the sandbox by one process."""


@dataclass(frozen=True)
class PtyEvent(CommandEvent):
    """An output event of a terminal: ``raw`` holds its bytes exactly."""

    raw: bytes = b""


class PtyOutput(CommandOutput):
    """The reader's side of a terminal's event stream: the cursor and its checks (as a
    command's), each output event's bytes, and no collected output (a terminal's output is
    what its reader is handed)."""

    def __init__(self, command_id: str) -> None:
        super().__init__(command_id, collect=False)

    def accept(self, value: Any) -> CommandEvent | None:
        event = super().accept(value)
        if event is None or event.type == "exit":
            return event
        encoded = value.get("data_base64")
        if encoded is None:
            return PtyEvent(event.type, event.data, event.seq, raw=event.data.encode())
        try:
            if not isinstance(encoded, str):
                raise ValueError("not a string")
            raw = base64.b64decode(encoded, validate=True)
        except (ValueError, binascii.Error):
            what = f"follow the output of command {self.command_id!r}"
            raise proto.protocol_error(
                what, f"event {event.seq} has a bad data_base64", _MANAGED
            ) from None
        return PtyEvent(event.type, event.data, event.seq, raw=raw)


_MANAGED = "the managed-command protocol"


# --------------------------------------------------------------------------------------------
# Before anything is sent


def check_size(cols: Any, rows: Any) -> tuple[int, int]:
    """``(cols, rows)``, integers from 1 to 65535, else a ``TypeError``/``ValueError``."""
    for name, value in (("cols", cols), ("rows", rows)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int (character cells), got {value!r}.")
        if not 1 <= value <= MAX_SIDE:
            raise ValueError(f"{name} must be from 1 to {MAX_SIDE} (character cells), got {value}.")
    return cols, rows


def sized(cols: Any, rows: Any, size: Any) -> tuple[Any, Any]:
    """``(cols, rows)``, or those of ``size`` (E2B's ``PtySize(rows=..., cols=...)``: any
    object with ``cols`` and ``rows``) when it is given; both ways at once is a ``TypeError``."""
    if size is None:
        return cols, rows
    if cols is not None or rows is not None:
        raise TypeError("give the terminal's size as cols and rows, or as size=, not both.")
    if not (hasattr(size, "cols") and hasattr(size, "rows")):
        raise TypeError(f"size must have cols and rows (as E2B's PtySize), got {size!r}.")
    return size.cols, size.rows


@dataclass(frozen=True)
class PtyPlan(StartPlan):
    """A terminal checked and ready to start: a managed command's start with ``"pty"``
    (``timeout`` infinite: no time limit, the field left out)."""

    size: tuple[int, int] = (80, 24)

    def body(self) -> dict[str, Any]:
        body = super().body()
        del body["stdin"]  # implied by the pty
        if not math.isfinite(self.timeout):
            del body["timeout"]
        body["pty"] = {"cols": self.size[0], "rows": self.size[1]}
        return body


def plan_pty(
    cols: Any,
    rows: Any,
    command: str | Sequence[str] | None,
    cwd: str | None,
    envs: Mapping[str, str] | None,
    timeout: float | None,
    on_data: Callable[[bytes], Any] | None,
    size: Any = None,
) -> PtyPlan:
    """``pty.create``'s arguments, checked before anything is sent (a string command runs
    through bash as ``commands.run``'s does; ``None``: the login shell; the size as ``cols``
    and ``rows`` or as ``size``, see :func:`sized`; 80 x 24 without either)."""
    cols, rows = sized(cols, rows, size)
    checked = check_size(80 if cols is None else cols, 24 if rows is None else rows)
    if on_data is not None and not callable(on_data):
        raise TypeError(f"on_data must be callable, got {type(on_data).__name__}.")
    argv = list(DEFAULT_COMMAND) if command is None else command_argv(command, None)
    limit = math.inf if timeout is None else check_timeout(timeout)
    plan = StartPlan(argv, limit, check_envs(envs), check_cwd(cwd), stdin=True)
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    return PtyPlan(**fields, size=checked)


_READ_BY_ON_DATA = "This terminal's output goes to the on_data given to pty.create(); "


def other_on_data() -> ValueError:
    """The error of ``wait(on_data=...)`` on a terminal whose ``create`` had an ``on_data``."""
    return ValueError(_READ_BY_ON_DATA + "wait() takes no other on_data.")


def not_iterable() -> TypeError:
    """The error of iterating a terminal whose ``create`` had an ``on_data``."""
    return TypeError(_READ_BY_ON_DATA + "iterate a terminal created without on_data.")


# --------------------------------------------------------------------------------------------
# Operations


def start(target: dp.DataTarget, plan: PtyPlan, features: RuntimeFeatures) -> Op[str]:
    """Start a terminal: ``POST /commands`` with its ``pty`` (sent once: an interrupted start
    is looked up by its request id and killed, as a command's), then its status, which must
    show the terminal; returns the command id. A runtime without terminals (it refused the
    field, has no managed commands, or started the command without a terminal: then it is
    killed) is :class:`UnsupportedByRuntimeError`."""
    return learning(_start(target, plan, features.managed), features.record)


def _start(target: dp.DataTarget, plan: PtyPlan, managed: bool | None) -> Op[str]:
    if managed is False:
        raise _unsupported(target, "it has no managed commands (POST /commands answered 404)")
    try:
        command_id = yield from send_start(target, plan, stream=False)  # the one start
    except errors.BrokerError as exc:
        if _refuses_pty(exc):
            raise _unsupported(target, f"it refused the option ({exc.detail})") from None
        raise
    if command_id is None:
        raise _unsupported(target, "it has no managed commands (POST /commands answered 404)")
    try:
        info: cw.CommandInfo = yield ops.status(target, command_id)
    except GeneratorExit:
        raise
    except BaseException as exc:  # nobody holds the terminal yet: it must not run unseen
        failed = yield from ops.kill_quietly(target, command_id)
        ops.note_unkilled(exc, target, command_id, failed)
        raise
    if info.pty is None:  # a runtime that ignores fields it does not know
        failed = yield from ops.kill_quietly(target, command_id)
        why = "it was killed" if failed is None else "it could not be killed: see the note"
        unsupported = _unsupported(target, f"it started the command without a terminal; {why}")
        ops.note_unkilled(unsupported, target, command_id, failed)
        raise unsupported
    return command_id


def _refuses_pty(exc: errors.BrokerError) -> bool:
    """The runtime's refusal of the ``pty`` field (a ``400`` of its own naming it)."""
    detail = exc.detail or ""
    return exc.status_code in (400, 422) and exc.code is None and "pty" in detail


def _unsupported(target: dp.DataTarget, why: str) -> errors.UnsupportedByRuntimeError:
    return errors.UnsupportedByRuntimeError(
        f"pty.create() cannot open a terminal in sandbox {target.sandbox_id!r}: its runtime has "
        f"no terminals ({why}). Terminals need a runtime that serves managed commands with the "
        '"pty" option (the local broker\'s runtime; see broker-api.md, "Terminals"). Nothing '
        "runs. Use commands.run(..., background=True, stdin=True) for a program that needs no "
        "terminal, or recreate the sandbox from a template whose runtime has terminals.",
        options=(PTY,),
    )


def resize(target: dp.DataTarget, command_id: str, cols: Any, rows: Any) -> Call[None]:
    """``POST /commands/{id}/resize`` (retried: an absolute size)."""
    size = check_size(cols, rows)
    return Call(cw.resize_command(target, command_id, *size), discard_answer)


def send_stdin(
    target: dp.DataTarget, command_id: str, data: bytes | bytearray | memoryview | str
) -> Call[None]:
    """``POST /commands/{id}/stdin`` with a terminal's input (never retried): text, or bytes
    (sent as text when they are UTF-8, else as ``data_base64``)."""
    if isinstance(data, bytearray | memoryview):
        data = bytes(data)
    if isinstance(data, bytes):
        with contextlib.suppress(UnicodeDecodeError):  # else sent exactly, base64-encoded
            data = data.decode("utf-8")
    elif not isinstance(data, str):
        raise TypeError(f"stdin data must be bytes or str, got {type(data).__name__}.")
    spec = stdin_wire.command_stdin(
        target, command_id, data, False
    )  # refuses a body over the limit
    return Call(spec, discard_answer, fail=stdin_wire.stdin_refusal(spec))


def status(target: dp.DataTarget, command_id: str) -> Call[cw.CommandInfo]:
    return ops.status(target, command_id)


def not_a_terminal(target: dp.DataTarget, command_id: str) -> ValueError:
    return ValueError(
        f"Command {command_id!r} in sandbox {target.sandbox_id!r} does not run on a terminal; "
        "reattach to it with commands.get(command_id) instead."
    )
