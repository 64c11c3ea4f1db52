"""``sandbox.commands``: run commands in a sandbox (the managed-command data plane, or the
legacy ``POST /execute`` on an old runtime). The decisions are in ``_command_flow``; this module
performs its steps with the sync transport."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Literal, Unpack, overload

from .._driver import drive, iterate
from .._upstream import ExecutionResult
from ._base import SandboxPart
from .core import _command_flow as cf
from .core import _options as opts
from .core._steps import Op
from .http._exchange import only_call
from .http._transport import BrokerTransport
from .wire._dataplane import CommandInfo, DataTarget

__all__ = ["CommandHandle", "Commands"]

Callback = Callable[[str], Any] | None


class _Performer:
    """Performs the steps of a command operation with the sync transport."""

    def __init__(self, transport: BrokerTransport, on_stdout: Callback, on_stderr: Callback):
        self._transport = transport
        self._callbacks = on_stdout, on_stderr
        self._stream: Generator[Any, None, None] | None = None

    def __call__(self, step: cf.Step) -> Any:
        match step:
            case cf.NextEvent():
                assert self._stream is not None
                return next(self._stream, None)
            case cf.Emit(event):
                callback = cf.output_callback(event, *self._callbacks)
                return None if callback is None else callback(event.data)
            case cf.OpenEvents(spec, json_answer):
                self.close()
                self._stream = self._transport.events(spec, json_answer=json_answer)
                return None
            case cf.Sleep(seconds):
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


class CommandHandle(cf.HandleBase):
    """A background command (``commands.run(..., background=True)`` or ``commands.get(id)``).

    ``wait()`` follows its output to the end, ``kill()`` stops its whole process group,
    ``status()`` asks the runtime, ``send_stdin()`` writes to it (started with ``stdin=True``),
    and iterating yields its output events (:class:`CommandEvent`) as they are produced, the last
    one of type ``exit``. Reading (``wait``, iteration) continues where the last read stopped."""

    _transport: BrokerTransport

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
        is produced."""
        result: ExecutionResult = _Performer(self._transport, on_stdout, on_stderr).drive(
            self._follow(timeout)
        )
        return result

    def kill(self) -> ExecutionResult:
        """Kill the command's process group and return its final result (the output the runtime
        retained). Safe to repeat; a command that already ended keeps its result."""
        return self._transport.call(cf.kill(self._target, self.command_id))

    def status(self) -> CommandInfo:
        """The command as the runtime reports it now (state, exit code, retained output)."""
        return self._transport.call(cf.status(self._target, self.command_id))

    def send_stdin(self, data: str | bytes, *, eof: bool = False) -> None:
        """Write ``data`` (text, or UTF-8 bytes) to the command's stdin; ``eof=True`` closes it
        afterwards. Never retried (the data would be written twice)."""
        self._transport.call(cf.send_stdin(self._target, self.command_id, data, eof))

    def __iter__(self) -> Iterator[cf.CommandEvent]:
        performer = _Performer(self._transport, None, None)
        try:
            for step in iterate(self._follow(None), performer, cf.Emit):
                yield step.event
        finally:
            performer.close()


class Commands(SandboxPart[BrokerTransport]):
    """Runs commands in one sandbox. Returned by ``Sandbox.commands``."""

    def __init__(self, transport: BrokerTransport, target: DataTarget) -> None:
        super().__init__(transport, target)
        self._features = cf.RuntimeFeatures()

    @overload
    def run(
        self,
        command: str | Sequence[str],
        timeout: float = 60,
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
        timeout: float = 60,
        *,
        background: bool,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | CommandHandle: ...

    def run(
        self,
        command: str | Sequence[str],
        timeout: float = 60,
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
        ``state='timed_out'``). ``envs`` (merged over the sandbox's environment) and ``cwd`` (an
        absolute path) apply to this command. ``on_stdout``/``on_stderr`` get the output as it
        is produced. ``stdin=True`` (background only) opens a pipe for ``send_stdin``. If the
        wait fails or is interrupted (Ctrl-C, a timeout), the command is killed. The start is
        never retried. On a runtime without managed commands a plain run falls back to
        ``/execute`` (same shell rules); ``on_stdout``, ``on_stderr``, ``envs``, ``cwd``,
        ``background`` and ``stdin`` raise :class:`UnsupportedByRuntimeError` there (nothing
        runs).
        """
        plan = cf.plan_run(command, timeout, background, options)
        if plan.background:
            command_id: str = self._transport.run(
                cf.start(self._target, plan.start, self._features)
            )
            return CommandHandle(self._transport, self._target, command_id)
        performer = _Performer(self._transport, plan.on_stdout, plan.on_stderr)
        op = cf.run(
            self._target,
            plan.start,
            self._features,
            raise_on_timeout=plan.raise_on_timeout,
            live=plan.live,
        )
        result: ExecutionResult = performer.drive(op)
        return result

    def get(self, command_id: str) -> CommandHandle:
        """Reattach to a command of this sandbox (started here or by another process of the
        same caller): its handle, checked to exist. Reading it replays the retained output."""
        self._transport.call(cf.status(self._target, command_id))
        return CommandHandle(self._transport, self._target, command_id)

    def list(self) -> list[CommandInfo]:
        """The sandbox's commands, running and retained (oldest first), without their output."""
        return self._transport.call(cf.list_commands(self._target))
