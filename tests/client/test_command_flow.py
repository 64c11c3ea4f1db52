"""The I/O-free command layer (``core/_command_*``): argv rules, the start body, the event cursor
and its contiguity check, lost output, the collection cap, and when a stream is re-requested."""

from __future__ import annotations

import os
import subprocess
import uuid
from typing import Any

import pytest

from k8s_agent_sandbox_awx._driver import drive
from k8s_agent_sandbox_awx.client.core import _command_ops as ops
from k8s_agent_sandbox_awx.client.core import _command_output
from k8s_agent_sandbox_awx.client.core._command_output import (
    MAX_STREAM_FAILURES,
    CommandEvent,
    CommandOutput,
    follow,
)
from k8s_agent_sandbox_awx.client.core._command_rules import (
    SHELL,
    SHELL_SCRIPT,
    StartPlan,
    command_argv,
)
from k8s_agent_sandbox_awx.client.core._command_start import RuntimeFeatures
from k8s_agent_sandbox_awx.client.core._steps import (
    Call,
    Emit,
    NextEvent,
    OpenEvents,
    Sleep,
    Step,
    learning,
)
from k8s_agent_sandbox_awx.client.wire import _commands_wire as cw
from k8s_agent_sandbox_awx.client.wire import _stdin_wire as stdin_wire
from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    BrokerProtocolError,
    BrokerUnavailableError,
    CommandOutputLostError,
    CommandWaitTimeoutError,
    UnsupportedByRuntimeError,
)

TARGET = RouterTarget("sbx")


def _run_op(target: Any, plan: Any, features: Any, **options: Any) -> Any:
    """A foreground run as the commands shells drive it: its findings kept in ``features``."""
    return learning(ops.foreground(target, plan, features, **options), features.record)


def test_argv_rules() -> None:
    assert command_argv("echo a | b", None) == [*SHELL, "echo a | b"]
    assert command_argv("echo a | b", True) == [*SHELL, "echo a | b"]
    assert command_argv("echo 'a b' c", False) == ["echo", "a b", "c"]
    assert command_argv(["ls", "-l"], None) == ["ls", "-l"]
    assert command_argv(("ls",), False) == ["ls"]
    for bad in ("", " ", [], [""], "a\0", ["a", "\0"]):
        with pytest.raises(ValueError):
            command_argv(bad, None)
    with pytest.raises(TypeError):
        command_argv(["ls", 1], None)  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: StartPlan.make("echo \ud800", 5), "The command"),
        (lambda: StartPlan.make("echo \udcff", 5, shell=False), "The command"),
        (lambda: StartPlan.make(["echo", "\udc80"], 5), "Argument 1"),
        (lambda: StartPlan.make("true", 5, envs={"\ud800": "v"}), "The name of the envs"),
        (lambda: StartPlan.make("true", 5, envs={"A": "\ud800"}), "The value of the envs"),
        (lambda: StartPlan.make("true", 5, cwd="/app/\ud800"), "cwd"),
        (lambda: ops.send_stdin(TARGET, "c1", "\ud800", False), "The stdin data"),
    ],
)
def test_text_utf8_cannot_carry_is_refused_before_sending(make: Any, named: str) -> None:
    with pytest.raises(ValueError) as refused:
        make()
    assert str(refused.value).startswith(named), refused.value
    assert "lone surrogate" in str(refused.value) and "UTF-8" in str(refused.value)


def test_the_start_body_has_a_fresh_request_id_and_is_never_retried() -> None:
    one = StartPlan.make("true", 5, envs={"A": "b"}, cwd="/tmp")
    two = StartPlan.make("true", 5)
    assert one.body() == {
        "command": ["/bin/sh", "-c", SHELL_SCRIPT, "sh", "true"],
        "timeout": 5.0,
        "request_id": one.request_id,
        "stdin": False,
        "envs": {"A": "b"},
        "cwd": "/tmp",
    }
    assert uuid.UUID(one.request_id).version == 4 and one.request_id != two.request_id
    assert "envs" not in two.body() and "cwd" not in two.body()
    mutating = [
        cw.start_command(TARGET, one.body()),
        cw.kill_command(TARGET, "c1"),
        stdin_wire.command_stdin(TARGET, "c1", "x", False),
    ]
    assert [spec.retryable for spec in mutating] == [False, False, False]
    events = cw.command_events(TARGET, "c/1", 7, 20)
    assert events.path == "/commands/c%2F1/events" and events.retryable
    assert events.params == {"after": "7", "duration": "20"}


