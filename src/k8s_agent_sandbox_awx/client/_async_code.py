"""``AsyncSandbox.run_code`` and the code contexts: the async counterpart of ``_code`` (the same
operations of ``_code_flow``, performed with the async transport; callbacks may be coroutine
functions)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ._async_commands import _AsyncPerformer
from ._base import SandboxPart
from .core import _code_flow as kf
from .core._steps import Emit, Step
from .http._async_transport import AsyncBrokerTransport
from .wire._code import CodeContext, Execution, ExecutionError, OutputMessage, Result
from .wire._dataplane import DataTarget

__all__ = ["AsyncCode", "AsyncRunsCode"]

OnOutput = Callable[[OutputMessage], Any | Awaitable[Any]] | None
OnResult = Callable[[Result], Any | Awaitable[Any]] | None
OnError = Callable[[ExecutionError], Any | Awaitable[Any]] | None


class _AsyncCodePerformer(_AsyncPerformer):
    """Performs ``run_code``'s steps: each event goes to its callback as it arrives (a
    coroutine's result is awaited)."""

    def __init__(
        self,
        transport: AsyncBrokerTransport,
        callbacks: Mapping[str, Callable[[Any], Any] | None],
    ) -> None:
        super().__init__(transport, None, None)
        self._code_callbacks = callbacks

    async def __call__(self, step: Step) -> Any:
        if isinstance(step, Emit):
            callback = kf.callback_for(step.event, self._code_callbacks)
            returned = None if callback is None else callback(step.event.value)
            return await returned if inspect.isawaitable(returned) else returned
        return await super().__call__(step)


class AsyncCode(SandboxPart[AsyncBrokerTransport]):
    """Runs code in one sandbox (``AsyncSandbox.run_code`` and the code contexts)."""

    def __init__(self, transport: AsyncBrokerTransport, target: DataTarget) -> None:
        super().__init__(transport, target)
        self._features = kf.CodeFeatures()

    async def run(self, code: str, **options: Any) -> Execution:
        callbacks = {name: options.pop(name) for name in _CALLBACKS}
        plan = kf.plan_run_code(code, callbacks=callbacks, **options)
        execution: Execution = await _AsyncCodePerformer(self._transport, plan.callbacks).drive(
            kf.run(self._target, plan, self._features)
        )
        return execution

    async def create_context(self, **options: Any) -> CodeContext:
        return await self._transport.call(kf.create_context(self._target, **options))

    async def list_contexts(self) -> list[CodeContext]:
        return await self._transport.call(kf.list_contexts(self._target))

    async def restart_context(self, context: CodeContext | str) -> CodeContext:
        return await self._transport.call(kf.restart_context(self._target, context))

    async def remove_context(self, context: CodeContext | str) -> None:
        await self._transport.call(kf.remove_context(self._target, context))


_CALLBACKS = ("on_stdout", "on_stderr", "on_result", "on_error")


class AsyncRunsCode:
    """``AsyncSandbox``'s code interpreter methods (see ``_code.RunsCode``)."""

    _code: AsyncCode
    _check_active: Callable[[], None]
    """The sandbox's own (it raises once the sandbox was killed or its handle closed)."""

    async def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        context: CodeContext | str | None = None,
        on_stdout: OnOutput = None,
        on_stderr: OnOutput = None,
        on_result: OnResult = None,
        on_error: OnError = None,
        envs: dict[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the execution's time limit (E2B's)
    ) -> Execution:
        """Run ``code`` in the sandbox and return its :class:`Execution` (see
        ``Sandbox.run_code``); the callbacks may be coroutine functions. A cancelled call
        interrupts the execution."""
        self._check_active()
        return await self._code.run(
            code,
            language=language,
            context=context,
            timeout=timeout,
            envs=envs,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_result=on_result,
            on_error=on_error,
        )

    async def create_code_context(
        self,
        cwd: str | None = None,
        language: str = "python",
        envs: dict[str, str] | None = None,
    ) -> CodeContext:
        """A new code context (see ``Sandbox.create_code_context``)."""
        self._check_active()
        return await self._code.create_context(cwd=cwd, language=language, envs=envs)

    async def list_code_contexts(self) -> list[CodeContext]:
        """The sandbox's code contexts, the default one first."""
        self._check_active()
        return await self._code.list_contexts()

    async def restart_code_context(self, context: CodeContext | str) -> CodeContext:
        """Restart ``context`` (its state is lost; see ``Sandbox.restart_code_context``)."""
        self._check_active()
        return await self._code.restart_context(context)

    async def remove_code_context(self, context: CodeContext | str) -> None:
        """Remove ``context``; removing the default context restarts it."""
        self._check_active()
        await self._code.remove_context(context)
