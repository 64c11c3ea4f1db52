"""Managed commands, written once for the sync and the async API (no I/O).

``commands.run`` and a background command's handle speak the managed-command data plane
(``POST /commands``, the NDJSON event stream, kill, stdin: see
``docs/broker-api.md#managed-commands``). Everything they decide is here: how a command becomes
an argv, the start body, the checks before anything is sent, the cursor and the contiguity of the
event stream (:class:`CommandOutput`), when to re-request the stream, and when a command is
killed. The operations are generators of the client's steps (``_steps``: calls, the event
stream's ``OpenEvents``/``NextEvent``, ``Emit`` per output event, ``Sleep`` before re-requesting
a stream that failed), run by the one driver (``_driver``) in the sync shell (``_commands``) and
the async one (``_async_commands``). A foreground run's start opens a stream itself (the
streamed start); a dropped or stalled stream is raised, and thrown back into the operation.
"""

from __future__ import annotations

import logging
import math
import posixpath
import shlex
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ... import errors
from ..._upstream import ExecutionResult
from ..wire import _dataplane as dp
from ..wire import _protocol as proto
from . import _options as opts
from ._steps import Call, Emit, Learned, NextEvent, Op, OpenEvents, Sleep, Step, learning

__all__ = [
    "SHELL",
    "CommandEvent",
    "CommandOutput",
    "Emit",
    "NextEvent",
    "OpenEvents",
    "RuntimeFeatures",
    "Sleep",
    "Step",
    "command_argv",
    "follow",
    "run",
    "start",
    "wait_timed_out",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")

SHELL_SCRIPT = 'command -v bash >/dev/null 2>&1 && exec bash -c -- "$1"; exec /bin/sh -c -- "$1"'
SHELL = ("/bin/sh", "-c", SHELL_SCRIPT, "sh")
"""How a string command runs (``shell=None`` or ``True``): ``SHELL + (command,)``. ``/bin/sh``
runs :data:`SHELL_SCRIPT`, which replaces itself with ``bash -c COMMAND`` (bash found on the
command's ``PATH``), or with ``/bin/sh -c COMMAND`` where there is no bash. One process decides,
so nothing is retried and the command never runs twice; the command is an argument of the
script (``$1``), never pasted into it, and after ``--``: never read as the shell's options."""
COLLECT_LIMIT = 16 * 1024 * 1024
"""Characters of output (stdout and stderr together) a result keeps; beyond it the output still
reaches the callbacks but the result's ``output_truncated`` is ``True``."""
MAX_STREAM_FAILURES = 5
"""Re-requests of an event stream in a row that fail without a new event before giving up."""


@dataclass(frozen=True)
class CommandEvent:
    """One event of a command's output: ``type`` is ``stdout``, ``stderr`` or ``exit``; ``data``
    the text (empty for ``exit``); ``seq`` its sequence number; ``exit_code`` and ``state`` are
    set on the ``exit`` event."""

    type: str
    data: str
    seq: int
    exit_code: int | None = None
    state: str | None = None


_NEXT = NextEvent()


MANAGED_COMMANDS = "managed_commands"
"""The feature ``POST /commands`` is (a :class:`~._steps.Learned` step names it)."""


@dataclass
class RuntimeFeatures:
    """What one sandbox's runtime was found to have or lack, kept by its ``commands``: the
    operations yield what they find out (:class:`~._steps.Learned`), and :meth:`record` keeps
    it (:func:`start` and :func:`run` hand it over)."""

    managed: bool | None = None
    """``False`` once ``POST /commands`` answered the legacy runtime's 404 (no code, its
    ``{"detail": "Not Found"}``); ``True`` once it started a command."""

    def record(self, learned: Learned) -> None:
        if learned.feature == MANAGED_COMMANDS:
            self.managed = learned.present


# --------------------------------------------------------------------------------------------
# Before anything is sent


def command_argv(command: str | Sequence[str], shell: bool | None) -> list[str]:
    """The argv a command runs as: a string through bash (:data:`SHELL`: ``bash -c``, or
    ``/bin/sh -c`` where the sandbox has no bash; ``shell=None`` or ``True``) or split with
    shell-like rules (``shell=False``); a list as given (``shell=True`` is refused). Empty
    commands and NUL bytes are refused."""
    if isinstance(command, str):
        if "\0" in command:
            raise ValueError("The command contains a NUL byte (\\0); remove it.")
        check_text("The command", command)
        if not command.strip():
            raise ValueError("The command is empty; pass the command to run, e.g. 'echo hi'.")
        if shell is False:
            return _split(command)
        return [*SHELL, command]
    if not isinstance(command, (list, tuple)):
        raise TypeError(
            f"The command must be a str (run through a shell) or a list of str (an argv), "
            f"got {type(command).__name__}."
        )
    if shell:
        raise ValueError(
            "shell=True needs the command as one string; a list is an argv and runs without a "
            "shell. Pass a string, or drop shell=True."
        )
    argv = list(command)
    for index, arg in enumerate(argv):
        if not isinstance(arg, str):
            raise TypeError(f"Argument {index} of the command is {type(arg).__name__}, not str.")
        if "\0" in arg:
            raise ValueError(f"Argument {index} of the command contains a NUL byte; remove it.")
        check_text(f"Argument {index} of the command", arg)
    if not argv or not argv[0]:
        raise ValueError("The command is empty; pass the program and its arguments, e.g. ['ls'].")
    return argv


def check_text(what: str, text: str) -> None:
    """Refuse text that UTF-8, and so the wire, an argv, an environment or a stdin, cannot
    carry: a lone surrogate (``os.fsdecode`` of bytes that are not UTF-8, ``"\\ud800"``),
    before anything is sent. ``what`` names the argument."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} holds a lone surrogate ({text[exc.start : exc.end]!r} at index "
            f"{exc.start}), which UTF-8 cannot carry, so the sandbox could not receive it; pass "
            "valid text (decode bytes with errors='replace', or send them as base64)."
        ) from None


def _split(command: str) -> list[str]:
    """``command`` split with shell-like rules (``shell=False``), as a non-empty argv."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ValueError(
            f"With shell=False the command {command!r} is split with shell-like rules, and it "
            f"cannot be split ({exc}); balance its quotes, or pass the argv as a list."
        ) from None
    if not argv or not argv[0]:
        raise ValueError(
            f"With shell=False the command {command!r} splits into an empty program name; pass "
            "the program and its arguments, e.g. 'ls -l'."
        )
    return argv