def test_the_cursor_skips_heartbeats_and_refuses_gaps_and_repeats() -> None:
    out = CommandOutput("c1")
    assert out.accept({"type": "heartbeat", "seq": 0, "data": ""}) is None
    assert out.accept({"type": "stdout", "seq": 1, "data": "a"}) == CommandEvent("stdout", "a", 1)
    assert out.accept({"type": "heartbeat", "seq": 1, "data": ""}) is None
    assert out.accept({"type": "stderr", "seq": 2, "data": "b"}) is not None
    with pytest.raises(BrokerProtocolError, match="not contiguous"):
        CommandOutput("c1").accept({"type": "stdout", "seq": 2, "data": "x"})
    with pytest.raises(BrokerProtocolError, match="not contiguous"):
        out.accept({"type": "stdout", "seq": 2, "data": "again"})
    with pytest.raises(BrokerProtocolError):
        out.accept({"type": "stdout", "data": "no seq"})
    end = out.accept({"type": "exit", "seq": 3, "data": "", "exit_code": 2, "state": "exited"})
    assert end == CommandEvent("exit", "", 3, 2, "exited")
    result = out.result()
    assert (result.stdout, result.stderr, result.exit_code, result.state) == ("a", "b", 2, "exited")


def test_lost_output_moves_the_cursor_and_marks_the_result_truncated() -> None:
    out = CommandOutput("c1")
    out.accept({"type": "stdout", "seq": 1, "data": "a"})
    out.lost(CommandOutputLostError("gone", resume_after=40))
    assert out.cursor == 40 and out.truncated
    with pytest.raises(CommandOutputLostError):
        out.lost(CommandOutputLostError("no cursor"))
    with pytest.raises(CommandOutputLostError):
        out.lost(CommandOutputLostError("backwards", resume_after=3))


def test_the_collected_output_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_command_output, "COLLECT_LIMIT", 5)
    out = CommandOutput("c1")
    out.accept({"type": "stdout", "seq": 1, "data": "abc"})
    out.accept({"type": "stderr", "seq": 2, "data": "defg"})
    out.accept({"type": "stdout", "seq": 3, "data": "h"})
    result = out.result()
    assert (result.stdout, result.stderr, result.output_truncated) == ("abc", "de", True)


class Script:
    """Performs follow()'s steps from a script of streams: each a list of values or an
    exception raised when the stream is read that far."""

    def __init__(self, *streams: list[Any]) -> None:
        self.streams = list(streams)
        self.opened: list[dict[str, str]] = []
        self.current: list[Any] = []
        self.emitted: list[CommandEvent] = []
        self.pauses: list[float] = []

    def __call__(self, step: Step) -> Any:
        if isinstance(step, OpenEvents):
            self.opened.append(step.spec.params)
            self.current = list(self.streams.pop(0))
        elif isinstance(step, NextEvent):
            if not self.current:
                return None
            value = self.current.pop(0)
            if isinstance(value, Exception):
                raise value
            return value
        elif isinstance(step, Emit):
            self.emitted.append(step.event)
        elif isinstance(step, Sleep):
            self.pauses.append(step.seconds)
        else:
            raise AssertionError(step)


def ev(seq: int, data: str = "x") -> dict[str, Any]:
    return {"type": "stdout", "seq": seq, "data": data}


EXIT = {"type": "exit", "seq": 4, "data": "", "exit_code": 0, "state": "exited"}
DROPPED = BrokerUnavailableError("the connection broke")


