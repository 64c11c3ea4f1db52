"""``sandbox.run_code`` and the code contexts (E2B's code interpreter API). The decisions are in
``_code_flow``; this module performs its steps with the sync transport."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._base import SandboxPart
from ._commands import _Performer
from .core import _code_flow as kf
from .core._steps import Emit, Step
from .http._transport import BrokerTransport
from .wire._code import CodeContext, Execution, ExecutionError, OutputMessage, Result
from .wire._dataplane import DataTarget

__all__ = ["Code", "RunsCode"]

OnOutput = Callable[[OutputMessage], Any] | None
OnResult = Callable[[Result], Any] | None
OnError = Callable[[ExecutionError], Any] | None


class _CodePerformer(_Performer):
    """Performs ``run_code``'s steps: each event goes to its callback as it arrives."""

    def __init__(
        self, transport: BrokerTransport, callbacks: Mapping[str, Callable[[Any], Any] | None]
    ) -> None:
        super().__init__(transport, None, None)
        self._code_callbacks = callbacks

    def __call__(self, step: Step) -> Any:
        if isinstance(step, Emit):
            callback = kf.callback_for(step.event, self._code_callbacks)
            return None if callback is None else callback(step.event.value)
        return super().__call__(step)


class Code(SandboxPart[BrokerTransport]):
    """Runs code in one sandbox (``Sandbox.run_code`` and the code contexts)."""

    def __init__(self, transport: BrokerTransport, target: DataTarget) -> None:
        super().__init__(transport, target)
        self._features = kf.CodeFeatures()

    def run(self, code: str, **options: Any) -> Execution:
        callbacks = {name: options.pop(name) for name in _CALLBACKS}
        plan = kf.plan_run_code(code, callbacks=callbacks, **options)
        execution: Execution = _CodePerformer(self._transport, plan.callbacks).drive(
            kf.run(self._target, plan, self._features)
        )
        return execution

    def create_context(self, **options: Any) -> CodeContext:
        return self._transport.call(kf.create_context(self._target, **options))

    def list_contexts(self) -> list[CodeContext]:
        return self._transport.call(kf.list_contexts(self._target))

    def restart_context(self, context: CodeContext | str) -> CodeContext:
        return self._transport.call(kf.restart_context(self._target, context))

    def remove_context(self, context: CodeContext | str) -> None:
        self._transport.call(kf.remove_context(self._target, context))


_CALLBACKS = ("on_stdout", "on_stderr", "on_result", "on_error")


class RunsCode:
    """``Sandbox``'s code interpreter methods (E2B's names and meaning)."""

    _code: Code
    _check_active: Callable[[], None]
    """The sandbox's own (it raises once the sandbox was killed or its handle closed)."""

    def run_code(
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
        timeout: float | None = None,
    ) -> Execution:
        """Run ``code`` in the sandbox and return its :class:`Execution`: the value of its
        last expression is ``execution.text`` (and ``results``, with ``html``, ``png``, ...
        where the value offers them), what it printed ``logs.stdout``/``logs.stderr``, and an
        exception it raised ``execution.error`` (``name``, ``value``, ``traceback``): a
        result, not an exception of the SDK. State persists between calls in a context
        (``run_code("x = 41")``, then ``run_code("x + 1").text == "42"``): the default one,
        or ``context`` (from :meth:`create_code_context`, or its id). ``on_stdout`` /
        ``on_stderr`` get the output as it is printed (:class:`OutputMessage`: a ``str``),
        ``on_result`` each result, ``on_error`` the error. ``envs``: variables for this
        execution. ``timeout``: its time limit in seconds (``None``: the runtime's, 300 s;
        ``0``: none); past it the runtime interrupts it (``SIGINT``, the context keeps its
        state) and restarts its context if that does not stop it; ``execution.timed_out`` and
        ``execution.error`` say what happened. Interrupted (Ctrl-C) or failed, the wait
        interrupts the execution. A runtime without code contexts:
        :class:`~.errors.UnsupportedByRuntimeError`, nothing runs."""
        self._check_active()
        return self._code.run(
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

    def create_code_context(
        self,
        cwd: str | None = None,
        language: str = "python",
        envs: dict[str, str] | None = None,
    ) -> CodeContext:
        """A new code context: a state of its own (its own interpreter, started by its first
        ``run_code``), in ``cwd`` (default ``/app``), with ``envs`` over the sandbox's
        environment. At most 8 per sandbox on the local runtime, the default one included
        (:class:`~.errors.CodeContextLimitError`)."""
        self._check_active()
        return self._code.create_context(cwd=cwd, language=language, envs=envs)

    def list_code_contexts(self) -> list[CodeContext]:
        """The sandbox's code contexts, the default one first."""
        self._check_active()
        return self._code.list_contexts()

    def restart_code_context(self, context: CodeContext | str) -> CodeContext:
        """Restart ``context``: its interpreter is killed (what it ran ends), its state is
        lost, a new one starts with its next ``run_code``."""
        self._check_active()
        return self._code.restart_context(context)

    def remove_code_context(self, context: CodeContext | str) -> None:
        """Remove ``context`` (its interpreter is killed); removing the default context
        restarts it."""
        self._check_active()
        self._code.remove_context(context)