def _check_envs(envs: Mapping[str, str] | None) -> dict[str, str] | None:
    if envs is None:
        return None
    if not isinstance(envs, Mapping):
        raise TypeError(f"envs must be a mapping of str to str, got {type(envs).__name__}.")
    out = {}
    for key, value in envs.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"envs must map str to str; {key!r}: {value!r} is not.")
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise ValueError(
                f"envs has an invalid variable {key!r}: names are non-empty without '=' or NUL, "
                "values without NUL."
            )
        check_text(f"The name of the envs variable {key!r}", key)
        check_text(f"The value of the envs variable {key!r}", value)
        out[key] = value
    return out


SANDBOX_WORKDIR = "/app"
"""The sandbox's working directory: where commands run by default, what a relative file path
and a relative ``cwd`` are relative to."""


def _check_cwd(cwd: str | None) -> str | None:
    """``cwd`` as the runtime takes it: an absolute path as given, a relative one resolved
    against :data:`SANDBOX_WORKDIR` (``"project"`` -> ``/app/project``), like a file path."""
    if cwd is None:
        return None
    if not isinstance(cwd, str) or not cwd.strip() or "\0" in cwd:
        raise ValueError(
            f"cwd must be a directory inside the sandbox, absolute ('/app/project', "
            f"'/workspace') or relative to {SANDBOX_WORKDIR} ('project'), got {cwd!r}."
        )
    check_text("cwd", cwd)
    if cwd.startswith("/"):
        return cwd
    if any(part == ".." for part in cwd.split("/")):
        raise ValueError(
            f"cwd {cwd!r} is relative to {SANDBOX_WORKDIR} and contains '..'; a relative cwd "
            f"stays inside {SANDBOX_WORKDIR} (as a file path does): give an absolute path "
            "to go elsewhere."
        )
    return posixpath.normpath(f"{SANDBOX_WORKDIR}/{cwd}")


def _check_timeout(timeout: float) -> float:
    """A time limit in seconds: finite, above 0, at most the broker's wait."""
    try:
        limit = float(timeout)
    except (TypeError, ValueError):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}.") from None
    return dp.check_command_timeout(limit)


RUNTIME_CAP = "the runtime's cap, 300 s unless it sets another"
"""How the messages name the runtime's largest time limit (``SANDBOX_EXEC_TIMEOUT_SECONDS``)."""


