"""``sandbox.commands``: run commands in a sandbox (the managed-command data plane, or the
legacy ``POST /execute`` on an old runtime). The decisions are in ``_command_ops``; this module
performs its steps with the sync transport."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Literal, Unpack, overload

from .._driver import drive, iterate
from .._upstream import ExecutionResult
from ._base import SandboxPart
from ._deleted import ends_quietly
from .core import _command_ops as ops
from .core import _options as opts
from .core._command_handle import HandleBase, followed_elsewhere, output_callback, wait_seconds
from .core._command_output import CommandEvent, wait_timed_out
from .core._command_rules import check_callbacks, plan_run
from .core._command_start import RuntimeFeatures
from .core._steps import Emit, Learned, NextEvent, Op, OpenEvents, Sleep, Step
from .http._exchange import only_call
from .http._transport import BrokerTransport
from .wire._commands_wire import CommandInfo
from .wire._dataplane import DataTarget

__all__ = ["CommandHandle", "Commands"]

Callback = Callable[[str], Any] | None
logger = logging.getLogger("k8s_agent_sandbox_awx.client")

STOP_WAIT = 5.0
"""Seconds a kill or a close waits for the thread that follows a command's output to end (it
notices a stop at its next event or heartbeat, every 2 s on the local runtime); it is a daemon
thread that ends at its next event or heartbeat if it takes longer."""


class _Stopped(Exception):
    """Raised into a followed command's operation when its thread is told to stop."""


class _Performer:
    """Performs the steps of a command operation with the sync transport (``stop``: set from
    another thread to end the operation at its next step)."""

    def __init__(
        self,
        transport: BrokerTransport,
        on_stdout: Callback,
        on_stderr: Callback,
        stop: threading.Event | None = None,
        record: Callable[[Learned], None] | None = None,
    ):
        self._transport = transport
        self._callbacks = on_stdout, on_stderr
        self._stream: Generator[Any, None, None] | None = None
        self._stop = stop
        self._record = record
        """Keeps what the operation learns (``ops.foreground``'s :class:`Learned` steps)."""

    def __call__(self, step: Step) -> Any:
        if self._stop is not None and self._stop.is_set():
            raise _Stopped
        match step:
            case NextEvent():
                assert self._stream is not None
                return next(self._stream, None)
            case Emit(event):
                callback = output_callback(event, *self._callbacks)
                return None if callback is None else callback(event.data)
            case OpenEvents(spec, json_answer):
                self.close()
                self._stream = self._transport.events(spec, json_answer=json_answer)
                return None
            case Learned() if self._record is not None:
                return self._record(step)
            case Sleep(seconds):
                return time.sleep(seconds)
            case _:
                return self._transport.call(only_call(step))

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def drive(self, op: Op[Any]) -> Any:
        try:
            return drive(op, self)
        finally:
            self.close()