def test_follow_resumes_from_the_cursor_after_an_end_a_drop_and_a_410() -> None:
    script = Script(
        [ev(1), {"type": "heartbeat", "seq": 1, "data": ""}],  # ended cleanly (duration)
        [ev(2), DROPPED],  # dropped
        [CommandOutputLostError("gone", resume_after=3)],
        [EXIT],
    )
    result = drive(follow(TARGET, CommandOutput("c1")), script)
    assert [p["after"] for p in script.opened] == ["0", "1", "2", "3"]
    assert [e.seq for e in script.emitted] == [1, 2, 4]
    assert result.stdout == "xx" and result.output_truncated and len(script.pauses) == 1


def test_follow_gives_up_after_repeated_failures_without_progress() -> None:
    script = Script(*([DROPPED] for _ in range(MAX_STREAM_FAILURES + 1)))
    with pytest.raises(BrokerUnavailableError):
        drive(follow(TARGET, CommandOutput("c1")), script)
    assert len(script.opened) == MAX_STREAM_FAILURES + 1
    progress = [[ev(i), DROPPED] for i in range(1, 4)]  # a failure after progress is forgiven
    script = Script(*progress, *([DROPPED] for _ in range(MAX_STREAM_FAILURES - 1)), [EXIT])
    assert drive(follow(TARGET, CommandOutput("c1")), script).stdout == "xxx"


def test_follow_stops_at_its_deadline_without_killing() -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    script = Script([ev(1), ev(2), ev(3)])
    with pytest.raises(CommandWaitTimeoutError) as info:
        drive(follow(TARGET, CommandOutput("c1"), deadline=2.5, clock=clock), script)
    assert info.value.command_id == "c1"  # and no kill was asked for: Script refuses any Call


def test_the_shell_argv_runs_bash_or_sh_and_never_pastes_the_command(
    bashless_path: str,
) -> None:
    """``SHELL + [command]`` run here: bash where the PATH has one, ``/bin/sh`` where it has
    none (``bashless_path``); the command is an argument of the script, so quotes, ``$1`` and
    ``;`` in it mean what they mean to the shell that runs it, and its exit code is kept."""
    command = """printf '%s|' "$0" "$#" '$1"; echo injected' "${BASH_VERSION:+bash}"; exit 7"""
    for path, name in ((os.environ["PATH"], "bash"), (bashless_path, "")):
        argv = command_argv(command, None)
        env = {"PATH": path}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        zero = "/bin/sh" if not name else "bash"
        assert (done.stdout, done.returncode) == (f'{zero}|0|$1"; echo injected|{name}|', 7)


def test_a_foreground_run_without_an_exit_in_time_is_killed() -> None:
    """The runtime should end a command at its limit; if no exit arrives within the limit plus
    the margin, the client kills it and raises CommandTimeoutError."""
    from k8s_agent_sandbox_awx.errors import CommandTimeoutError

    now = [0.0]
    sent: list[tuple[str, str, bool]] = []
    started: list[bool] = []

    def perform(step: Step) -> Any:
        if isinstance(step, Call):
            sent.append((step.spec.method, step.spec.path, step.cleanup))
            return None
        if isinstance(step, OpenEvents):
            sent.append((step.spec.method, step.spec.path, False))
        if isinstance(step, NextEvent) and not started:
            started.append(True)
            return {"command_id": "c1"}  # the streamed start's first line
        if isinstance(step, NextEvent):
            now[0] += 5.0  # a heartbeat every 5 s, never an exit
            return {"type": "heartbeat", "seq": 0, "data": ""}
        return None

    plan = StartPlan.make("sleep 999", 30)
    with pytest.raises(CommandTimeoutError, match="killed") as info:
        drive(_run_op(TARGET, plan, RuntimeFeatures(), clock=lambda: now[0]), perform)
    assert sent == [("POST", "/commands", False), ("POST", "/commands/c1/kill", True)]
    assert info.value.result is not None and info.value.result.command_id == "c1"
    # the ways out it names exist: a background command without a time limit, or a terminal
    assert "commands.run(command, background=True, timeout=0)" in str(info.value)
    assert "sandbox.pty.create" in str(info.value)


