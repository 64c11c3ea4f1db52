"""``AsyncSandbox.pty``: the async counterpart of ``_pty`` (the same operations of
``_pty_flow``, performed with the async transport; ``on_data`` may be a coroutine function)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from .. import errors
from .._driver import aiterate
from .._upstream import ExecutionResult
from ._async_commands import _AsyncPerformer
from ._base import SandboxPart
from ._deleted import ends_quietly
from .core import _command_ops as ops
from .core import _pty_flow as pf
from .core._command_handle import HandleBase
from .core._command_start import RuntimeFeatures
from .core._steps import Emit, Step
from .http._async_transport import AsyncBrokerTransport
from .wire._commands_wire import CommandInfo
from .wire._dataplane import DataTarget

__all__ = ["AsyncPty", "AsyncPtyHandle"]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")

OnData = Callable[[bytes], Any] | None


class _AsyncPtyPerformer(_AsyncPerformer):
    """Performs a terminal's steps: its output events go to ``on_data`` as bytes."""

    def __init__(self, transport: AsyncBrokerTransport, on_data: OnData) -> None:
        super().__init__(transport, None, None)
        self._on_data = on_data

    async def __call__(self, step: Step) -> Any:
        if isinstance(step, Emit):
            event = step.event
            if self._on_data is None or not isinstance(event, pf.PtyEvent):
                return None
            returned = self._on_data(event.raw)
            return await returned if inspect.isawaitable(returned) else returned
        return await super().__call__(step)


class AsyncPtyHandle(HandleBase):
    """A terminal of an :class:`AsyncSandbox` (see ``PtyHandle``): ``await send_stdin()``,
    ``await resize()``, ``await kill()``, ``await wait()``, ``async for`` over its output
    bytes; with ``on_data`` (at ``create``) a task hands it every output chunk from the
    start."""

    _transport: AsyncBrokerTransport

    def __init__(
        self, transport: AsyncBrokerTransport, target: DataTarget, command_id: str, on_data: OnData
    ) -> None:
        super().__init__(transport, target, command_id)
        self._output = pf.PtyOutput(command_id)
        self.pid = command_id
        """E2B's name of the terminal's id (``pty.send_stdin(pid, ...)``): ``command_id``, a
        string here, not a process id."""
        self._reader: asyncio.Task[ExecutionResult] | None = None
        if on_data is not None:
            performer = _AsyncPtyPerformer(transport, on_data)
            self._reader = asyncio.get_running_loop().create_task(
                performer.drive(self._follow(None)), name=f"pty-{command_id}"
            )
            self._reader.add_done_callback(self._read_ended)

    def _read_ended(self, task: asyncio.Task[ExecutionResult]) -> None:
        if task.cancelled():
            return
        exc = task.exception()  # retrieved: raised by wait()
        quiet = exc is not None and ends_quietly(self._target, exc)  # deleted by this process
        if exc is not None and not self._transport.is_closed and not quiet:  # closed: ends
            logger.warning(
                "the output of terminal %s is no longer read: %s: %s (wait() raises it)",
                self.command_id,
                type(exc).__name__,
                exc,
            )

    async def send_stdin(self, data: bytes | str) -> None:
        """Type ``data`` into the terminal (see ``PtyHandle.send_stdin``). Never retried."""
        await self._transport.call(pf.send_stdin(self._target, self.command_id, data))

    async def resize(self, cols: int, rows: int) -> None:
        """Set the terminal's size in character cells (its programs get ``SIGWINCH``)."""
        await self._transport.call(pf.resize(self._target, self.command_id, cols, rows))

    async def kill(self) -> ExecutionResult:
        """Kill the terminal's processes (its whole session); its final result."""
        return await self._transport.call(ops.kill(self._target, self.command_id))

    async def status(self) -> CommandInfo:
        return await self._transport.call(pf.status(self._target, self.command_id))

    async def wait(
        self,
        timeout: float | None = None,  # noqa: ASYNC109
        *,
        on_data: OnData = None,
    ) -> ExecutionResult:
        """Wait until the terminal's program ends (see ``PtyHandle.wait``); a timeout raises
        :class:`CommandWaitTimeoutError` and leaves the terminal running (and its ``on_data``
        task reading); so does a cancelled wait."""
        if self._reader is None:
            performer = _AsyncPtyPerformer(self._transport, on_data)
            result: ExecutionResult = await performer.drive(self._follow(timeout))
            return result
        if on_data is not None:
            raise pf.other_on_data()
        try:
            return await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        except TimeoutError:
            raise errors.CommandWaitTimeoutError(
                f"Terminal {self.command_id!r} is still running after {timeout:g}s (the wait "
                "timed out); it goes on. Call wait() again, or kill() to stop it.",
                command_id=self.command_id,
                timeout=timeout if timeout is not None else 0.0,
            ) from None

    async def close(self) -> None:
        """Stop reading the terminal's output (its ``on_data`` task is cancelled); the
        terminal goes on (``kill()`` ends it; ``pty.connect(command_id)`` reattaches)."""
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._reader is not None:
            raise pf.not_iterable()
        performer = _AsyncPtyPerformer(self._transport, None)
        try:
            steps = aiterate(self._follow(None), performer, Emit)
            async with contextlib.aclosing(steps):
                async for step in steps:
                    if isinstance(step.event, pf.PtyEvent):
                        yield step.event.raw
        finally:
            await performer.close()


