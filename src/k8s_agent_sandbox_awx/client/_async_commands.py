"""``AsyncSandbox.commands``: the async counterpart of ``_commands`` (the same operations of
``_command_ops``, performed with the async transport; callbacks may be coroutine functions)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Literal, Unpack, overload

from .._driver import Stepper, aiterate
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
from .http._async_transport import AsyncBrokerTransport
from .http._exchange import Answered, only_call
from .wire._commands_wire import CommandInfo
from .wire._dataplane import DataTarget

__all__ = ["AsyncCommandHandle", "AsyncCommands"]

Callback = Callable[[str], Any] | None
logger = logging.getLogger("k8s_agent_sandbox_awx.client")

STOP_WAIT = 5.0
"""Seconds a kill waits for the task that follows a command's output to deliver the last of
it before the task is cancelled."""


class _AsyncPerformer:
    """Performs the steps of a command operation with the async transport."""

    def __init__(
        self,
        transport: AsyncBrokerTransport,
        on_stdout: Callback,
        on_stderr: Callback,
        record: Callable[[Learned], None] | None = None,
    ):
        self._transport = transport
        self._callbacks = on_stdout, on_stderr
        self._record = record
        """Keeps what the operation learns (``ops.foreground``'s :class:`Learned` steps)."""
        self._opening: OpenEvents | None = None
        """The stream asked for, sent at its first :class:`NextEvent`."""
        self._stream: AsyncGenerator[Any, None] | Answered | None = None

    async def __call__(self, step: Step) -> Any:
        match step:
            case NextEvent():
                stream = self._stream
                if stream is None:
                    stream = self._stream = await self._open()
                if type(stream) is Answered:  # read whole: no await per value
                    return stream.next()
                return await anext(stream, None)  # type: ignore[arg-type]
            case Emit(event):
                callback = output_callback(event, *self._callbacks)
                returned = None if callback is None else callback(event.data)
                return await returned if inspect.isawaitable(returned) else returned
            case OpenEvents():
                await self.close()
                self._opening = step
                return None
            case Learned() if self._record is not None:
                return self._record(step)
            case Sleep(seconds):
                return await asyncio.sleep(seconds)
            case _:
                return await self._transport.call(only_call(step))

    async def _open(self) -> AsyncGenerator[Any, None] | Answered:
        opening, self._opening = self._opening, None
        assert opening is not None
        return await self._transport.open_events(opening.spec, json_answer=opening.json_answer)

    async def close(self) -> None:
        stream, self._stream, self._opening = self._stream, None, None
        if stream is not None and type(stream) is not Answered:
            await stream.aclose()  # type: ignore[union-attr]

    async def drive(self, op: Op[Any]) -> Any:
        """Run ``op`` (what ``adrive(op, self)`` does): the steps that need no await (the next
        value of an answer read whole, what the operation learned, the stream asked for when
        none is open) are answered here, without a coroutine per step."""
        stepper = Stepper(op)
        try:
            while (step := stepper.advance()) is not None:
                try:
                    kind, stream = type(step), self._stream
                    if kind is NextEvent and type(stream) is Answered:
                        stepper.reply = stream.next()
                    elif kind is Learned and self._record is not None:
                        stepper.reply = self._record(step)  # type: ignore[arg-type]
                    elif kind is OpenEvents and (stream is None or type(stream) is Answered):
                        self._stream, self._opening = None, step  # type: ignore[assignment]
                        stepper.reply = None
                    else:
                        stepper.reply = await self(step)
                except BaseException as exc:  # thrown into the operation, which decides
                    stepper.error = exc
            return stepper.result
        finally:
            await self.close()


class _AsyncFollower:
    """The task that follows a background command's output to the callbacks given at its
    start (see ``_commands._Follower``): it ends with the command, or is cancelled (``kill``,
    ``close``, the sandbox's end)."""

    def __init__(
        self, handle: AsyncCommandHandle, on_stdout: Callback, on_stderr: Callback
    ) -> None:
        self.result: ExecutionResult | None = None
        self.error: BaseException | None = None
        performer = _AsyncPerformer(handle._transport, on_stdout, on_stderr)
        self.task = asyncio.get_running_loop().create_task(
            self._follow(performer, handle), name=f"agent-sandbox-output-{handle.command_id}"
        )

    async def _follow(self, performer: _AsyncPerformer, handle: AsyncCommandHandle) -> None:
        try:
            self.result = await performer.drive(handle._follow(None))
        except asyncio.CancelledError:
            pass  # stopped: nothing to report
        except Exception as exc:  # kept for wait(), which raises it
            self.error = exc
            if ends_quietly(handle._target, exc):  # this process deleted its sandbox
                return
            logger.warning(
                "stopped following the output of command %s: %s (wait() raises it)",
                handle.command_id,
                type(exc).__name__,
            )

    async def join(self, timeout: float | None) -> bool:  # noqa: ASYNC109
        """Wait up to ``timeout`` seconds for the task to end (a cancelled wait leaves it
        running); whether it ended."""
        done, _ = await asyncio.wait({self.task}, timeout=timeout)
        return bool(done)

    async def cancel(self) -> None:
        """Cancel the task and wait until it ended."""
        self.task.cancel()
        await asyncio.wait({self.task})


class AsyncCommandHandle(HandleBase):
    """A background command of an :class:`AsyncSandbox` (see ``CommandHandle``): ``await
    wait()``, ``await kill()``, ``await status()``, ``await send_stdin()``, ``await close()``
    and ``async for`` over its output events. Started with ``on_stdout``/``on_stderr``, a task
    delivers its output to them while it runs."""

    _transport: AsyncBrokerTransport
    _follower: _AsyncFollower | None = None

    def _deliver(self, on_stdout: Callback, on_stderr: Callback) -> None:
        """Follow the output to the callbacks in a task of this handle, from now on."""
        self._follower = _AsyncFollower(self, on_stdout, on_stderr)

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
        follower = self._follower
        if follower is None:
            performer = _AsyncPerformer(self._transport, on_stdout, on_stderr)
            result: ExecutionResult = await performer.drive(self._follow(timeout))
            return result
        if on_stdout is not None or on_stderr is not None:
            raise followed_elsewhere(self.command_id, "wait(on_stdout=..., on_stderr=...)")
        if not await follower.join(None if timeout is None else wait_seconds(timeout)):
            raise wait_timed_out(self.command_id, timeout)
        if follower.error is not None or follower.result is None:
            self._follower = None  # raised once; a later wait follows the output itself
            if follower.error is not None:
                raise follower.error
            return await self.wait()
        return follower.result

    async def kill(self) -> ExecutionResult:
        """Kill the command's process group; its final result. Safe to repeat. The callbacks
        given at its start get its last output first (for up to 5 s)."""
        result = await self._transport.call(ops.kill(self._target, self.command_id))
        follower = self._follower
        if follower is not None and not await follower.join(STOP_WAIT):
            await follower.cancel()
        return result

    async def close(self) -> None:
        """Stop delivering the output to the callbacks given at its start (the command goes
        on). Nothing to do for a handle without them."""
        follower, self._follower = self._follower, None
        if follower is not None:
            await follower.cancel()

    async def status(self) -> CommandInfo:
        return await self._transport.call(ops.status(self._target, self.command_id))

    async def send_stdin(self, data: str | bytes, *, eof: bool = False) -> None:
        """Write ``data`` to the command's stdin (``eof=True`` closes it). Never retried."""
        await self._transport.call(ops.send_stdin(self._target, self.command_id, data, eof))

    async def __aiter__(self) -> AsyncIterator[CommandEvent]:
        if self._follower is not None:
            raise followed_elsewhere(self.command_id, "Iterating the handle")
        performer = _AsyncPerformer(self._transport, None, None)
        try:
            steps = aiterate(self._follow(None), performer, Emit)
            async with contextlib.aclosing(steps):
                async for step in steps:
                    yield step.event
        finally:
            await performer.close()


class AsyncCommands(SandboxPart[AsyncBrokerTransport]):
    """Runs commands in one sandbox. Returned by ``AsyncSandbox.commands``."""

    def __init__(self, transport: AsyncBrokerTransport, target: DataTarget) -> None:
        super().__init__(transport, target)
        self._features = RuntimeFeatures()
        self._delivering: weakref.WeakSet[AsyncCommandHandle] = weakref.WeakSet()
        """Handles whose output a task delivers to callbacks (stopped with the sandbox)."""

    @overload
    async def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,  # noqa: ASYNC109
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
        timeout: float | None = 60,  # noqa: ASYNC109
        *,
        background: bool,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | AsyncCommandHandle: ...

    async def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,  # noqa: ASYNC109
        *,
        background: bool = False,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | AsyncCommandHandle:
        """Async ``Sandbox.commands.run`` (the same rules, results and errors). Cancelling the
        task of a foreground run kills the command; callbacks may be coroutine functions."""
        plan = plan_run(command, timeout, background, options)
        if plan.background:
            start = ops.start(self._target, plan.start, self._features)
            command_id: str = await self._transport.run(start)
            return self._handle(command_id, plan.on_stdout, plan.on_stderr)
        features = self._features
        performer = _AsyncPerformer(
            self._transport, plan.on_stdout, plan.on_stderr, features.record
        )
        op = ops.foreground(self._target, plan.start, features, plan.raise_on_timeout, plan.live)
        result: ExecutionResult = await performer.drive(op)
        return result

    def _handle(
        self, command_id: str, on_stdout: Callback, on_stderr: Callback
    ) -> AsyncCommandHandle:
        handle = AsyncCommandHandle(self._transport, self._target, command_id)
        if on_stdout is not None or on_stderr is not None:
            handle._deliver(on_stdout, on_stderr)
            self._delivering.add(handle)
        return handle

    async def get(self, command_id: str) -> AsyncCommandHandle:
        """Reattach to a command of this sandbox (see ``Commands.get``)."""
        await self._transport.call(ops.status(self._target, command_id))
        return AsyncCommandHandle(self._transport, self._target, command_id)

    async def connect(
        self, command_id: str, *, on_stdout: Callback = None, on_stderr: Callback = None
    ) -> AsyncCommandHandle:
        """E2B's name for :meth:`get` (see ``Commands.connect``): with callbacks, a task
        delivers the command's output to them while it runs."""
        check_callbacks(on_stdout, on_stderr)
        await self._transport.call(ops.status(self._target, command_id))
        return self._handle(command_id, on_stdout, on_stderr)

    async def kill(self, command_id: str) -> ExecutionResult:
        """Kill command ``command_id`` (see ``Commands.kill``): its final result."""
        return await self._transport.call(ops.kill(self._target, command_id))

    async def send_stdin(self, command_id: str, data: str | bytes, *, eof: bool = False) -> None:
        """Write ``data`` to command ``command_id``'s stdin (see ``Commands.send_stdin``)."""
        await self._transport.call(ops.send_stdin(self._target, command_id, data, eof))

    def _halt_output(self) -> list[_AsyncFollower]:
        """Cancel every task that delivers a command's output to callbacks (the sandbox is
        being killed, or its connection closed), without waiting."""
        handles = list(self._delivering)
        self._delivering.clear()
        followers = [h._follower for h in handles if h._follower is not None]
        for follower in followers:
            follower.task.cancel()
        return followers

    @staticmethod
    async def _join_output(followers: list[_AsyncFollower]) -> None:
        """Wait up to :data:`STOP_WAIT` for the cancelled ``followers`` to end."""
        if followers:
            await asyncio.wait({f.task for f in followers}, timeout=STOP_WAIT)

    async def _stop_output(self) -> None:
        await self._join_output(self._halt_output())

    async def list(self) -> list[CommandInfo]:
        """The sandbox's commands, running and retained (oldest first)."""
        return await self._transport.call(ops.list_commands(self._target))