@pytest.mark.parametrize("wait_error", ["no exit in time", "Ctrl-C"])
def test_a_failed_wait_whose_kill_fails_says_the_command_may_still_run(wait_error: str) -> None:
    """The wait fails (no exit within the limit plus the margin; a Ctrl-C) and so does the kill
    after it: the error raised says, in a note, that the command may still be running in the
    sandbox and how to stop it (a timeout's message no longer claims it was killed)."""
    from k8s_agent_sandbox_awx.errors import CommandTimeoutError

    now = [0.0]
    lines = iter([{"command_id": "c1"}, {"type": "heartbeat", "seq": 0, "data": ""}])

    def perform(step: Step) -> Any:
        if isinstance(step, Call):
            raise BrokerUnavailableError("the broker answered 503 (Bearer not-a-secret)")
        if isinstance(step, NextEvent):
            value = next(lines, None)
            if value is None and wait_error == "Ctrl-C":
                raise KeyboardInterrupt
            if wait_error == "no exit in time":
                now[0] += 50.0  # the limit plus the margin passes
            return value or {"type": "heartbeat", "seq": 0, "data": ""}
        return None

    plan = StartPlan.make("sleep 999", 30)
    expected = CommandTimeoutError if wait_error == "no exit in time" else KeyboardInterrupt
    with pytest.raises(expected) as info:
        drive(_run_op(TARGET, plan, RuntimeFeatures(), clock=lambda: now[0]), perform)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "Command 'c1' may still be running in sandbox 'sbx'" in notes
    assert "(BrokerUnavailableError)" in notes and "not-a-secret" not in notes
    assert 'sandbox.commands.get("c1").kill()' in notes
    if wait_error == "no exit in time":
        assert "could not be killed" in str(info.value) and "it was killed" not in str(info.value)


@pytest.mark.parametrize(
    ("status", "code"), [(404, "not_found"), (409, "terminating")], ids=["gone", "terminating"]
)
def test_a_failed_wait_in_a_deleted_sandbox_does_not_say_the_command_may_still_run(
    status: int, code: str
) -> None:
    """The sandbox was deleted while its command was followed (another shell's ``kill``, its
    expiry): the wait fails and so does the kill after it, with the broker's ``not_found`` (or
    ``terminating``). The sandbox's deletion stops its commands, so the error raised is the
    wait's own, without a note saying the command may still be running and how to stop it
    (which sent a CLI user to a Python call on a sandbox that no longer exists)."""
    from k8s_agent_sandbox_awx.errors import BrokerConflictError, BrokerNotFoundError

    cls = BrokerNotFoundError if status == 404 else BrokerConflictError
    lines = iter([{"command_id": "c1"}])

    def gone(what: str) -> BrokerError:
        return cls(f"{what}: no sandbox 'sbx'", status_code=status, code=code)

    def perform(step: Step) -> Any:
        if isinstance(step, Call):  # the kill after the failed wait
            raise gone("Could not kill command 'c1'")
        if isinstance(step, NextEvent):
            value = next(lines, None)
            if value is None:
                raise gone("Could not follow the output of command 'c1'")
            return value
        return None

    plan = StartPlan.make("sleep 999", 30)
    with pytest.raises(cls, match="Could not follow the output") as info:
        drive(_run_op(TARGET, plan, RuntimeFeatures(), clock=lambda: 0.0), perform)
    assert "may still be running" not in " ".join(getattr(info.value, "__notes__", []))


