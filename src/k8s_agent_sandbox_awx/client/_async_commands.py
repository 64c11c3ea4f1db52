"""``AsyncSandbox.commands``: the async counterpart of ``_commands`` (the same operations of
``_command_flow``, performed with the async transport; callbacks may be coroutine functions)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Literal, Unpack, overload

from .._driver import adrive, aiterate
from .._upstream import ExecutionResult
from ._base import SandboxPart
from .core import _command_flow as cf
from .core import _options as opts
from .core._steps import Op
from .http._async_transport import AsyncBrokerTransport
from .http._exchange import only_call
from .wire._dataplane import CommandInfo, DataTarget

__all__ = ["AsyncCommandHandle", "AsyncCommands"]

Callback = Callable[[str], Any] | None


class _AsyncPerformer:
    """Performs the steps of a command operation with the async transport."""

    def __init__(self, transport: AsyncBrokerTransport, on_stdout: Callback, on_stderr: Callback):
        self._transport = transport
        self._callbacks = on_stdout, on_stderr
        self._stream: AsyncGenerator[Any, None] | None = None

    async def __call__(self, step: cf.Step) -> Any:
        match step:
            case cf.NextEvent():
                assert self._stream is not None
                return await anext(self._stream, None)
            case cf.Emit(event):
                callback = cf.output_callback(event, *self._callbacks)
                returned = None if callback is None else callback(event.data)
                return await returned if inspect.isawaitable(returned) else returned
            case cf.OpenEvents(spec, json_answer):
                await self.close()
                self._stream = self._transport.events(spec, json_answer=json_answer)
                return None
            case cf.Sleep(seconds):
                return await asyncio.sleep(seconds)
            case _:
                return await self._transport.call(only_call(step))

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()

    async def drive(self, op: Op[Any]) -> Any:
        try:
            return await adrive(op, self)
        finally:
            await self.close()


class AsyncCommandHandle(cf.HandleBase):
    """A background command of an :class:`AsyncSandbox` (see ``CommandHandle``): ``await
    wait()``, ``await kill()``, ``await status()``, ``await send_stdin()`` and ``async for``
    over its output events."""

    _transport: AsyncBrokerTransport

    async def wait(
        self,
        timeout: float | None = None,  # noqa: ASYNC109
        *,
        on_stdout: Callback = None,
        on_stderr: Callback = None,
    ) -> ExecutionResult:
        """Wait until the command ends (see ``CommandHandle.wait``): a timeout raises
        :class:`CommandWaitTimeoutError` and leaves the command running; so does a cancelled
        wait."""
        performer = _AsyncPerformer(self._transport, on_stdout, on_stderr)
        result: ExecutionResult = await performer.drive(self._follow(timeout))
        return result

    async def kill(self) -> ExecutionResult:
        """Kill the command's process group; its final result. Safe to repeat."""
        return await self._transport.call(cf.kill(self._target, self.command_id))

    async def status(self) -> CommandInfo:
        return await self._transport.call(cf.status(self._target, self.command_id))

    async def send_stdin(self, data: str | bytes, *, eof: bool = False) -> None:
        """Write ``data`` to the command's stdin (``eof=True`` closes it). Never retried."""
        await self._transport.call(cf.send_stdin(self._target, self.command_id, data, eof))

    async def __aiter__(self) -> AsyncIterator[cf.CommandEvent]:
        performer = _AsyncPerformer(self._transport, None, None)
        try:
            steps = aiterate(self._follow(None), performer, cf.Emit)
            async with contextlib.aclosing(steps):
                async for step in steps:
                    yield step.event
        finally:
            await performer.close()


class AsyncCommands(SandboxPart[AsyncBrokerTransport]):
    """Runs commands in one sandbox. Returned by ``AsyncSandbox.commands``."""

    def __init__(self, transport: AsyncBrokerTransport, target: DataTarget) -> None:
        super().__init__(transport, target)
        self._features = cf.RuntimeFeatures()

    @overload
    async def run(
        self,
        command: str | Sequence[str],
        timeout: float = 60,  # noqa: ASYNC109
        *,
        background: Literal[True],
        **options: Unpack[opts.RunOptions],
    ) -> AsyncCommandHandle: ...

    @overload
    async def run(
        self,
        command: str | Sequence[str],
        timeout: float = 60,  # noqa: ASYNC109
        *,
        background: Literal[False] = False,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult: ...

    @overload
    async def run(
        self,
        command: str | Sequence[str],
        timeout: float = 60,  # noqa: ASYNC109
        *,
        background: bool,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | AsyncCommandHandle: ...

    async def run(
        self,
        command: str | Sequence[str],
        timeout: float = 60,  # noqa: ASYNC109
        *,
        background: bool = False,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | AsyncCommandHandle:
        """Async ``Sandbox.commands.run`` (the same rules, results and errors). Cancelling the
        task of a foreground run kills the command; callbacks may be coroutine functions."""
        plan = cf.plan_run(command, timeout, background, options)
        if plan.background:
            start = cf.start(self._target, plan.start, self._features)
            command_id: str = await self._transport.run(start)
            return AsyncCommandHandle(self._transport, self._target, command_id)
        performer = _AsyncPerformer(self._transport, plan.on_stdout, plan.on_stderr)
        op = cf.run(
            self._target,
            plan.start,
            self._features,
            raise_on_timeout=plan.raise_on_timeout,
            live=plan.live,
        )
        result: ExecutionResult = await performer.drive(op)
        return result

    async def get(self, command_id: str) -> AsyncCommandHandle:
        """Reattach to a command of this sandbox (see ``Commands.get``)."""
        await self._transport.call(cf.status(self._target, command_id))
        return AsyncCommandHandle(self._transport, self._target, command_id)

    async def list(self) -> list[CommandInfo]:
        """The sandbox's commands, running and retained (oldest first)."""
        return await self._transport.call(cf.list_commands(self._target))
