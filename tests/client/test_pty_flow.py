"""The I/O-free terminal layer (``_pty_flow``): the start body, the size rules, the login shell
by default, output events as bytes, binary input, the resize request, and how a runtime without
terminals is found out (refused, legacy, or ignoring the option: then the command is killed)."""

from __future__ import annotations

import base64
import json
import math
import re
import uuid
from typing import Any

import pytest

from k8s_agent_sandbox_awx._driver import drive
from k8s_agent_sandbox_awx.client.core import _pty_flow as pf
from k8s_agent_sandbox_awx.client.core._command_rules import SHELL
from k8s_agent_sandbox_awx.client.core._command_start import RuntimeFeatures
from k8s_agent_sandbox_awx.client.core._steps import Call, Step
from k8s_agent_sandbox_awx.client.wire import _commands_wire as cw
from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    BrokerProtocolError,
    BrokerUnavailableError,
    UnsupportedByRuntimeError,
)

TARGET = RouterTarget("sbx")


def plan(**options: Any) -> pf.PtyPlan:
    args: dict[str, Any] = {"cols": 80, "rows": 24, "command": None, "cwd": None, "envs": None}
    args.update(timeout=None, on_data=None)
    args.update(options)
    return pf.plan_pty(**args)


def test_the_start_body_asks_for_a_terminal_without_a_time_limit() -> None:
    one, two = plan(cols=100, rows=30), plan(command="top", cwd="/tmp", envs={"A": "b"}, timeout=9)
    assert plan(cwd="project").cwd == "/app/project"  # relative: to the sandbox's /app
    assert one.body() == {
        "command": list(pf.DEFAULT_COMMAND),
        "request_id": one.request_id,
        "pty": {"cols": 100, "rows": 30},
    }
    assert math.isinf(one.timeout) and uuid.UUID(one.request_id).version == 4
    assert two.body() == {
        "command": [*SHELL, "top"],
        "timeout": 9.0,
        "request_id": two.request_id,
        "envs": {"A": "b"},
        "cwd": "/tmp",
        "pty": {"cols": 80, "rows": 24},
    }
    assert plan(command=["vim", "f"]).argv == ["vim", "f"]
    assert not cw.start_command(TARGET, one.body()).retryable


def test_the_default_command_is_the_login_shell_decided_in_the_sandbox() -> None:
    assert pf.DEFAULT_COMMAND[:2] == ("/bin/sh", "-c")
    script = pf.DEFAULT_COMMAND[2]
    assert 'exec "$SHELL" -l' in script and "exec bash -l" in script
    assert script.endswith("exec /bin/sh -l")