def listed(command_id: str, request_id: str | None, state: str = "running") -> cw.CommandInfo:
    return cw.CommandInfo(command_id, state, None, ("sleep",), request_id=request_id)


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
@pytest.mark.parametrize("started", [True, False], ids=["started", "not started"])
def test_an_unanswered_start_kills_only_the_command_its_request_id_started(
    background: bool, started: bool
) -> None:
    """The start's answer is lost (the connection broke after it was sent): one lookup by its
    request id (never retried), then a kill of the command whose ``request_id`` is the start's
    only; what a runtime that ignores the query lists besides (another command, one without a
    ``request_id``) is never killed."""
    plan = StartPlan.make("sleep 999", 30)
    others = [listed("x", "other"), listed("y", None)]
    mine = [listed("c1", plan.request_id)] if started else []
    sent: list[tuple[str, str, dict[str, str], bool]] = []

    def perform(step: Step) -> Any:
        if isinstance(step, (Call, OpenEvents)):
            spec = step.spec
            sent.append((spec.method, spec.path, spec.params, spec.retryable))
        if isinstance(step, Call) and step.spec.method == "GET":
            assert step.cleanup
            return [*others, *mine]
        start = isinstance(step, Call) and step.spec.path == "/commands"
        if start or isinstance(step, NextEvent):
            raise BrokerUnavailableError("the connection broke while the answer was read")
        return None

    features = RuntimeFeatures()
    op = ops.start(TARGET, plan, features) if background else _run_op(TARGET, plan, features)
    with pytest.raises(BrokerUnavailableError) as info:
        drive(op, perform)
    lookup = ("GET", "/commands", {"request_id": plan.request_id}, False)
    kills = [("POST", "/commands/c1/kill", {}, False)] if started else []
    assert sent == [("POST", "/commands", {}, False), lookup, *kills]
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert ("'c1' (killed)" if started else "no command was started") in notes


@pytest.mark.parametrize(
    "refusal",
    [
        BrokerUnavailableError("503 unavailable", status_code=503, code="unavailable"),
        BrokerError("400 from the runtime", status_code=400),
        BrokerUnavailableError("no connection", request_sent=False),
        ValueError("a bug of the caller's own"),
    ],
    ids=["broker 503", "runtime 400", "never sent", "not a broker error"],
)
def test_a_start_that_was_answered_or_never_sent_is_not_looked_up(refusal: Exception) -> None:
    """A start the broker or the runtime answered with an error started nothing, and one that
    was never sent reached nothing: no lookup, no kill, nothing but the start is sent."""
    sent: list[str] = []

    def perform(step: Step) -> Any:
        if isinstance(step, (Call, OpenEvents)):
            sent.append(f"{step.spec.method} {step.spec.path}")
        if isinstance(step, NextEvent):
            raise refusal
        return None

    plan = StartPlan.make("sleep 999", 30)
    with pytest.raises(type(refusal)):
        drive(_run_op(TARGET, plan, RuntimeFeatures()), perform)
    assert sent == ["POST /commands"]


def _start_failing_with(error: Exception) -> list[str]:
    """What a foreground run sends when its start fails with ``error`` (no command listed)."""
    sent: list[str] = []

    def perform(step: Step) -> Any:
        if isinstance(step, (Call, OpenEvents)):
            sent.append(f"{step.spec.method} {step.spec.path}")
        if isinstance(step, Call) and step.spec.method == "GET":
            return []
        if isinstance(step, NextEvent):
            raise error
        return None

    plan = StartPlan.make("sleep 999", 30)
    with pytest.raises(type(error)):
        drive(_run_op(TARGET, plan, RuntimeFeatures()), perform)
    return sent


@pytest.mark.parametrize(
    "lost",
    [
        BrokerUnavailableError("lost", status_code=502, code="sandbox_answer_lost"),
        BrokerUnavailableError("stalled", status_code=504, code="sandbox_timeout"),
        BrokerUnavailableError("a deployed /rpc broker's plain-text 502", status_code=502),
        BrokerUnavailableError("a proxy's 504", status_code=504),
    ],
    ids=["broker: answer lost", "broker: timeout", "502 without a code", "504 without a code"],
)
def test_a_start_the_broker_lost_after_sending_it_is_looked_up(lost: Exception) -> None:
    """The broker's 502/504 saying its connection to the runtime broke or stalled after the
    start was sent (or a 502/504 without a code, which cannot tell): the command may run, so
    it is looked up by its request id, as after a connection of the client's own broke."""
    assert _start_failing_with(lost) == ["POST /commands", "GET /commands"]