def _run_timeout(timeout: float | None, background: bool) -> float:
    """``commands.run``'s ``timeout`` as a time limit: ``0`` or ``None`` with
    ``background=True`` is none (``math.inf``: the command runs until it exits, is killed or
    its sandbox ends, as E2B's ``timeout=0``); a foreground run needs one above 0."""
    unlimited = timeout is None or (
        not isinstance(timeout, bool) and isinstance(timeout, int | float) and timeout == 0
    )
    if not unlimited:
        return _check_timeout(timeout)  # type: ignore[arg-type]  # None is handled above
    if background:
        return math.inf
    raise ValueError(
        f"commands.run(timeout={timeout!r}) without background=True: a foreground run waits "
        f"for its command, so its time limit must be a number of seconds greater than 0 (at "
        f"most {RUNTIME_CAP}). For a command without a time "
        "limit (a dev server), start it in the background: commands.run(command, "
        "background=True, timeout=0), and wait on or kill its handle."
    )


@dataclass(frozen=True)
class StartPlan:
    """A command checked and ready to start (``POST /commands`` body, or ``/execute``)."""

    argv: list[str]
    timeout: float
    envs: dict[str, str] | None = None
    cwd: str | None = None
    stdin: bool = False
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))

    @classmethod
    def make(
        cls,
        command: str | Sequence[str],
        timeout: float | None,
        *,
        shell: bool | None = None,
        background: bool = False,
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bool = False,
    ) -> StartPlan:
        if stdin and not background:
            raise ValueError(
                "stdin=True needs background=True: only a background command's handle can "
                "send_stdin(); start it with background=True."
            )
        argv = command_argv(command, shell)
        limit, checked_envs, checked_cwd = (
            _run_timeout(timeout, background),
            _check_envs(envs),
            _check_cwd(cwd),
        )
        return cls(argv, limit, checked_envs, checked_cwd, stdin)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "command": self.argv,
            "timeout": self.timeout if self.limited else dp.NO_TIME_LIMIT,
            "request_id": self.request_id,
            "stdin": self.stdin,
        }
        if self.envs:
            body["envs"] = self.envs
        if self.cwd is not None:
            body["cwd"] = self.cwd
        return body

    @property
    def limited(self) -> bool:
        """Whether the command has a time limit (``timeout=0`` in the background: none)."""
        return math.isfinite(self.timeout)

    def managed_only(self, background: bool) -> tuple[str, ...]:
        """The start options given that a legacy runtime (``/execute`` only) cannot honour."""
        given = (
            ("background", background),
            ("timeout", not self.limited),
            ("stdin", self.stdin),
            ("envs", bool(self.envs)),
            ("cwd", self.cwd is not None),
        )
        return tuple(name for name, value in given if value)


# --------------------------------------------------------------------------------------------
# The event stream


class CommandOutput:
    """The reader's side of one command's event stream: the cursor, the contiguity check, the
    collected output and the exit event."""

    def __init__(self, command_id: str, *, collect: bool = True) -> None:
        self.command_id = command_id
        self.cursor = 0
        self.collect = collect
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.collected = 0
        self.truncated = False
        self.exit: CommandEvent | None = None

    def accept(self, value: Any) -> CommandEvent | None:
        """The event ``value`` is (``None`` for a heartbeat); a gap, a repeat or a malformed
        line is a :class:`BrokerProtocolError`."""
        what = f"follow the output of command {self.command_id!r}"
        if not isinstance(value, dict) or not isinstance(value.get("seq"), int):
            raise proto.protocol_error(what, f"bad event {value!r}"[:200], _MANAGED)
        kind, seq = value.get("type"), value["seq"]
        if kind == "heartbeat":
            return None
        if kind not in ("stdout", "stderr", "exit") or seq != self.cursor + 1:
            raise proto.protocol_error(
                what, f"event {kind!r} seq {seq} after seq {self.cursor} (not contiguous)", _MANAGED
            )
        self.cursor = seq
        data = value.get("data") or ""
        if kind == "exit":
            code = value.get("exit_code")
            self.exit = CommandEvent(
                "exit", "", seq, code if isinstance(code, int) else -1, str(value.get("state"))
            )
            return self.exit
        if not isinstance(data, str):
            raise proto.protocol_error(what, f"event {seq} has non-text data", _MANAGED)
        self._keep(kind, data)
        return CommandEvent(kind, data, seq)

    def _keep(self, kind: str, data: str) -> None:
        if not self.collect:
            return
        room = COLLECT_LIMIT - self.collected
        if len(data) > room:
            self.truncated = True
            data = data[: max(room, 0)]
        if data:
            (self.stdout if kind == "stdout" else self.stderr).append(data)
            self.collected += len(data)

    @property
    def ended(self) -> bool:
        return self.exit is not None

    def lost(self, exc: errors.CommandOutputLostError) -> None:
        """Events up to ``exc.resume_after`` are gone (not retained): go on after them."""
        if exc.resume_after is None or exc.resume_after < self.cursor:
            raise exc
        self.cursor = exc.resume_after
        self.truncated = True

    def result(self) -> ExecutionResult:
        end = self.exit
        state = end.state if end is not None and end.state else "running"
        return ExecutionResult(
            stdout="".join(self.stdout),
            stderr="".join(self.stderr),
            exit_code=end.exit_code if end is not None and end.exit_code is not None else -1,
            timed_out=state == "timed_out",
            output_truncated=self.truncated,
            command_id=self.command_id,
            state=state,
        )