def test_the_size_is_cols_and_rows_or_size_and_80_by_24_without() -> None:
    """What both shells' ``pty.create`` plan, and the refusals both shells raise for a
    terminal whose output an ``on_data`` of ``create`` reads."""

    class PtySize:  # E2B's
        cols, rows = 120, 40

    assert plan(cols=None, rows=None).size == (80, 24)
    assert plan(cols=100, rows=None).size == (100, 24)
    assert plan(cols=None, rows=None, size=PtySize()).size == (120, 40)
    with pytest.raises(TypeError, match="not both"):
        plan(cols=100, rows=None, size=PtySize())
    told = "This terminal's output goes to the on_data given to pty.create(); "
    assert str(pf.other_on_data()) == told + "wait() takes no other on_data."
    assert str(pf.not_iterable()) == told + "iterate a terminal created without on_data."
    assert isinstance(pf.other_on_data(), ValueError)
    assert isinstance(pf.not_iterable(), TypeError)


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        ({"cols": 0}, ValueError, "cols must be from 1 to 65535"),
        ({"rows": 65536}, ValueError, "rows must be from 1 to 65535"),
        ({"cols": 80.0}, TypeError, "cols must be an int"),
        ({"rows": True}, TypeError, "rows must be an int"),
        ({"command": ""}, ValueError, "empty"),
        ({"cwd": "../etc"}, ValueError, "contains '..'"),
        ({"cwd": " "}, ValueError, "cwd must be a directory inside the sandbox"),
        ({"envs": {"A=": "b"}}, ValueError, "invalid variable"),
        ({"timeout": 0}, ValueError, "greater than 0"),
        ({"on_data": "print"}, TypeError, "on_data must be callable"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sent(
    options: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        plan(**options)
    if "cols" in options or "rows" in options:  # a resize has the same size rules
        with pytest.raises(error, match=says):
            pf.resize(TARGET, "c1", options.get("cols", 80), options.get("rows", 24))


def test_output_events_are_bytes_exactly() -> None:
    output = pf.PtyOutput("c1")
    text = output.accept({"type": "stdout", "seq": 1, "data": "h\u00e9\r\n"})
    assert isinstance(text, pf.PtyEvent) and text.raw == "h\u00e9\r\n".encode()
    raw = b"\xff\xfeok"
    exact = output.accept(
        {
            "type": "stdout",
            "seq": 2,
            "data": "\ufffd\ufffdok",
            "data_base64": base64.b64encode(raw).decode(),
        }
    )
    assert isinstance(exact, pf.PtyEvent) and exact.raw == raw
    assert output.accept({"type": "heartbeat", "seq": 2, "data": ""}) is None
    end = output.accept({"type": "exit", "seq": 3, "data": "", "exit_code": 0, "state": "exited"})
    assert end is not None and end.type == "exit"
    assert output.result().stdout == ""  # a terminal's output is not collected
    with pytest.raises(BrokerProtocolError, match="bad data_base64"):
        pf.PtyOutput("c2").accept({"type": "stdout", "seq": 1, "data": "", "data_base64": "*"})


def test_input_is_text_when_it_is_utf8_and_exact_bytes_otherwise() -> None:
    def body(data: Any) -> dict[str, Any]:
        call = pf.send_stdin(TARGET, "c1", data)
        assert not call.spec.retryable and call.spec.path == "/commands/c1/stdin"
        decoded: dict[str, Any] = json.loads(call.spec.content or b"")
        return decoded

    assert body("ls\r") == {"data": "ls\r", "eof": False}
    assert body(b"\x03") == {"data": "\x03", "eof": False}
    assert body(bytearray("\u00e9".encode())) == {"data": "\u00e9", "eof": False}
    assert body(b"\xff\x00") == {"data_base64": "/wA=", "eof": False}
    with pytest.raises(TypeError, match="bytes or str"):
        pf.send_stdin(TARGET, "c1", 3)  # type: ignore[arg-type]
    resize = pf.resize(TARGET, "c1", 120, 40).spec
    assert (resize.method, resize.path, resize.retryable) == ("POST", "/commands/c1/resize", True)
    assert json.loads(resize.content or b"") == {"cols": 120, "rows": 40}


def status(command_id: str, pty: tuple[int, int] | None) -> cw.CommandInfo:
    return cw.CommandInfo(command_id, "running", None, ("sh",), pty=pty)


def script(*answers: Any) -> tuple[list[str], Any]:
    """A perform function answering the calls in turn (an exception is raised); the calls it
    saw."""
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


def test_a_terminal_starts_and_its_status_shows_the_terminal() -> None:
    sent, perform = script("c1", status("c1", (80, 24)))
    features = RuntimeFeatures()
    assert drive(pf.start(TARGET, plan(), features), perform) == "c1"
    assert sent == ["POST /commands", "GET /commands/c1"]
    assert features.managed is True


def test_a_runtime_that_ignores_the_option_has_its_command_killed() -> None:
    sent, perform = script("c1", status("c1", None), None)
    with pytest.raises(
        UnsupportedByRuntimeError, match="without a terminal; it was killed"
    ) as info:
        drive(pf.start(TARGET, plan(), RuntimeFeatures()), perform)
    assert sent == ["POST /commands", "GET /commands/c1", "POST /commands/c1/kill"]
    assert info.value.options == ("pty",)


def test_a_status_that_fails_after_the_start_kills_the_terminal() -> None:
    lost = BrokerUnavailableError("the broker went away")
    sent, perform = script("c1", lost, BrokerUnavailableError("still away"))
    with pytest.raises(BrokerUnavailableError) as info:
        drive(pf.start(TARGET, plan(), RuntimeFeatures()), perform)
    assert info.value is lost
    assert sent == ["POST /commands", "GET /commands/c1", "POST /commands/c1/kill"]
    assert "may still be running" in " ".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize(
    ("refusal", "says"),
    [
        (
            BrokerError(
                "400",
                status_code=400,
                detail="unknown field(s) ['pty']: the fields are ['command', 'cwd']",
            ),
            "it refused the option (unknown field(s) ['pty']",
        ),
        (BrokerError("404", status_code=404, detail="Not Found"), "no managed commands"),
    ],
    ids=["refused", "legacy"],
)
def test_a_runtime_without_terminals_is_unsupported(refusal: BrokerError, says: str) -> None:
    sent, perform = script(refusal)
    features = RuntimeFeatures()
    with pytest.raises(UnsupportedByRuntimeError, match=re.escape(says)) as info:
        drive(pf.start(TARGET, plan(), features), perform)
    assert sent == ["POST /commands"]  # nothing started: nothing else sent
    assert "pty.create()" in str(info.value) and "Nothing runs" in str(info.value)
    if refusal.status_code == 404:  # remembered: the next start sends nothing
        assert features.managed is False
        sent, perform = script()
        with pytest.raises(UnsupportedByRuntimeError):
            drive(pf.start(TARGET, plan(), features), perform)
        assert sent == []


def test_another_refusal_of_the_start_is_raised_as_it_is() -> None:
    busy = BrokerError("429", status_code=429, detail="too many running commands")
    sent, perform = script(busy)
    with pytest.raises(BrokerError) as info:
        drive(pf.start(TARGET, plan(), RuntimeFeatures()), perform)
    assert info.value is busy and sent == ["POST /commands"]