def test_a_start_the_broker_could_not_send_is_not_looked_up() -> None:
    unreachable = BrokerUnavailableError("no", status_code=502, code="sandbox_unreachable")
    assert _start_failing_with(unreachable) == ["POST /commands"]


@pytest.mark.parametrize(
    "first",
    [{"type": "heartbeat", "seq": 0, "data": ""}, None, BrokerProtocolError("not JSON")],
    ids=["not a command id", "empty answer", "not JSON"],
)
def test_a_start_answered_without_a_command_id_says_the_command_may_run(first: Any) -> None:
    """A start whose answer has no command id cannot be followed or killed, but the runtime
    may have started the command: the typed error says so (and how to find it), and nothing is
    sent again."""
    sent: list[str] = []

    def perform(step: Step) -> Any:
        if isinstance(step, (Call, OpenEvents)):
            sent.append(f"{step.spec.method} {step.spec.path}")
            return None
        if isinstance(first, Exception):
            raise first
        return first

    plan = StartPlan.make("sleep 999", 30)
    with pytest.raises(BrokerProtocolError) as info:
        drive(_run_op(TARGET, plan, RuntimeFeatures()), perform)
    assert sent == ["POST /commands"]
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "may have started" in notes and "commands.list()" in notes


def test_shell_false_refuses_unbalanced_quotes_and_an_empty_program_clearly() -> None:
    """``shell=False`` splits with shell-like rules: a string they cannot split, or one that
    splits into an empty program name, is a ValueError naming the command, the rule and the
    fix, before anything is sent (not shlex's bare 'No closing quotation', nor [''] sent)."""
    for bad in ("echo 'a", "echo \\"):
        with pytest.raises(ValueError, match=r"shell=False.*split") as info:
            command_argv(bad, False)
        assert repr(bad) in str(info.value)
    for empty in ("''", '""  '):
        with pytest.raises(ValueError, match="empty"):
            command_argv(empty, False)


def test_a_string_that_starts_with_a_dash_is_a_command_not_shell_options(
    bashless_path: str,
) -> None:
    """The string is the shell's command, never its options: one that starts with ``-`` or
    ``+`` runs (here: not found, 127, as it is no program) instead of being read by bash or
    sh as options (a usage error, exit 2), with bash and with ``/bin/sh``."""
    for path in (os.environ["PATH"], bashless_path):
        for command in ("-x", "--version", "+x", "- echo hi"):
            argv = command_argv(command, None)
            env = {"PATH": path}
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
            assert done.returncode == 127, (command, path == bashless_path, done.stderr)


# ------------------------------------------------------------------ no time limit (background)


def _calls(*answers: Any) -> tuple[list[str], Any]:
    """A perform function answering the calls in turn (an exception is raised); the calls."""
    sent: list[str] = []
    pending = list(answers)

    def perform(step: Step) -> Any:
        assert isinstance(step, Call), step
        sent.append(f"{step.spec.method} {step.spec.path}")
        answer = pending.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return sent, perform


def _info(**fields: Any) -> cw.CommandInfo:
    return cw.CommandInfo("c1", "running", None, ("sleep",), **fields)


@pytest.mark.parametrize("timeout", [0, 0.0, None])
def test_a_background_command_without_a_time_limit_says_none_on_the_wire(timeout: Any) -> None:
    plan = StartPlan.make("python3 -m http.server", timeout, background=True)
    assert not plan.limited and plan.body()["timeout"] == "none"
    assert plan.managed_only(True) == ("background", "timeout")
    limited = StartPlan.make("sleep 1", 30, background=True)
    assert limited.limited and limited.body()["timeout"] == 30.0


@pytest.mark.parametrize("timeout", [0, None])
def test_a_foreground_run_without_a_time_limit_is_refused_naming_the_background(
    timeout: Any,
) -> None:
    with pytest.raises(ValueError, match="greater than 0") as info:
        StartPlan.make("sleep 1", timeout)
    assert "commands.run(command, background=True, timeout=0)" in str(info.value)