_MANAGED = "the managed-command protocol"


def follow(
    target: dp.DataTarget,
    output: CommandOutput,
    deadline: float | None = None,
    *,
    timeout: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    opened: bool = False,
) -> Op[Any]:
    """Follow ``output``'s command from its cursor to its exit event, yielding each output event
    (:class:`Emit`); returns its :class:`ExecutionResult`. The stream is re-requested with the
    cursor when it ends (every 20 s) or drops (a fresh token each time); a ``410`` goes on after
    the lost events. Past ``deadline`` (``clock`` time; ``timeout``: the wait's, for the
    message) :class:`CommandWaitTimeoutError` is raised; the command is left running.
    ``opened``: a stream of the command's events from the cursor is open already (the rest of
    a streamed start) and is read first."""
    failures = 0
    while output.exit is None:
        remaining = dp.EVENTS_DURATION if deadline is None else deadline - clock()
        if remaining <= 0:
            raise wait_timed_out(output.command_id, timeout)
        duration = min(dp.EVENTS_DURATION, max(remaining, 0.05))
        position = output.cursor
        if not opened:
            yield OpenEvents(dp.command_events(target, output.command_id, position, duration))
        opened = False
        while True:
            try:
                value = yield _NEXT
            except errors.CommandOutputLostError as exc:
                output.lost(exc)
                break
            except (errors.BrokerUnavailableError, errors.RequestTimeoutError):
                failures += 1
                if failures > MAX_STREAM_FAILURES:
                    raise
                yield Sleep(min(0.1 * 2**failures, 2.0))
                break
            if value is None or output.cursor != position:
                break  # the stream ended, or another reader of this handle went on: resume
            event = output.accept(value)
            position = output.cursor
            if event is not None:
                failures = 0
                yield Emit(event)
                if event.type == "exit":
                    yield from _drain()
                    break
            if output.ended or (deadline is not None and clock() >= deadline):
                break
    return output.result()


def wait_timed_out(command_id: str, timeout: float | None) -> errors.CommandWaitTimeoutError:
    """The error of a ``wait(timeout=)`` that passed: the command goes on."""
    waited = f" after {timeout:g}s" if timeout is not None else ""
    return errors.CommandWaitTimeoutError(
        f"Command {command_id!r} is still running{waited} (the wait timed out); it goes on. "
        "Call wait() again, or kill() to stop it.",
        command_id=command_id,
        timeout=timeout if timeout is not None else 0.0,
    )


def _drain() -> Op[Any]:
    """Read the stream to its end (the runtime ends it after the exit event), so that its
    connection goes back to the pool instead of being closed (a new TLS handshake per command
    otherwise). The result is complete: a failure here changes nothing and is not raised."""
    try:
        while (yield _NEXT) is not None:
            pass
    except (errors.BrokerUnavailableError, errors.RequestTimeoutError, errors.BrokerProtocolError):
        logger.debug("an event stream broke after its exit event", exc_info=True)


# --------------------------------------------------------------------------------------------
# Operations


def start(target: dp.DataTarget, plan: StartPlan, features: RuntimeFeatures) -> Op[str]:
    """``POST /commands`` of a background command (never retried); returns the command id. A
    runtime without the endpoint is :class:`UnsupportedByRuntimeError` (the 404 means the
    command did not start; known from an earlier answer: nothing is sent). What the answer
    tells of the runtime is kept in ``features``."""
    return learning(_background(target, plan, features.managed), features.record)


def _background(target: dp.DataTarget, plan: StartPlan, managed: bool | None) -> Op[str]:
    try:
        command_id = None if managed is False else (yield from _start(target, plan, stream=False))
    except errors.BrokerError as exc:
        if not plan.limited and _refuses_no_limit(exc):
            raise _no_limit_unsupported(target, f"it refused it ({exc.detail})") from None
        raise
    if command_id is None:
        raise _unsupported(target, plan.managed_only(True))
    if not plan.limited:
        yield from _confirm_no_limit(target, command_id)
    return command_id


