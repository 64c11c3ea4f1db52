"""``sandbox.pty``: terminals in a sandbox (a managed command on a pseudo-terminal). The
decisions are in ``_pty_flow`` (and the commands' ``core/_command_*``, whose start, follow and
kill a terminal shares); this module performs their steps with the sync transport."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .. import errors
from .._driver import iterate
from .._upstream import ExecutionResult
from ._base import SandboxPart
from ._commands import _Performer
from ._deleted import ends_quietly
from .core import _command_ops as ops
from .core import _pty_flow as pf
from .core._command_handle import HandleBase
from .core._command_start import RuntimeFeatures
from .core._steps import Emit, Step
from .http._transport import BrokerTransport
from .wire._commands_wire import CommandInfo
from .wire._dataplane import DataTarget

__all__ = ["Pty", "PtyHandle"]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")

OnData = Callable[[bytes], Any] | None


class _Stopped(Exception):
    """The handle was closed: its reader stops (the terminal goes on)."""


class _PtyPerformer(_Performer):
    """Performs a terminal's steps: its output events go to ``on_data`` as bytes; ``stop``
    (set by ``close``) ends the reading at the next event or heartbeat (at most 2 s)."""

    def __init__(
        self, transport: BrokerTransport, on_data: OnData, stop: threading.Event | None = None
    ) -> None:
        super().__init__(transport, None, None)
        self._on_data = on_data
        self._stop = stop

    def __call__(self, step: Step) -> Any:
        if self._stop is not None and self._stop.is_set():
            raise _Stopped
        if isinstance(step, Emit):
            event = step.event
            if self._on_data is not None and isinstance(event, pf.PtyEvent):
                return self._on_data(event.raw)
            return None
        return super().__call__(step)


class _Reader:
    """The thread that hands a terminal's output to ``on_data`` as it arrives (from ``create``
    on), until the terminal ends, the handle is closed, or ``on_data`` raises."""

    def __init__(self, handle: PtyHandle, on_data: Callable[[bytes], Any]) -> None:
        self.stop = threading.Event()
        self.done = threading.Event()
        self.result: ExecutionResult | None = None
        self.error: BaseException | None = None
        self._handle = handle
        self._performer = _PtyPerformer(handle._transport, on_data, self.stop)
        name = f"pty-{handle.command_id}"
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = self._performer.drive(self._handle._follow(None))
        except _Stopped:
            pass
        except BaseException as exc:  # raised by wait(); logged, in case nobody waits
            self.error = exc
            if self._handle._transport.is_closed:  # its sandbox was closed: the reading ends
                return
            if ends_quietly(self._handle._target, exc):  # this process deleted its sandbox
                return
            logger.warning(
                "the output of terminal %s is no longer read: %s: %s (wait() raises it)",
                self._handle.command_id,
                type(exc).__name__,
                exc,
            )
        finally:
            self.done.set()

    def join(self, handle: PtyHandle, timeout: float | None) -> ExecutionResult:
        if not self.done.wait(timeout):
            raise errors.CommandWaitTimeoutError(
                f"Terminal {handle.command_id!r} is still running after {timeout:g}s (the wait "
                "timed out); it goes on. Call wait() again, or kill() to stop it.",
                command_id=handle.command_id,
                timeout=timeout if timeout is not None else 0.0,
            )
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise RuntimeError(f"the handle of terminal {handle.command_id!r} was closed")
        return self.result


class PtyHandle(HandleBase):
    """A terminal in the sandbox (``sandbox.pty.create()`` or ``sandbox.pty.connect(id)``).

    ``send_stdin()`` types into it (bytes or text: Ctrl-C is ``b"\\x03"``), ``resize()``
    changes its size, ``kill()`` ends it (its whole session), ``wait()`` waits for its end and
    returns its result (``exit_code``, ``state``; the output is not collected), and iterating
    yields its output as ``bytes`` as it is produced. With ``on_data`` (at ``create``), a
    thread hands every output chunk to it from the start instead (then the handle is not
    iterated; ``wait()`` waits for that thread). The output is read from the command's event
    stream with its cursor: a broken connection is resumed where it stopped, no byte lost."""

    _transport: BrokerTransport

    def __init__(
        self, transport: BrokerTransport, target: DataTarget, command_id: str, on_data: OnData
    ) -> None:
        super().__init__(transport, target, command_id)
        self._output = pf.PtyOutput(command_id)
        self.pid = command_id
        """E2B's name of the terminal's id (``pty.send_stdin(pid, ...)``): ``command_id``, a
        string here, not a process id."""
        self._reader = None if on_data is None else _Reader(self, on_data)

    def send_stdin(self, data: bytes | str) -> None:
        """Type ``data`` into the terminal (``str`` is sent as UTF-8; bytes as they are). One
        request per call; never retried (the keys would be typed twice)."""
        self._transport.call(pf.send_stdin(self._target, self.command_id, data))

    def resize(self, cols: int, rows: int) -> None:
        """Set the terminal's size in character cells (its programs get ``SIGWINCH``)."""
        self._transport.call(pf.resize(self._target, self.command_id, cols, rows))

    def kill(self) -> ExecutionResult:
        """Kill the terminal's processes (its whole session); its final result. Safe to
        repeat."""
        return self._transport.call(ops.kill(self._target, self.command_id))

    def status(self) -> CommandInfo:
        """The command as the runtime reports it now (``pty``: its size)."""
        return self._transport.call(pf.status(self._target, self.command_id))

    def wait(self, timeout: float | None = None, *, on_data: OnData = None) -> ExecutionResult:
        """Wait until the terminal's program ends; its result (``exit_code``, ``state``).
        ``on_data`` gets the output read meanwhile (not with the ``on_data`` of ``create``,
        whose thread reads it already). ``timeout`` passing raises
        :class:`CommandWaitTimeoutError`; the terminal goes on."""
        if self._reader is not None:
            if on_data is not None:
                raise pf.other_on_data()
            return self._reader.join(self, timeout)
        result: ExecutionResult = _PtyPerformer(self._transport, on_data).drive(
            self._follow(timeout)
        )
        return result

    def close(self) -> None:
        """Stop reading the terminal's output (the ``on_data`` thread ends within 2 s); the
        terminal goes on (``kill()`` ends it; ``pty.connect(command_id)`` reattaches)."""
        if self._reader is not None:
            self._reader.stop.set()

    def __iter__(self) -> Iterator[bytes]:
        if self._reader is not None:
            raise pf.not_iterable()
        performer = _PtyPerformer(self._transport, None)
        try:
            for step in iterate(self._follow(None), performer, Emit):
                if isinstance(step.event, pf.PtyEvent):
                    yield step.event.raw
        finally:
            performer.close()


