"""``run_code`` and the code contexts, written once for the sync and the async API (no I/O).

``sandbox.run_code(code)`` speaks the runtime's ``/code`` API (``docs/broker-api.md#code``):
a streamed start (``POST /code/execute``: the execution's id, then its events), then the
execution's event stream from its cursor, re-requested every 20 s or when it drops (the loop
is ``_command_output.follow``'s), until its ``end`` event. What it decides is here: the checks
before anything is sent, the start's body, the reading of the events into an
:class:`~..wire._code.Execution` (:class:`ExecutionOutput`), what an output callback gets
(:class:`CodeEvent`), and when an execution is interrupted (the wait failed or was cancelled:
``POST /code/executions/{id}/interrupt``; a start whose answer was lost: found by its
``request_id`` first). A runtime without ``/code`` (``404`` as upstream's python runtime and
older runtimes answer it) is :class:`~...errors.UnsupportedByRuntimeError` naming
``run_code``, remembered for the sandbox (:class:`CodeFeatures`): nothing runs.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ... import errors
from ..wire import _code as wire
from ..wire import _commands_wire as cw
from ..wire import _dataplane as dp
from ..wire import _protocol as proto
from ._command_output import follow, next_event
from ._command_rules import check_cwd, check_envs, check_text
from ._command_start import sent_without_answer
from ._steps import NEXT_EVENT, Call, Learned, Op, OpenEvents, discard_answer, learning

__all__ = [
    "DEFAULT_TIMEOUT",
    "CodeEvent",
    "CodeFeatures",
    "CodePlan",
    "ExecutionOutput",
    "plan_run_code",
    "run",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")

DEFAULT_TIMEOUT = 300.0
"""The runtime's time limit of an execution when ``run_code`` names none (E2B's too; a runtime
whose cap, ``SANDBOX_EXEC_TIMEOUT_SECONDS``, is lower uses its cap)."""
WAIT_MARGIN = 30.0
"""Seconds ``run_code`` waits for the end beyond the time limit: the runtime interrupts the
execution at its limit itself, and restarts its context if that does not end it (its grace
time, 3 s by default), then says so in the result."""


@dataclass(frozen=True)
class CodeEvent:
    """One event of a running execution for its callbacks: ``type`` ``stdout`` or ``stderr``
    (``value``: an :class:`~..wire._code.OutputMessage`), ``result`` (a ``Result``), ``error``
    (an ``ExecutionError``) or ``end``."""

    type: str
    value: Any = None


@dataclass
class CodeFeatures:
    """Whether one sandbox's runtime has ``/code`` (``None``: not known yet), kept by its
    ``Code`` part from what the operations learn."""

    present: bool | None = None

    def record(self, learned: Learned) -> None:
        if learned.feature == wire.RUN_CODE:
            self.present = learned.present


# --------------------------------------------------------------------------------------------
# Before anything is sent


@dataclass(frozen=True)
class CodePlan:
    """``run_code``'s arguments, checked: the start's body and the callbacks."""

    code: str
    language: str
    context_id: str | None
    timeout: float | None
    """Seconds; ``None``: the runtime's default (:data:`DEFAULT_TIMEOUT`); ``math.inf``: none."""
    envs: dict[str, str] | None
    callbacks: Mapping[str, Callable[[Any], Any] | None] = field(default_factory=dict)
    request_id: str = field(default_factory=proto.new_idempotency_key)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "language": self.language}
        body["request_id"] = self.request_id
        if self.context_id is not None:
            body["context_id"] = self.context_id
        if self.timeout is not None:
            body["timeout"] = cw.NO_TIME_LIMIT if math.isinf(self.timeout) else self.timeout
        if self.envs:
            body["envs"] = self.envs
        return body

    @property
    def wait_seconds(self) -> float | None:
        """How long the result is waited for (``None``: as long as it runs)."""
        limit = DEFAULT_TIMEOUT if self.timeout is None else self.timeout
        return None if math.isinf(limit) else limit + WAIT_MARGIN