def _confirm_no_limit(target: dp.DataTarget, command_id: str) -> Op[None]:
    """A command started without a time limit: its status must say so (``"timeout": null``),
    else the runtime gave it a limit of its own (one that ignores the value) and it is killed:
    never a silent 60 s. A status that fails kills it too (nobody holds it yet)."""
    try:
        info: dp.CommandInfo = yield status(target, command_id)
    except GeneratorExit:
        raise
    except BaseException as exc:
        failed = yield from _kill_quietly(target, command_id)
        _note_unkilled(exc, target, command_id, failed)
        raise
    if info.no_time_limit:
        return
    failed = yield from _kill_quietly(target, command_id)
    why = "it was killed" if failed is None else "it could not be killed: see the note"
    unsupported = _no_limit_unsupported(target, f"it started the command with a limit; {why}")
    _note_unkilled(unsupported, target, command_id, failed)
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


def _start(target: dp.DataTarget, plan: StartPlan, *, stream: bool) -> Op[str | None]:
    """``POST /commands`` (never retried): the command id, or ``None`` when the runtime has no
    such endpoint (learned, like its having one). ``stream``: the streamed start, whose answer
    is an event stream, its first value the command id, then the command's events (left open
    for :func:`follow`; a runtime without the extension answers that first value alone). Sent
    once: its answer lost before the command id (interrupted, the connection broke or
    stalled), the command is found by its request id and killed (:func:`_kill_unanswered`)."""
    try:
        if stream:
            yield OpenEvents(dp.start_command(target, plan.body(), stream=True), json_answer=True)
            command_id: str = dp.parse_command_id((yield _NEXT))
        else:
            command_id = yield Call(dp.start_command(target, plan.body()), _command_id)
    except errors.BrokerProtocolError as exc:
        _may_run(exc)
        raise
    except errors.BrokerError as exc:
        if _unanswered(exc):
            yield from _kill_unanswered(target, plan, exc)
            raise
        _without_commands(exc)
        yield Learned(MANAGED_COMMANDS, False)
        return None
    except BaseException as exc:
        if _unanswered(exc):
            yield from _kill_unanswered(target, plan, exc)
        raise
    yield Learned(MANAGED_COMMANDS, True)
    return command_id


_LOST_CODES = frozenset({"sandbox_answer_lost", "sandbox_timeout"})
"""The broker's codes of a 502/504 that may have reached the runtime (sent, then the connection
to the sandbox broke or stalled); its ``sandbox_unreachable`` says nothing was sent."""


def _unanswered(exc: BaseException) -> bool:
    """Whether a start may have reached the runtime without its answer being read: an
    interruption (Ctrl-C, a cancelled task), a connection that broke or stalled after the
    request was sent, or the broker's 502/504 saying that its own connection to the runtime
    did (a code of :data:`_LOST_CODES`, or no code: a deployed ``/rpc`` broker or a proxy,
    which cannot tell). Not a refusal (the runtime or the broker refused it: nothing ran), nor
    a request that was never sent, nor an error of the caller's own (a callback's)."""
    if isinstance(exc, errors.BrokerError):
        if exc.status_code in (502, 504):
            return exc.code is None or exc.code in _LOST_CODES
        return exc.status_code is None and exc.request_sent
    return not isinstance(exc, Exception | GeneratorExit)


def _kill_unanswered(target: dp.DataTarget, plan: StartPlan, exc: BaseException) -> Op[None]:
    """A start was sent but its command id never arrived: nobody could kill the command
    without it. Find it by the start's ``request_id`` (``GET /commands?request_id=``) and
    kill it, one short attempt each (the cleanup of an interrupted start); only a command
    whose ``request_id`` is the start's is ever killed. ``exc`` gets a note saying what was
    found and done, or how to find the command when the lookup failed."""
    request_id = plan.request_id
    try:
        found = yield Call(dp.find_command(target, request_id), _listed, cleanup=True)
        mine = [info for info in found if info.request_id == request_id]
        for info in mine:
            if info.running:
                yield Call(dp.kill_command(target, info.command_id), _ignore, cleanup=True)
    except Exception as failed:  # the start's own error is what the caller sees
        logger.warning("could not find or kill the command of an interrupted start: %s", failed)
        exc.add_note(
            f"The start was sent but its command id did not arrive, and the command could not "
            f"be looked up or killed ({type(failed).__name__}): it may be running in sandbox "
            f"{target.sandbox_id!r}. sandbox.commands.list() shows it (request_id "
            f"{request_id!r}); sandbox.commands.get(id).kill() stops it."
        )
        return
    exc.add_note(_unanswered_note(target, request_id, mine))


