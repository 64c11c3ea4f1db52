"""Managed commands' operations, written once for the sync and the async API (no I/O).

``commands.run`` and a background command's handle speak the managed-command data plane
(``POST /commands``, the NDJSON event stream, kill, stdin: see
``docs/broker-api.md#managed-commands``). The operations are generators of the client's steps
(``_steps``: calls, the event stream's ``OpenEvents``/``NextEvent``, ``Emit`` per output event,
``Sleep`` before re-requesting a stream that failed), run by the one driver (``_driver``) in the
sync shell (``_commands``) and the async one (``_async_commands``). A foreground run's start
opens a stream itself (the streamed start); a dropped or stalled stream is raised, and thrown
back into the operation. What they decide before sending is in ``_command_rules``, the start in
``_command_start``, the event stream in ``_command_output``; here: the background start (and a
command without a time limit confirmed), the foreground run (and the legacy ``/execute``), the
kill after a failed wait, and the single calls (kill, status, list, stdin).
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Callable
from typing import Any

from ... import errors
from ..._upstream import ExecutionResult
from ..wire import _commands_wire as cw
from ..wire import _dataplane as dp
from ..wire import _protocol as proto
from ..wire import _stdin_wire as stdin_wire
from ._command_output import CommandOutput, follow
from ._command_rules import RUNTIME_CAP, StartPlan, check_text
from ._command_start import RuntimeFeatures, legacy_unsupported, send_start
from ._steps import Call, Op, discard_answer, learning

__all__ = [
    "foreground",
    "kill",
    "kill_quietly",
    "list_commands",
    "note_unkilled",
    "send_stdin",
    "start",
    "status",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")


def start(target: dp.DataTarget, plan: StartPlan, features: RuntimeFeatures) -> Op[str]:
    """``POST /commands`` of a background command (never retried); returns the command id. A
    runtime without the endpoint is :class:`UnsupportedByRuntimeError` (the 404 means the
    command did not start; known from an earlier answer: nothing is sent). What the answer
    tells of the runtime is kept in ``features``."""
    return learning(_start_background(target, plan, features.managed), features.record)


def _start_background(target: dp.DataTarget, plan: StartPlan, managed: bool | None) -> Op[str]:
    try:
        command_id = (
            None if managed is False else (yield from send_start(target, plan, stream=False))
        )
    except errors.BrokerError as exc:
        if not plan.limited and _refuses_no_limit(exc):
            raise _no_limit_unsupported(target, f"it refused it ({exc.detail})") from None
        raise
    if command_id is None:
        raise legacy_unsupported(target, plan.managed_only(True))
    if not plan.limited:
        yield from _confirm_no_limit(target, command_id)
    return command_id


def _confirm_no_limit(target: dp.DataTarget, command_id: str) -> Op[None]:
    """A command started without a time limit: its status must say so (``"timeout": null``),
    else the runtime gave it a limit of its own (one that ignores the value) and it is killed:
    never a silent 60 s. A status that fails kills it too (nobody holds it yet)."""
    try:
        info: cw.CommandInfo = yield status(target, command_id)
    except GeneratorExit:
        raise
    except BaseException as exc:
        failed = yield from kill_quietly(target, command_id)
        note_unkilled(exc, target, command_id, failed)
        raise
    if info.no_time_limit:
        return
    failed = yield from kill_quietly(target, command_id)
    why = "it was killed" if failed is None else "it could not be killed: see the note"
    unsupported = _no_limit_unsupported(target, f"it started the command with a limit; {why}")
    note_unkilled(unsupported, target, command_id, failed)
    raise unsupported


def _refuses_no_limit(exc: errors.BrokerError) -> bool:
    """The runtime's refusal of ``"timeout": "none"`` (a ``400``/``422`` of its own naming
    the field)."""
    detail = exc.detail or ""
    return exc.status_code in (400, 422) and exc.code is None and "timeout" in detail


def _no_limit_unsupported(target: dp.DataTarget, why: str) -> errors.UnsupportedByRuntimeError:
    return errors.UnsupportedByRuntimeError(
        f"commands.run(command, background=True, timeout=0) cannot start a command without a "
        f"time limit in sandbox {target.sandbox_id!r}: its runtime predates commands without "
        f'one ({why}); they need a runtime that takes "timeout": "none" in POST /commands (the '
        "local broker's runtime; see broker-api.md). Nothing runs. Pass a timeout= in seconds "
        f"(up to {RUNTIME_CAP}), run longer work in a "
        "terminal (sandbox.pty.create, no time limit), or recreate the sandbox from a template "
        "whose runtime is up to date.",
        options=("timeout",),
    )


def foreground(
    target: dp.DataTarget,
    plan: StartPlan,
    features: RuntimeFeatures,
    raise_on_timeout: bool = True,
    live: tuple[str, ...] = (),
    clock: Callable[[], float] = time.monotonic,
) -> Op[Any]:
    """A foreground ``commands.run`` (:func:`_run_foreground`). Its :class:`~._steps.Learned`
    steps are for the performer to hand to ``features.record`` (the commands shells do), not
    wrapped by ``learning``: one generator fewer between the driver and the operation at every
    step."""
    return _run_foreground(target, plan, features.managed, raise_on_timeout, live, clock)


def _run_foreground(
    target: dp.DataTarget,
    plan: StartPlan,
    managed: bool | None,
    raise_on_timeout: bool,
    live: tuple[str, ...],
    clock: Callable[[], float],
) -> Op[Any]:
    """A foreground ``commands.run``: start, follow to the exit (emitting the output), and kill
    the command if the wait fails or is interrupted (Ctrl-C, a cancelled task, no exit in
    time). On a legacy runtime (``POST /commands`` answered 404: the command did not start) a
    plain run falls back to ``/execute``; one with an option only the managed protocol honours
    (``live``: the names of the output callbacks given) is :class:`UnsupportedByRuntimeError`,
    and nothing runs. The start asks for the streamed start: its answer goes on with the
    command's events, read before any ``GET events``; without callbacks it may come whole at
    the exit (``Prefer: no-live-output``: one read of it)."""
    known_legacy = managed is False
    command_id = (
        None if known_legacy else (yield from send_start(target, plan, stream=True, whole=not live))
    )
    if command_id is None:
        managed_only = (*live, *plan.managed_only(False))
        if managed_only:
            raise legacy_unsupported(target, managed_only)
        return (yield from _run_legacy_execute(target, plan, raise_on_timeout))
    output = CommandOutput(command_id)
    deadline = clock() + plan.timeout + cw.COMMAND_TIMEOUT_MARGIN
    try:
        result: ExecutionResult = yield from follow(
            target, output, deadline, clock=clock, opened=True
        )
    except GeneratorExit:
        raise
    except BaseException as exc:
        failed = yield from kill_quietly(target, command_id)
        if isinstance(exc, errors.CommandWaitTimeoutError):
            timed_out = _no_exit_in_time(
                target, plan.timeout, output.result(), killed=failed is None
            )
            note_unkilled(timed_out, target, command_id, failed)
            raise timed_out from exc
        note_unkilled(exc, target, command_id, failed)
        raise
    return _raise_if_timed_out(result, plan.timeout, raise_on_timeout)


_SANDBOX_GONE = frozenset({(404, "not_found"), (409, "terminating")})
"""The broker's answers for a sandbox that is gone or being deleted: its commands end with it."""