class Pty(SandboxPart[BrokerTransport]):
    """Opens terminals in one sandbox. Returned by ``Sandbox.pty``."""

    def __init__(self, transport: BrokerTransport, target: DataTarget) -> None:
        super().__init__(transport, target)
        self._features = RuntimeFeatures()

    def create(
        self,
        cols: int | None = None,
        rows: int | None = None,
        *,
        size: Any = None,
        command: str | Sequence[str] | None = None,
        cwd: str | None = None,
        envs: dict[str, str] | None = None,
        on_data: OnData = None,
        timeout: float | None = None,
    ) -> PtyHandle:
        """Open a terminal of ``cols`` x ``rows`` running ``command`` (a string runs through
        bash, a list is an argv; default: the sandbox's login shell) in ``cwd`` with ``envs``
        (``TERM=xterm-256color`` unless they set it); its handle. ``on_data`` gets its output
        (bytes) as it arrives, from a thread; without it, iterate the handle. ``timeout``
        (seconds): the runtime kills it then; ``None``: no time limit. A runtime without
        terminals is :class:`UnsupportedByRuntimeError` (nothing runs)."""
        plan = pf.plan_pty(cols, rows, command, cwd, envs, timeout, on_data, size=size)
        command_id: str = self._transport.run(pf.start(self._target, plan, self._features))
        return PtyHandle(self._transport, self._target, command_id, on_data)

    def connect(self, command_id: str, *, on_data: OnData = None) -> PtyHandle:
        """Reattach to a terminal of this sandbox (started here or by another process of the
        same caller); reading it replays the retained output."""
        info = self._transport.call(pf.status(self._target, command_id))
        if info.pty is None:
            raise pf.not_a_terminal(self._target, command_id)
        return PtyHandle(self._transport, self._target, command_id, on_data)

    # E2B's spellings by id (``pid`` there: the handle's ``command_id`` here, a string)

    def send_stdin(self, command_id: str, data: bytes | str) -> None:
        """E2B's ``pty.send_stdin(pid, data)``: ``PtyHandle.send_stdin`` of the terminal
        ``command_id`` (its handle's ``command_id``, also ``.pid``)."""
        self._transport.call(pf.send_stdin(self._target, command_id, data))

    def resize(
        self, command_id: str, size: Any = None, *, cols: int | None = None, rows: int | None = None
    ) -> None:
        """E2B's ``pty.resize(pid, size)``: ``PtyHandle.resize`` of the terminal
        ``command_id``; ``size`` with ``cols`` and ``rows`` (E2B's ``PtySize``), or them."""
        cols, rows = pf.sized(cols, rows, size)
        self._transport.call(pf.resize(self._target, command_id, cols, rows))

    def kill(self, command_id: str) -> ExecutionResult:
        """E2B's ``pty.kill(pid)``: ``PtyHandle.kill`` of the terminal ``command_id``; its
        final result (E2B answers a bool). Safe to repeat."""
        result: ExecutionResult = self._transport.call(ops.kill(self._target, command_id))
        return result