class _Follower:
    """The thread that follows a background command's output to the callbacks given at its
    start (``run(..., background=True, on_stdout=...)``, ``connect(id, on_stdout=...)``): it
    ends with the command, or when told to stop (``kill``, ``close``, the sandbox's end)."""

    def __init__(self, handle: CommandHandle, on_stdout: Callback, on_stderr: Callback) -> None:
        self.stop = threading.Event()
        self.result: ExecutionResult | None = None
        self.error: BaseException | None = None
        performer = _Performer(handle._transport, on_stdout, on_stderr, self.stop)
        self._thread = threading.Thread(
            target=self._follow,
            args=(performer, handle),
            name=f"agent-sandbox-output-{handle.command_id}",
            daemon=True,  # never holds up the interpreter's exit
        )
        self._thread.start()

    def _follow(self, performer: _Performer, handle: CommandHandle) -> None:
        try:
            self.result = performer.drive(handle._follow(None))
        except _Stopped:
            pass
        except BaseException as exc:  # kept for wait(), which raises it
            self.error = exc
            if ends_quietly(handle._target, exc):  # this process deleted its sandbox
                return
            logger.warning(
                "stopped following the output of command %s: %s (wait() raises it)",
                handle.command_id,
                type(exc).__name__,
            )

    def join(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def halt(self) -> None:
        """Tell the thread to stop at its next step (without waiting)."""
        self.stop.set()


class CommandHandle(HandleBase):
    """A background command (``commands.run(..., background=True)`` or ``commands.get(id)``).

    ``wait()`` follows its output to the end, ``kill()`` stops its whole process group,
    ``status()`` asks the runtime, ``send_stdin()`` writes to it (started with ``stdin=True``),
    and iterating yields its output events (:class:`CommandEvent`) as they are produced, the last
    one of type ``exit``. Reading (``wait``, iteration) continues where the last read stopped.
    Started with ``on_stdout``/``on_stderr`` (or from ``commands.connect(id, on_stdout=...)``),
    a thread of the handle delivers its output to them while it runs; ``close()`` stops that
    (the command goes on)."""

    _transport: BrokerTransport
    _follower: _Follower | None = None

    def _deliver(self, on_stdout: Callback, on_stderr: Callback) -> None:
        """Follow the output to the callbacks in a thread of this handle, from now on."""
        self._follower = _Follower(self, on_stdout, on_stderr)

    def wait(
        self,
        timeout: float | None = None,
        *,
        on_stdout: Callback = None,
        on_stderr: Callback = None,
    ) -> ExecutionResult:
        """Wait until the command ends and return its result (the output read through this
        handle). ``timeout`` (seconds, ``None``: no limit): :class:`CommandWaitTimeoutError` is
        raised when it passes; the command keeps running. The callbacks get the output as it
        is produced (a handle whose output goes to the callbacks given at its start takes
        none here)."""
        follower = self._follower
        if follower is None:
            result: ExecutionResult = _Performer(self._transport, on_stdout, on_stderr).drive(
                self._follow(timeout)
            )
            return result
        if on_stdout is not None or on_stderr is not None:
            raise followed_elsewhere(self.command_id, "wait(on_stdout=..., on_stderr=...)")
        if not follower.join(None if timeout is None else wait_seconds(timeout)):
            raise wait_timed_out(self.command_id, timeout)
        return self._followed(follower)

    def _followed(self, follower: _Follower) -> ExecutionResult:
        """The result the ended ``follower`` got, or its error (raised once: a later wait
        follows the output itself, from where it stopped)."""
        if follower.error is not None or follower.result is None:
            self._follower = None
            if follower.error is not None:
                raise follower.error
            return self.wait()
        return follower.result

    def kill(self) -> ExecutionResult:
        """Kill the command's process group and return its final result (the output the runtime
        retained). Safe to repeat; a command that already ended keeps its result. The callbacks
        given at its start get its last output first (for up to 5 s)."""
        result = self._transport.call(ops.kill(self._target, self.command_id))
        follower = self._follower
        if follower is not None and not follower.join(STOP_WAIT):
            follower.halt()
        return result

    def close(self) -> None:
        """Stop delivering the output to the callbacks given at its start (the command goes
        on; ``wait()`` and iteration read it from where they stopped). Nothing to do for a
        handle without them."""
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.halt()
            follower.join(STOP_WAIT)

    def status(self) -> CommandInfo:
        """The command as the runtime reports it now (state, exit code, retained output)."""
        return self._transport.call(ops.status(self._target, self.command_id))

    def send_stdin(self, data: str | bytes, *, eof: bool = False) -> None:
        """Write ``data`` (text, or UTF-8 bytes) to the command's stdin; ``eof=True`` closes it
        afterwards. Never retried (the data would be written twice)."""
        self._transport.call(ops.send_stdin(self._target, self.command_id, data, eof))

    def __iter__(self) -> Iterator[CommandEvent]:
        if self._follower is not None:
            raise followed_elsewhere(self.command_id, "Iterating the handle")
        performer = _Performer(self._transport, None, None)
        try:
            for step in iterate(self._follow(None), performer, Emit):
                yield step.event
        finally:
            performer.close()


class Commands(SandboxPart[BrokerTransport]):
    """Runs commands in one sandbox. Returned by ``Sandbox.commands``."""

    def __init__(self, transport: BrokerTransport, target: DataTarget) -> None:
        super().__init__(transport, target)
        self._features = RuntimeFeatures()
        self._delivering: weakref.WeakSet[CommandHandle] = weakref.WeakSet()
        """Handles whose output a thread delivers to callbacks (stopped with the sandbox)."""

    @overload
    def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,
        *,
        background: Literal[True],
        **options: Unpack[opts.RunOptions],
    ) -> CommandHandle: ...

    @overload
    def run(
        self,
        command: str | Sequence[str],
        timeout: float = 60,
        *,
        background: Literal[False] = False,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult: ...

    @overload
    def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,
        *,
        background: bool,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | CommandHandle: ...

    def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,
        *,
        background: bool = False,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | CommandHandle:
        """Run ``command`` and return its :class:`ExecutionResult` (a non-zero exit code is a
        result, not an exception), or with ``background=True`` its :class:`CommandHandle`.

        A string runs through a shell (bash, or ``/bin/sh`` where the sandbox has no bash); a
        list is an argv run without a shell;
        ``shell=False`` splits a string with shell-like rules and runs it without a shell.
        Never put untrusted values into a shell string: pass an argv list instead.
        ``timeout``: the command's time limit in seconds (the runtime kills it after that;
        :class:`CommandTimeoutError`, or with ``raise_on_timeout=False`` a result with
        ``state='timed_out'``); with ``background=True``, ``timeout=0`` (or ``None``) is no
        time limit: the command runs until it exits, is killed or its sandbox ends (a runtime
        that predates it: :class:`UnsupportedByRuntimeError`, nothing runs). ``envs`` (merged
        over the sandbox's environment) and ``cwd`` (an absolute path) apply to this command.
        ``on_stdout``/``on_stderr`` get the output as it is produced. ``stdin=True``
        (background only) opens a pipe for ``send_stdin``. If the wait fails or is interrupted
        (Ctrl-C, a timeout), the command is killed. The start is
        never retried. On a runtime without managed commands a plain run falls back to
        ``/execute`` (same shell rules); ``on_stdout``, ``on_stderr``, ``envs``, ``cwd``,
        ``background`` and ``stdin`` raise :class:`UnsupportedByRuntimeError` there (nothing
        runs).
        """
        plan = plan_run(command, timeout, background, options)
        if plan.background:
            command_id: str = self._transport.run(
                ops.start(self._target, plan.start, self._features)
            )
            return self._handle(command_id, plan.on_stdout, plan.on_stderr)
        features = self._features
        performer = _Performer(
            self._transport, plan.on_stdout, plan.on_stderr, record=features.record
        )
        op = ops.foreground(self._target, plan.start, features, plan.raise_on_timeout, plan.live)
        result: ExecutionResult = performer.drive(op)
        return result

    def _handle(self, command_id: str, on_stdout: Callback, on_stderr: Callback) -> CommandHandle:
        """The handle of a started command; with callbacks, its output goes to them while it
        runs (a thread of the handle)."""
        handle = CommandHandle(self._transport, self._target, command_id)
        if on_stdout is not None or on_stderr is not None:
            handle._deliver(on_stdout, on_stderr)
            self._delivering.add(handle)
        return handle

    def get(self, command_id: str) -> CommandHandle:
        """Reattach to a command of this sandbox (started here or by another process of the
        same caller): its handle, checked to exist. Reading it replays the retained output."""
        self._transport.call(ops.status(self._target, command_id))
        return CommandHandle(self._transport, self._target, command_id)

    def connect(
        self, command_id: str, *, on_stdout: Callback = None, on_stderr: Callback = None
    ) -> CommandHandle:
        """E2B's name for :meth:`get`: the handle of a running or retained command, checked to
        exist; with ``on_stdout``/``on_stderr`` its output (the retained output first) goes to
        them while it runs, as for ``run(..., background=True, on_stdout=...)``."""
        check_callbacks(on_stdout, on_stderr)
        self._transport.call(ops.status(self._target, command_id))
        return self._handle(command_id, on_stdout, on_stderr)

    def kill(self, command_id: str) -> ExecutionResult:
        """Kill command ``command_id``'s process group (E2B's ``commands.kill``; the same as
        ``get(command_id).kill()``): its final result. Safe to repeat."""
        return self._transport.call(ops.kill(self._target, command_id))

    def send_stdin(self, command_id: str, data: str | bytes, *, eof: bool = False) -> None:
        """Write ``data`` to command ``command_id``'s stdin (E2B's ``commands.send_stdin``; the
        same as ``get(command_id).send_stdin(data)``). Never retried."""
        self._transport.call(ops.send_stdin(self._target, command_id, data, eof))

    def _halt_output(self) -> list[_Follower]:
        """Tell every thread that delivers a command's output to callbacks to stop (the sandbox
        is being killed, or its connection closed); they end at their next step."""
        handles = list(self._delivering)
        self._delivering.clear()
        followers = [h._follower for h in handles if h._follower is not None]
        for follower in followers:
            follower.halt()
        return followers

    @staticmethod
    def _join_output(followers: list[_Follower]) -> None:
        """Wait up to :data:`STOP_WAIT` in all for the halted ``followers`` to end."""
        deadline = time.monotonic() + STOP_WAIT
        for follower in followers:
            follower.join(max(0.0, deadline - time.monotonic()))

    def _stop_output(self) -> None:
        self._join_output(self._halt_output())

    def list(self) -> list[CommandInfo]:
        """The sandbox's commands, running and retained (oldest first), without their output."""
        return self._transport.call(ops.list_commands(self._target))