class AsyncPty(SandboxPart[AsyncBrokerTransport]):
    """Opens terminals in one sandbox. Returned by ``AsyncSandbox.pty``."""

    def __init__(self, transport: AsyncBrokerTransport, target: DataTarget) -> None:
        super().__init__(transport, target)
        self._features = RuntimeFeatures()

    async def create(
        self,
        cols: int | None = None,
        rows: int | None = None,
        *,
        size: Any = None,
        command: str | Sequence[str] | None = None,
        cwd: str | None = None,
        envs: dict[str, str] | None = None,
        on_data: OnData = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> AsyncPtyHandle:
        """Async ``Sandbox.pty.create`` (the same rules and errors); ``on_data`` runs in a task
        of the running loop and may be a coroutine function."""
        plan = pf.plan_pty(cols, rows, command, cwd, envs, timeout, on_data, size=size)
        command_id: str = await self._transport.run(pf.start(self._target, plan, self._features))
        return AsyncPtyHandle(self._transport, self._target, command_id, on_data)

    async def connect(self, command_id: str, *, on_data: OnData = None) -> AsyncPtyHandle:
        """Reattach to a terminal of this sandbox (see ``Pty.connect``)."""
        info = await self._transport.call(pf.status(self._target, command_id))
        if info.pty is None:
            raise pf.not_a_terminal(self._target, command_id)
        return AsyncPtyHandle(self._transport, self._target, command_id, on_data)

    # E2B's spellings by id (``pid`` there: the handle's ``command_id`` here, a string)

    async def send_stdin(self, command_id: str, data: bytes | str) -> None:
        """E2B's ``pty.send_stdin(pid, data)``: ``AsyncPtyHandle.send_stdin`` of the terminal
        ``command_id`` (its handle's ``command_id``, also ``.pid``)."""
        await self._transport.call(pf.send_stdin(self._target, command_id, data))

    async def resize(
        self, command_id: str, size: Any = None, *, cols: int | None = None, rows: int | None = None
    ) -> None:
        """E2B's ``pty.resize(pid, size)``: ``AsyncPtyHandle.resize`` of the terminal
        ``command_id``; ``size`` with ``cols`` and ``rows`` (E2B's ``PtySize``), or them."""
        cols, rows = pf.sized(cols, rows, size)
        await self._transport.call(pf.resize(self._target, command_id, cols, rows))

    async def kill(self, command_id: str) -> ExecutionResult:
        """E2B's ``pty.kill(pid)``: ``AsyncPtyHandle.kill`` of the terminal ``command_id``; its
        final result (E2B answers a bool). Safe to repeat."""
        result: ExecutionResult = await self._transport.call(ops.kill(self._target, command_id))
        return result