def context_id_of(context: wire.CodeContext | str | None, what: str = "context") -> str | None:
    """The id of ``context`` (a :class:`CodeContext`, its id, or ``None``: the default one)."""
    if context is None or isinstance(context, wire.CodeContext):
        return None if context is None else context.id
    if not isinstance(context, str) or not context.strip():
        raise TypeError(
            f"{what} must be a CodeContext (from create_code_context) or its id, got {context!r}."
        )
    return context


def plan_run_code(
    code: Any,
    *,
    language: Any,
    context: Any,
    timeout: Any,
    envs: Any,
    callbacks: Mapping[str, Any],
) -> CodePlan:
    """Check ``run_code``'s arguments before anything is sent."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str (the code to run), got {type(code).__name__}.")
    check_text("The code", code)
    if not isinstance(language, str) or not language:
        raise TypeError(f"language must be a language's name such as 'python', got {language!r}.")
    if isinstance(context, wire.CodeContext) and context.language != language:
        raise ValueError(
            f"run_code(language={language!r}, context=...) names a {context.language} "
            "context; give the context or the language, not both."
        )
    for name, callback in callbacks.items():
        if callback is not None and not callable(callback):
            raise TypeError(f"{name} must be callable, got {type(callback).__name__}.")
    return CodePlan(
        code,
        language,
        context_id_of(context),
        _timeout(timeout),
        check_envs(envs),
        dict(callbacks),
    )


def _timeout(timeout: Any) -> float | None:
    """``run_code``'s ``timeout``: ``None`` (the runtime's default), ``0`` (no time limit, as
    E2B's ``timeout=0``) or a number of seconds above 0."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}.")
    if timeout == 0:
        return math.inf
    return cw.check_command_timeout(float(timeout))


# --------------------------------------------------------------------------------------------
# The event stream


class ExecutionOutput:
    """The reader's side of one execution's event stream: the cursor, the contiguity check,
    and what it collects into its :class:`~..wire._code.Execution`."""

    def __init__(self, execution_id: str, context_id: str) -> None:
        self.execution_id = execution_id
        self.context_id = context_id
        self.cursor = 0
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.results: list[wire.Result] = []
        self.error: wire.ExecutionError | None = None
        self.exit: dict[str, Any] | None = None

    @property
    def command_id(self) -> str:
        return self.execution_id

    @property
    def ended(self) -> bool:
        return self.exit is not None

    def accept(self, value: Any) -> CodeEvent | None:
        """The event ``value`` is (``None`` for a heartbeat); a gap, a repeat or a malformed
        line is a :class:`BrokerProtocolError`."""
        what = f"follow execution {self.execution_id!r}"
        checked = next_event(value, self.cursor, _KINDS, what, _PROTOCOL)
        if checked is None:
            return None
        kind, seq = checked
        self.cursor = seq
        if kind in ("stdout", "stderr"):
            data = value.get("data")
            if not isinstance(data, str):
                raise proto.protocol_error(what, f"event {seq} has no text", _PROTOCOL)
            (self.stdout if kind == "stdout" else self.stderr).append(data)
            stamp = value.get("timestamp")
            message = wire.OutputMessage(
                data, stamp if isinstance(stamp, int) else 0, kind == "stderr"
            )
            return CodeEvent(kind, message)
        if kind == "result":
            result = wire.result_of(value)
            self.results.append(result)
            return CodeEvent(kind, result)
        if kind == "error":
            self.error = wire.error_of(value)
            return CodeEvent(kind, self.error)
        self.exit = value
        return CodeEvent("end")

    def lost(self, exc: errors.CommandOutputLostError) -> None:
        raise exc  # an execution's events are kept whole: nothing to go on from

    def result(self) -> wire.Execution:
        end = self.exit or {}
        count = end.get("execution_count")
        return wire.Execution(
            results=list(self.results),
            logs=wire.Logs(list(self.stdout), list(self.stderr)),
            error=self.error,
            execution_count=count if isinstance(count, int) else None,
            execution_id=self.execution_id,
            context_id=self.context_id,
            timed_out=end.get("timed_out") is True,
            restarted=end.get("restarted") is True,
            output_truncated=end.get("output_truncated") is True,
        )


_KINDS = ("stdout", "stderr", "result", "error", "end")
_PROTOCOL = "the runtime's code protocol"


def callback_for(event: CodeEvent, callbacks: Mapping[str, Callable[[Any], Any] | None]) -> Any:
    """The callback an event goes to (``None``: none, or the end)."""
    return callbacks.get(f"on_{event.type}")


# --------------------------------------------------------------------------------------------
# Operations


def run(
    target: dp.DataTarget,
    plan: CodePlan,
    features: CodeFeatures,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> Op[wire.Execution]:
    """``run_code`` (:func:`_run`); what its answers tell of the runtime is kept in
    ``features``."""
    return learning(_run(target, plan, features.present, clock), features.record)


def _run(
    target: dp.DataTarget, plan: CodePlan, present: bool | None, clock: Callable[[], float]
) -> Op[wire.Execution]:
    """Start, follow to the end (emitting each event), and interrupt the execution if the wait
    fails or is interrupted (Ctrl-C, a cancelled task, no end in time)."""
    if present is False:
        raise wire.unsupported(target, "run_code")
    execution_id, context_id = yield from _start(target, plan)
    output = ExecutionOutput(execution_id, context_id)
    wait = plan.wait_seconds
    events = functools.partial(wire.execution_events, target, execution_id)
    try:
        yield from follow(
            target,
            output,
            None if wait is None else clock() + wait,
            clock=clock,
            opened=True,
            events=events,
        )
    except GeneratorExit:
        raise
    except BaseException as exc:
        failed = yield from _interrupt_quietly(target, execution_id)
        if isinstance(exc, errors.CommandWaitTimeoutError):
            timed_out = _no_end(target, execution_id, plan)
            _note_uninterrupted(timed_out, target, execution_id, failed)
            raise timed_out from exc
        _note_uninterrupted(exc, target, execution_id, failed)
        raise
    return output.result()


def _start(target: dp.DataTarget, plan: CodePlan) -> Op[tuple[str, str]]:
    """``POST /code/execute`` (never retried), the streamed start: its first value names the
    execution, the rest of the stream is its events (left open for ``follow``). Its answer
    lost before the execution's id (interrupted, the connection broke or stalled), the
    execution is found by its request id and interrupted."""
    try:
        yield OpenEvents(wire.execute(target, plan.body()), json_answer=True)
        started = wire.parse_started((yield NEXT_EVENT))
    except errors.BrokerError as exc:
        if sent_without_answer(exc):
            yield from _interrupt_unanswered(target, plan, exc)
            raise
        if wire.lacks_code(exc):
            yield Learned(wire.RUN_CODE, False)
            raise wire.unsupported(target, "run_code") from None
        raise
    except BaseException as exc:
        if sent_without_answer(exc):
            yield from _interrupt_unanswered(target, plan, exc)
        raise
    yield Learned(wire.RUN_CODE, True)
    return started


def _interrupt_quietly(target: dp.DataTarget, execution_id: str) -> Op[Exception | None]:
    """Interrupt after a failed or interrupted wait; a failure is logged and returned (the
    wait's own error is what the caller sees, with a note). A sandbox that is gone or being
    deleted has nothing left to interrupt."""
    try:
        yield Call(wire.interrupt_execution(target, execution_id), discard_answer, cleanup=True)
    except Exception as exc:
        if isinstance(exc, errors.BrokerError) and (exc.status_code, exc.code) in _SANDBOX_GONE:
            return None
        logger.warning(
            "could not interrupt execution %s after a failed wait: %s", execution_id, exc
        )
        return exc
    return None


_SANDBOX_GONE = frozenset({(404, "not_found"), (409, "terminating")})


def _note_uninterrupted(
    exc: BaseException, target: dp.DataTarget, execution_id: str, failed: Exception | None
) -> None:
    if failed is None:
        return
    exc.add_note(
        f"Execution {execution_id!r} may still be running in sandbox {target.sandbox_id!r}: "
        f"the interrupt after the failed wait could not be delivered ({type(failed).__name__}). "
        "Its context refuses other code until it ends (its time limit stops it); "
        "restart_code_context() stops it at once."
    )


def _interrupt_unanswered(target: dp.DataTarget, plan: CodePlan, exc: BaseException) -> Op[None]:
    """A start was sent but the execution's id never arrived: find it by the start's
    ``request_id`` and interrupt it (one short attempt each); ``exc`` gets a note."""
    try:
        found = yield Call(
            wire.find_execution(target, plan.request_id),
            lambda reply: wire.parse_execution_ids(
                proto.parse_json(reply.content, "find an execution"), plan.request_id
            ),
            cleanup=True,
        )
        for execution_id, state in found:
            if state == "running":
                yield Call(
                    wire.interrupt_execution(target, execution_id), discard_answer, cleanup=True
                )
    except Exception as failed:
        logger.warning("could not find or interrupt the code of an interrupted start: %s", failed)
        exc.add_note(
            f"The code was sent but its execution id did not arrive, and it could not be looked "
            f"up or interrupted ({type(failed).__name__}): it may be running in sandbox "
            f"{target.sandbox_id!r} (request_id {plan.request_id!r})."
        )
        return
    done = ", ".join(f"{ident!r} ({'interrupted' if s == 'running' else s})" for ident, s in found)
    exc.add_note(
        "The code was sent but its execution id did not arrive; "
        + (f"its execution: {done}." if found else "no execution was started with its request id.")
    )


def _no_end(target: dp.DataTarget, execution_id: str, plan: CodePlan) -> errors.CodeTimeoutError:
    limit = DEFAULT_TIMEOUT if plan.timeout is None else plan.timeout
    return errors.CodeTimeoutError(
        f"Execution {execution_id!r} gave no end within its time limit of {limit:g}s plus "
        f"{WAIT_MARGIN:g}s in sandbox {target.sandbox_id!r} (the runtime interrupts it at its "
        "limit itself, so its answer did not come back); it was interrupted. Run it again; "
        "pass timeout= for longer code (0: no limit).",
        execution_id=execution_id,
        timeout=limit,
    )


# --------------------------------------------------------------------------------------------
# The contexts


def create_context(
    target: dp.DataTarget, *, cwd: Any, language: Any, envs: Any
) -> Call[wire.CodeContext]:
    """``POST /code/contexts``: a new context (its interpreter starts with its first run)."""
    if not isinstance(language, str) or not language:
        raise TypeError(f"language must be a language's name such as 'python', got {language!r}.")
    body: dict[str, Any] = {"language": language}
    checked_cwd = check_cwd(cwd)
    if checked_cwd is not None:
        body["cwd"] = checked_cwd
    checked_envs = check_envs(envs)
    if checked_envs:
        body["envs"] = checked_envs
    spec = wire.create_context(target, body)
    return Call(
        spec,
        lambda reply: wire.parse_context(proto.parse_json(reply.content, spec.what)),
        fail=wire.refusal(target, "create_code_context()"),
    )


def list_contexts(target: dp.DataTarget) -> Call[list[wire.CodeContext]]:
    spec = wire.list_contexts(target)
    return Call(
        spec,
        lambda reply: wire.parse_context_list(proto.parse_json(reply.content, spec.what)),
        fail=wire.refusal(target, "list_code_contexts()"),
    )


def restart_context(target: dp.DataTarget, context: Any) -> Call[wire.CodeContext]:
    """``POST /code/contexts/{id}/restart``: its interpreter killed, a new one at its next run."""
    spec = wire.context_action(target, _required_id(context), "restart")
    return Call(
        spec,
        lambda reply: wire.parse_context(proto.parse_json(reply.content, spec.what)),
        fail=wire.refusal(target, "restart_code_context()"),
    )


def remove_context(target: dp.DataTarget, context: Any) -> Call[None]:
    """``POST /code/contexts/{id}/remove`` (the default context is restarted: it always
    exists)."""
    spec = wire.context_action(target, _required_id(context), "remove")
    return Call(spec, discard_answer, fail=wire.refusal(target, "remove_code_context()"))


def _required_id(context: Any) -> str:
    ident = context_id_of(context)
    if ident is None:
        raise TypeError("context must be a CodeContext (from create_code_context) or its id.")
    return ident