@pytest.mark.parametrize("timeout", [-1, float("nan"), 301.0 * 1000])
def test_other_timeouts_are_refused_as_before_in_the_background(timeout: float) -> None:
    with pytest.raises(ValueError, match=r"greater than 0|over the limit"):
        StartPlan.make("sleep 1", timeout, background=True)


def test_a_timeout_over_the_brokers_wait_names_the_background_without_a_limit() -> None:
    with pytest.raises(ValueError, match="over the limit") as info:
        StartPlan.make("sleep 1", 90000)
    assert "commands.run(..., background=True, timeout=0)" in str(info.value)


def test_a_start_without_a_time_limit_is_confirmed_by_the_status() -> None:
    sent, perform = _calls("c1", _info(no_time_limit=True))
    plan = StartPlan.make("sleep 300", 0, background=True)
    assert drive(ops.start(TARGET, plan, RuntimeFeatures()), perform) == "c1"
    assert sent == ["POST /commands", "GET /commands/c1"]
    assert cw.parse_command_info(
        {"command_id": "c", "state": "running", "timeout": None}
    ).no_time_limit
    for status in ({"timeout": 60}, {}):  # a limit, or a runtime that does not report it
        info = cw.parse_command_info({"command_id": "c", "state": "running", **status})
        assert not info.no_time_limit


def test_a_runtime_that_gives_it_a_limit_has_the_command_killed() -> None:
    sent, perform = _calls("c1", _info(), None)
    plan = StartPlan.make("sleep 300", 0, background=True)
    with pytest.raises(UnsupportedByRuntimeError, match="with a limit; it was killed") as info:
        drive(ops.start(TARGET, plan, RuntimeFeatures()), perform)
    assert sent == ["POST /commands", "GET /commands/c1", "POST /commands/c1/kill"]
    assert info.value.options == ("timeout",)
    assert "Nothing runs" in str(info.value)


def test_a_status_that_fails_after_a_start_without_a_limit_kills_the_command() -> None:
    lost = BrokerUnavailableError("the broker went away")
    sent, perform = _calls("c1", lost, None)
    plan = StartPlan.make("sleep 300", 0, background=True)
    with pytest.raises(BrokerUnavailableError) as info:
        drive(ops.start(TARGET, plan, RuntimeFeatures()), perform)
    assert info.value is lost
    assert sent == ["POST /commands", "GET /commands/c1", "POST /commands/c1/kill"]


@pytest.mark.parametrize(
    ("refusal", "says"),
    [
        (
            BrokerError(
                "400",
                status_code=400,
                detail="field 'timeout' must be a number of seconds above 0 and at most 300",
            ),
            "it refused it (field 'timeout'",
        ),
        (BrokerError("404", status_code=404, detail="Not Found"), "background=..., timeout=..."),
    ],
    ids=["older-runtime", "legacy"],
)
def test_a_runtime_without_it_is_unsupported_and_nothing_runs(
    refusal: BrokerError, says: str
) -> None:
    sent, perform = _calls(refusal)
    plan = StartPlan.make("sleep 300", 0, background=True)
    with pytest.raises(UnsupportedByRuntimeError) as info:
        drive(ops.start(TARGET, plan, RuntimeFeatures()), perform)
    assert says in str(info.value) and "timeout" in info.value.options
    assert sent == ["POST /commands"]  # refused: nothing started, nothing else sent


def test_a_refusal_of_another_field_is_not_taken_for_the_time_limit() -> None:
    refusal = BrokerError("400", status_code=400, detail="field 'cwd': not a directory")
    sent, perform = _calls(refusal)
    plan = StartPlan.make("sleep 300", 0, background=True, cwd="/nope")
    with pytest.raises(BrokerError) as info:
        drive(ops.start(TARGET, plan, RuntimeFeatures()), perform)
    assert info.value is refusal and not isinstance(info.value, UnsupportedByRuntimeError)
    assert sent == ["POST /commands"]