def _unanswered_note(target: dp.DataTarget, request_id: str, mine: list[dp.CommandInfo]) -> str:
    where = f"in sandbox {target.sandbox_id!r} (request_id {request_id!r})"
    if not mine:
        return (
            f"The start was sent but its command id did not arrive; no command was started "
            f"with its request id {where}, so nothing runs (sandbox.commands.list() shows "
            "every command)."
        )
    done = ", ".join(
        f"{info.command_id!r} ({'killed' if info.running else info.state})" for info in mine
    )
    return f"The start was sent but its command id did not arrive; its command {where}: {done}."


def _listed(reply: proto.Reply) -> list[dp.CommandInfo]:
    return dp.parse_command_list(proto.parse_json(reply.content, "find a command"))


def _may_run(exc: errors.BrokerProtocolError) -> None:
    """A start answered without a command id: the runtime may have started the command, which
    cannot be followed or killed without its id (the note says so and how to find it)."""
    exc.add_note(
        "The command may have started in the sandbox (its id is unknown, so it was not killed): "
        "sandbox.commands.list() shows it, commands.get(id).kill() stops it."
    )


def _without_commands(exc: errors.BrokerError) -> None:
    """A start's error: re-raised, unless the runtime has no ``/commands`` (then it returns).
    Any other 404 without a code (a proxy's, the runtime's own) is an error of this call only."""
    if not _lacks_commands(exc):
        if exc.status_code == 404 and exc.code is None:
            exc.add_note(
                "POST /commands answered 404 without the legacy runtime's answer "
                f'({{"detail": "{dp.LEGACY_NOT_FOUND}"}}), so it is not taken for a runtime '
                "without managed commands (nothing is remembered); the command did not start. "
                "Retry; if it persists, check the sandbox's template and the path to it."
            )
        raise exc


def _command_id(reply: proto.Reply) -> str:
    return dp.parse_command_id(proto.parse_json(reply.content, "start a command"))


def _lacks_commands(exc: errors.BrokerError) -> bool:
    """The legacy runtime's 404 (no broker code, its ``Not Found``): no ``/commands`` route."""
    return exc.status_code == 404 and exc.code is None and exc.detail == dp.LEGACY_NOT_FOUND


def _unsupported(target: dp.DataTarget, names: tuple[str, ...]) -> errors.UnsupportedByRuntimeError:
    given = "".join(f", {name}=..." for name in names)
    return errors.UnsupportedByRuntimeError(
        f"commands.run(command{given}) cannot be honoured in sandbox {target.sandbox_id!r}: its "
        "runtime has no managed commands (POST /commands answered 404), and "
        f"{', '.join(names)} need{'s' if len(names) == 1 else ''} them: a runtime that serves "
        "POST /commands (the original package's Python runtime v0.3.0+ behind broker v0.11.0+, "
        "or the local broker's runtime). Nothing was run. Recreate the sandbox from a template "
        "whose runtime is up to date; on this one only a plain commands.run(command) works "
        "(through the legacy POST /execute, the output arriving when the command ends).",
        options=names,
    )


def run(
    target: dp.DataTarget,
    plan: StartPlan,
    features: RuntimeFeatures,
    *,
    raise_on_timeout: bool = True,
    live: tuple[str, ...] = (),
    clock: Callable[[], float] = time.monotonic,
) -> Op[Any]:
    """A foreground ``commands.run`` (:func:`_run`); what its answers tell of the runtime is
    kept in ``features``."""
    op = _run(target, plan, features.managed, raise_on_timeout, live, clock)
    return learning(op, features.record)