def kill_quietly(target: dp.DataTarget, command_id: str) -> Op[Exception | None]:
    """Kill after a failed or interrupted wait; a kill that fails is logged and returned, not
    raised (the wait's own error is what the caller sees, with a note: ``note_unkilled``). A
    sandbox that is gone or being deleted has nothing left to kill: that is no failure."""
    try:
        yield Call(cw.kill_command(target, command_id), discard_answer, cleanup=True)
    except Exception as exc:  # the original error is re-raised by the caller
        if isinstance(exc, errors.BrokerError) and (exc.status_code, exc.code) in _SANDBOX_GONE:
            return None
        logger.warning("could not kill command %s after a failed wait: %s", command_id, exc)
        return exc
    return None


def note_unkilled(
    exc: BaseException, target: dp.DataTarget, command_id: str, failed: Exception | None
) -> None:
    """When the kill after a failed wait could not be delivered (``failed``: its error), the
    raised error says that the command may still run and how to stop it (the kill's error is
    named by its type only: its text is the broker's, never repeated)."""
    if failed is None:
        return
    exc.add_note(
        f"Command {command_id!r} may still be running in sandbox {target.sandbox_id!r}: the "
        f"kill after the failed wait could not be delivered ({type(failed).__name__}). Stop it "
        f'with sandbox.commands.get("{command_id}").kill() once the broker answers again '
        "(sandbox.commands.list() shows whether it still runs)."
    )


