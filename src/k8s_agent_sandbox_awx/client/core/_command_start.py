"""A command's start, sent once (no I/O): ``POST /commands`` (plain, or the streamed start),
what its answer tells of the runtime (:class:`RuntimeFeatures`: the legacy runtime's 404 means
it has no managed commands), and the recovery of a start whose answer was lost: the command is
found by the start's ``request_id`` and killed, so nothing runs that nobody holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ... import errors
from ..wire import _commands_wire as cw
from ..wire import _dataplane as dp
from ..wire import _protocol as proto
from ._command_rules import StartPlan
from ._steps import NEXT_EVENT, Call, Learned, Op, OpenEvents, discard_answer

__all__ = [
    "MANAGED_COMMANDS",
    "RuntimeFeatures",
    "legacy_unsupported",
    "send_start",
    "sent_without_answer",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")


MANAGED_COMMANDS = "managed_commands"
"""The feature ``POST /commands`` is (a :class:`~._steps.Learned` step names it)."""


@dataclass
class RuntimeFeatures:
    """What one sandbox's runtime was found to have or lack, kept by its ``commands``: the
    operations yield what they find out (:class:`~._steps.Learned`), and :meth:`record` keeps
    it (:func:`~._command_ops.start` and :func:`~._command_ops.foreground` hand it over)."""

    managed: bool | None = None
    """``False`` once ``POST /commands`` answered the legacy runtime's 404 (no code, its
    ``{"detail": "Not Found"}``); ``True`` once it started a command."""

    def record(self, learned: Learned) -> None:
        if learned.feature == MANAGED_COMMANDS:
            self.managed = learned.present


def send_start(
    target: dp.DataTarget, plan: StartPlan, *, stream: bool, whole: bool = False
) -> Op[str | None]:
    """``POST /commands`` (never retried): the command id, or ``None`` when the runtime has no
    such endpoint (learned, like its having one). ``stream``: the streamed start, whose answer
    is an event stream, its first value the command id, then the command's events (left open
    for :func:`~._command_output.follow`; a runtime without the extension answers that first
    value alone). Sent once: its answer lost before the command id (interrupted, the
    connection broke or stalled), the command is found by its request id and killed
    (:func:`_kill_lost_start`)."""
    try:
        if stream:
            spec = cw.start_command(target, plan.body(), stream=True, whole=whole)
            yield OpenEvents(spec, json_answer=True)
            command_id: str = cw.parse_command_id((yield NEXT_EVENT))
        else:
            command_id = yield Call(cw.start_command(target, plan.body()), _parse_started_id)
    except errors.BrokerProtocolError as exc:
        _note_may_be_running(exc)
        raise
    except errors.BrokerError as exc:
        if sent_without_answer(exc):
            yield from _kill_lost_start(target, plan, exc)
            raise
        _raise_unless_legacy_runtime(exc)
        yield Learned(MANAGED_COMMANDS, False)
        return None
    except BaseException as exc:
        if sent_without_answer(exc):
            yield from _kill_lost_start(target, plan, exc)
        raise
    yield Learned(MANAGED_COMMANDS, True)
    return command_id


_LOST_CODES = frozenset({"sandbox_answer_lost", "sandbox_timeout"})
"""The broker's codes of a 502/504 that may have reached the runtime (sent, then the connection
to the sandbox broke or stalled); its ``sandbox_unreachable`` says nothing was sent."""


def sent_without_answer(exc: BaseException) -> bool:
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


def _kill_lost_start(target: dp.DataTarget, plan: StartPlan, exc: BaseException) -> Op[None]:
    """A start was sent but its command id never arrived: nobody could kill the command
    without it. Find it by the start's ``request_id`` (``GET /commands?request_id=``) and
    kill it, one short attempt each (the cleanup of an interrupted start); only a command
    whose ``request_id`` is the start's is ever killed. ``exc`` gets a note saying what was
    found and done, or how to find the command when the lookup failed."""
    request_id = plan.request_id
    try:
        found = yield Call(cw.find_command(target, request_id), _found_commands, cleanup=True)
        mine = [info for info in found if info.request_id == request_id]
        for info in mine:
            if info.running:
                yield Call(cw.kill_command(target, info.command_id), discard_answer, cleanup=True)
    except Exception as failed:  # the start's own error is what the caller sees
        logger.warning("could not find or kill the command of an interrupted start: %s", failed)
        exc.add_note(
            f"The start was sent but its command id did not arrive, and the command could not "
            f"be looked up or killed ({type(failed).__name__}): it may be running in sandbox "
            f"{target.sandbox_id!r}. sandbox.commands.list() shows it (request_id "
            f"{request_id!r}); sandbox.commands.get(id).kill() stops it."
        )
        return
    exc.add_note(_lost_start_note(target, request_id, mine))


def _lost_start_note(target: dp.DataTarget, request_id: str, mine: list[cw.CommandInfo]) -> str:
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


def _found_commands(reply: proto.Reply) -> list[cw.CommandInfo]:
    return cw.parse_command_list(proto.parse_json(reply.content, "find a command"))


def _note_may_be_running(exc: errors.BrokerProtocolError) -> None:
    """A start answered without a command id: the runtime may have started the command, which
    cannot be followed or killed without its id (the note says so and how to find it)."""
    exc.add_note(
        "The command may have started in the sandbox (its id is unknown, so it was not killed): "
        "sandbox.commands.list() shows it, commands.get(id).kill() stops it."
    )


def _raise_unless_legacy_runtime(exc: errors.BrokerError) -> None:
    """A start's error: re-raised, unless the runtime has no ``/commands`` (then it returns).
    Any other 404 without a code (a proxy's, the runtime's own) is an error of this call only."""
    if not _lacks_commands(exc):
        if exc.status_code == 404 and exc.code is None:
            exc.add_note(
                "POST /commands answered 404 without the legacy runtime's answer "
                f'({{"detail": "{cw.LEGACY_NOT_FOUND}"}}), so it is not taken for a runtime '
                "without managed commands (nothing is remembered); the command did not start. "
                "Retry; if it persists, check the sandbox's template and the path to it."
            )
        raise exc


def _parse_started_id(reply: proto.Reply) -> str:
    return cw.parse_command_id(proto.parse_json(reply.content, "start a command"))


def _lacks_commands(exc: errors.BrokerError) -> bool:
    """The legacy runtime's 404 (no broker code, its ``Not Found``): no ``/commands`` route."""
    return exc.status_code == 404 and exc.code is None and exc.detail == cw.LEGACY_NOT_FOUND


def legacy_unsupported(
    target: dp.DataTarget, names: tuple[str, ...]
) -> errors.UnsupportedByRuntimeError:
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