def _run(
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
    command's events, read before any ``GET events``."""
    known_legacy = managed is False
    command_id = None if known_legacy else (yield from _start(target, plan, stream=True))
    if command_id is None:
        managed_only = (*live, *plan.managed_only(False))
        if managed_only:
            raise _unsupported(target, managed_only)
        return (yield from _legacy(target, plan, raise_on_timeout))
    output = CommandOutput(command_id)
    deadline = clock() + plan.timeout + dp.COMMAND_TIMEOUT_MARGIN
    try:
        result: ExecutionResult = yield from follow(
            target, output, deadline, clock=clock, opened=True
        )
    except GeneratorExit:
        raise
    except BaseException as exc:
        failed = yield from _kill_quietly(target, command_id)
        if isinstance(exc, errors.CommandWaitTimeoutError):
            timed_out = _no_exit(target, plan.timeout, output.result(), killed=failed is None)
            _note_unkilled(timed_out, target, command_id, failed)
            raise timed_out from exc
        _note_unkilled(exc, target, command_id, failed)
        raise
    return _checked(result, plan.timeout, raise_on_timeout)


_SANDBOX_GONE = frozenset({(404, "not_found"), (409, "terminating")})
"""The broker's answers for a sandbox that is gone or being deleted: its commands end with it."""


def _kill_quietly(target: dp.DataTarget, command_id: str) -> Op[Exception | None]:
    """Kill after a failed or interrupted wait; a kill that fails is logged and returned, not
    raised (the wait's own error is what the caller sees, with a note: ``_note_unkilled``). A
    sandbox that is gone or being deleted has nothing left to kill: that is no failure."""
    try:
        yield Call(dp.kill_command(target, command_id), _ignore, cleanup=True)
    except Exception as exc:  # the original error is re-raised by the caller
        if isinstance(exc, errors.BrokerError) and (exc.status_code, exc.code) in _SANDBOX_GONE:
            return None
        logger.warning("could not kill command %s after a failed wait: %s", command_id, exc)
        return exc
    return None


def _note_unkilled(
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


def _ignore(reply: proto.Reply) -> None:
    return None


def _no_exit(
    target: dp.DataTarget, limit: float, partial: ExecutionResult, *, killed: bool = True
) -> errors.CommandTimeoutError:
    outcome = "it was killed" if killed else "it could not be killed (see the note)"
    return errors.CommandTimeoutError(
        f"Command {partial.command_id!r} gave no exit within its time limit of {limit:g}s plus "
        f"{dp.COMMAND_TIMEOUT_MARGIN:g}s in sandbox {target.sandbox_id!r}; {outcome}. Pass "
        f"a larger timeout= (up to {RUNTIME_CAP}); work that "
        "runs longer (a dev server) starts in the background without a time limit: "
        "commands.run(command, background=True, timeout=0), or goes in a terminal started "
        "without a timeout (sandbox.pty.create).",
        command_timeout=limit,
        result=partial,
    )


def _checked(result: ExecutionResult, limit: float, raise_on_timeout: bool) -> ExecutionResult:
    if result.timed_out and raise_on_timeout:
        raise errors.CommandTimeoutError(
            f"The command ran longer than its time limit of {limit:g}s and was killed "
            f"(exit code {result.exit_code}). Pass a larger timeout= to commands.run, or "
            "raise_on_timeout=False to get the partial output as a result.",
            command_timeout=limit,
            result=result,
        )
    return result


def _legacy(target: dp.DataTarget, plan: StartPlan, raise_on_timeout: bool) -> Op[Any]:
    """The legacy ``POST /execute``: the argv quoted so that the runtime's shell-like split
    rebuilds it (a string keeps its shell)."""
    spec = dp.execute(target, shlex.join(plan.argv), command_timeout=plan.timeout)
    call = Call(spec, _execute_result, fail=_no_answer(target, plan.timeout))
    result: ExecutionResult = yield call
    return _checked(result, plan.timeout, raise_on_timeout)


def _execute_result(reply: proto.Reply) -> ExecutionResult:
    outcome = dp.parse_execution_result(proto.parse_json(reply.content, "run a command"))
    return outcome.model_copy(update={"state": "timed_out" if outcome.timed_out else "exited"})


def _no_answer(target: dp.DataTarget, limit: float) -> Callable[[Exception], Exception | None]:
    def fail(exc: Exception) -> Exception | None:
        if not isinstance(exc, errors.RequestTimeoutError):
            return None
        return errors.CommandTimeoutError(
            f"No answer for the command within its time limit of {limit:g}s plus "
            f"{dp.COMMAND_TIMEOUT_MARGIN:g}s; it may still be running in sandbox "
            f"{target.sandbox_id!r}. Pass a larger timeout= to commands.run.",
            command_timeout=limit,
        )

    return fail


def kill(target: dp.DataTarget, command_id: str) -> Call[ExecutionResult]:
    """``POST /commands/{id}/kill``: the final result (safe to repeat)."""
    return Call(dp.kill_command(target, command_id), _final_result)


def _final_result(reply: proto.Reply) -> ExecutionResult:
    info = dp.parse_command_info(proto.parse_json(reply.content, "kill a command"))
    return info.result()


def status(target: dp.DataTarget, command_id: str) -> Call[dp.CommandInfo]:
    spec = dp.command_status(target, command_id)
    return Call(
        spec, lambda reply: dp.parse_command_info(proto.parse_json(reply.content, spec.what))
    )


def list_commands(target: dp.DataTarget) -> Call[list[dp.CommandInfo]]:
    spec = dp.list_commands(target)
    return Call(
        spec, lambda reply: dp.parse_command_list(proto.parse_json(reply.content, spec.what))
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
    spec = dp.command_stdin(target, command_id, data, eof)  # refuses a body over the limit
    return Call(spec, _ignore, fail=dp.stdin_refusal(spec))


# --------------------------------------------------------------------------------------------
# What the sync and async shells share


@dataclass(frozen=True)
class RunPlan:
    """``commands.run``'s arguments, checked."""

    start: StartPlan
    background: bool
    on_stdout: Callable[[str], Any] | None
    on_stderr: Callable[[str], Any] | None
    raise_on_timeout: bool

    @property
    def live(self) -> tuple[str, ...]:
        """The output callbacks given (a legacy runtime cannot stream: see :func:`run`)."""
        given = (("on_stdout", self.on_stdout), ("on_stderr", self.on_stderr))
        return tuple(name for name, callback in given if callback is not None)


def plan_run(
    command: Any, timeout: float | None, background: bool, options: opts.RunOptions
) -> RunPlan:
    """Check ``commands.run``'s arguments before anything is sent."""
    named = ("command", "timeout", "background")
    opts.check_options("commands.run()", options, opts.RunOptions, named, where=opts.RUN)
    options = opts.run_spelling(options)  # upstream's env= is envs=
    background = bool(background)
    on_stdout, on_stderr = options.get("on_stdout"), options.get("on_stderr")
    check_callbacks(on_stdout, on_stderr)  # with background=True: followed while it runs
    plan = StartPlan.make(
        command,
        timeout,
        shell=options.get("shell"),
        background=background,
        envs=options.get("envs"),
        cwd=options.get("cwd"),
        stdin=bool(options.get("stdin", False)),
    )
    return RunPlan(plan, background, on_stdout, on_stderr, options.get("raise_on_timeout", True))


def check_callbacks(on_stdout: Any, on_stderr: Any) -> None:
    """``on_stdout``/``on_stderr`` are callables (or ``None``)."""
    for name, callback in (("on_stdout", on_stdout), ("on_stderr", on_stderr)):
        if callback is not None and not callable(callback):
            raise TypeError(f"{name} must be callable, got {type(callback).__name__}.")


def followed_elsewhere(command_id: str, what: str) -> ValueError:
    """``what`` (a ``wait`` with callbacks, an iteration) on a handle whose output already goes
    to the callbacks given at its start: one reader at a time."""
    return ValueError(
        f"{what}: the output of command {command_id!r} goes to the on_stdout/on_stderr given "
        "when it started (read while it runs). Call wait() without callbacks for its result, or "
        "close() the handle first to stop those callbacks."
    )


def output_callback(
    event: CommandEvent,
    on_stdout: Callable[[str], Any] | None,
    on_stderr: Callable[[str], Any] | None,
) -> Callable[[str], Any] | None:
    """The callback an output event goes to (``None``: none, or the exit event)."""
    return {"stdout": on_stdout, "stderr": on_stderr}.get(event.type)


def wait_seconds(timeout: float) -> float:
    """``wait(timeout=)`` checked: a number of seconds >= 0."""
    limit = float(timeout)
    if math.isnan(limit) or limit < 0:
        raise ValueError(f"wait(timeout=) must be a number of seconds >= 0 or None, got {timeout}.")
    return limit


def wait_deadline(
    timeout: float | None, clock: Callable[[], float] = time.monotonic
) -> float | None:
    if timeout is None:
        return None
    return clock() + wait_seconds(timeout)


class HandleBase:
    """What a background command's sync and async handles share: its id and what was read of
    its output so far (one reader at a time)."""

    def __init__(self, transport: Any, target: dp.DataTarget, command_id: str) -> None:
        self._transport = transport
        self._target = target
        self.command_id = command_id
        self._output = CommandOutput(command_id)

    def __repr__(self) -> str:
        end = self._output.exit
        state = f"{end.state}, exit {end.exit_code}" if end is not None else "not seen ended"
        return f"{type(self).__name__}(command_id={self.command_id!r}, {state})"

    def _follow(self, timeout: float | None) -> Op[Any]:
        return follow(self._target, self._output, wait_deadline(timeout), timeout=timeout)