def _no_exit_in_time(
    target: dp.DataTarget, limit: float, partial: ExecutionResult, *, killed: bool = True
) -> errors.CommandTimeoutError:
    outcome = "it was killed" if killed else "it could not be killed (see the note)"
    return errors.CommandTimeoutError(
        f"Command {partial.command_id!r} gave no exit within its time limit of {limit:g}s plus "
        f"{cw.COMMAND_TIMEOUT_MARGIN:g}s in sandbox {target.sandbox_id!r}; {outcome}. Pass "
        f"a larger timeout= (up to {RUNTIME_CAP}); work that "
        "runs longer (a dev server) starts in the background without a time limit: "
        "commands.run(command, background=True, timeout=0), or goes in a terminal started "
        "without a timeout (sandbox.pty.create).",
        command_timeout=limit,
        result=partial,
    )


def _raise_if_timed_out(
    result: ExecutionResult, limit: float, raise_on_timeout: bool
) -> ExecutionResult:
    if result.timed_out and raise_on_timeout:
        raise errors.CommandTimeoutError(
            f"The command ran longer than its time limit of {limit:g}s and was killed "
            f"(exit code {result.exit_code}). Pass a larger timeout= to commands.run, or "
            "raise_on_timeout=False to get the partial output as a result.",
            command_timeout=limit,
            result=result,
        )
    return result


def _run_legacy_execute(target: dp.DataTarget, plan: StartPlan, raise_on_timeout: bool) -> Op[Any]:
    """The legacy ``POST /execute``: the argv quoted so that the runtime's shell-like split
    rebuilds it (a string keeps its shell)."""
    spec = cw.execute(target, shlex.join(plan.argv), command_timeout=plan.timeout)
    call = Call(spec, _execute_result, fail=_timeout_as_command_timeout(target, plan.timeout))
    result: ExecutionResult = yield call
    return _raise_if_timed_out(result, plan.timeout, raise_on_timeout)


def _execute_result(reply: proto.Reply) -> ExecutionResult:
    outcome = cw.parse_execution_result(proto.parse_json(reply.content, "run a command"))
    return outcome.model_copy(update={"state": "timed_out" if outcome.timed_out else "exited"})


def _timeout_as_command_timeout(
    target: dp.DataTarget, limit: float
) -> Callable[[Exception], Exception | None]:
    def fail(exc: Exception) -> Exception | None:
        if not isinstance(exc, errors.RequestTimeoutError):
            return None
        return errors.CommandTimeoutError(
            f"No answer for the command within its time limit of {limit:g}s plus "
            f"{cw.COMMAND_TIMEOUT_MARGIN:g}s; it may still be running in sandbox "
            f"{target.sandbox_id!r}. Pass a larger timeout= to commands.run.",
            command_timeout=limit,
        )

    return fail


def kill(target: dp.DataTarget, command_id: str) -> Call[ExecutionResult]:
    """``POST /commands/{id}/kill``: the final result (safe to repeat)."""
    return Call(cw.kill_command(target, command_id), _final_result)


def _final_result(reply: proto.Reply) -> ExecutionResult:
    info = cw.parse_command_info(proto.parse_json(reply.content, "kill a command"))
    return info.result()


def status(target: dp.DataTarget, command_id: str) -> Call[cw.CommandInfo]:
    spec = cw.command_status(target, command_id)
    return Call(
        spec, lambda reply: cw.parse_command_info(proto.parse_json(reply.content, spec.what))
    )


def list_commands(target: dp.DataTarget) -> Call[list[cw.CommandInfo]]:
    spec = cw.list_commands(target)
    return Call(
        spec, lambda reply: cw.parse_command_list(proto.parse_json(reply.content, spec.what))
    )


def send_stdin(target: dp.DataTarget, command_id: str, data: str | bytes, eof: bool) -> Call[None]:
    """``POST /commands/{id}/stdin`` (never retried; over the runtime's limit per request:
    :class:`~.errors.StdinTooLargeError`, before sending or from the refusal)."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"stdin data must be text or UTF-8 bytes ({exc}); decode it first."
            ) from exc
    if not isinstance(data, str):
        raise TypeError(f"stdin data must be str or bytes, got {type(data).__name__}.")
    check_text("The stdin data (send_stdin's data)", data)
    spec = stdin_wire.command_stdin(target, command_id, data, eof)  # refuses a body over the limit
    return Call(spec, discard_answer, fail=stdin_wire.stdin_refusal(spec))
