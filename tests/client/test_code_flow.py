"""``run_code``'s I/O-free parts: the checks and the start's body, the reading of an
execution's events (contiguity, malformed lines), the values' shapes, and how a runtime
without ``/code`` is recognised."""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import pytest

from k8s_agent_sandbox_awx import CodeContext, OutputMessage
from k8s_agent_sandbox_awx.client.core import _code_flow as kf
from k8s_agent_sandbox_awx.client.wire import _code as wire
from k8s_agent_sandbox_awx.errors import BrokerError, BrokerProtocolError


def plan(code: str = "1", **options: Any) -> kf.CodePlan:
    defaults: dict[str, Any] = {"language": "python", "context": None, "timeout": None}
    return kf.plan_run_code(code, envs=None, callbacks={}, **{**defaults, **options})


def test_the_start_body() -> None:
    body = plan("x = 1").body()
    assert body == {"code": "x = 1", "language": "python", "request_id": body["request_id"]}
    assert plan(timeout=0).body()["timeout"] == "none" and plan(timeout=0).wait_seconds is None
    assert plan(timeout=2).body()["timeout"] == 2.0
    assert plan(timeout=2).wait_seconds == 2.0 + kf.WAIT_MARGIN
    assert plan().wait_seconds == kf.DEFAULT_TIMEOUT + kf.WAIT_MARGIN  # the runtime's default
    context = CodeContext(id="c-1", language="python", cwd="/app")
    assert plan(context=context).body()["context_id"] == "c-1"
    assert plan(context="c-2").body()["context_id"] == "c-2"
    assert plan().request_id != plan().request_id  # one per call


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"timeout": math.inf}, ValueError),
        ({"timeout": "5"}, TypeError),
        ({"language": ""}, TypeError),
        ({"context": ""}, TypeError),
        ({"context": CodeContext(id="c", language="r", cwd="/app")}, ValueError),
    ],
)
def test_bad_arguments(options: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        plan(**options)
    with pytest.raises(ValueError, match="surrogate"):
        plan("\ud800")


def test_events_are_read_in_order_and_collected() -> None:
    output = kf.ExecutionOutput("e-1", "default")
    events = [
        {"type": "heartbeat", "seq": 0},
        {"type": "stdout", "seq": 1, "data": "hi\n", "timestamp": 7},
        {"type": "result", "seq": 2, "is_main_result": True, "text": "2", "png": "eA=="},
        {"type": "error", "seq": 3, "name": "E", "value": "v", "traceback": "tb"},
        {"type": "end", "seq": 4, "execution_count": 3, "timed_out": True, "restarted": False},
    ]
    accepted = [output.accept(event) for event in events]
    assert accepted[0] is None and output.ended
    message = accepted[1].value  # type: ignore[union-attr]
    assert isinstance(message, OutputMessage) and (message, message.timestamp) == ("hi\n", 7)
    execution = output.result()
    assert execution.text == "2" and execution.results[0].formats() == ["text", "png"]
    assert execution.error == wire.ExecutionError("E", "v", "tb")
    assert (execution.execution_count, execution.timed_out, execution.restarted) == (3, True, False)


@pytest.mark.parametrize(
    "event",
    [
        {"type": "stdout", "seq": 2, "data": "gap"},
        {"type": "mystery", "seq": 1},
        {"type": "stdout", "seq": 1, "data": 5},
        {"seq": "1"},
        "not an object",
    ],
)
def test_a_bad_event_is_a_protocol_error(event: Any) -> None:
    with pytest.raises(BrokerProtocolError):
        kf.ExecutionOutput("e-1", "default").accept(event)


def test_output_messages_are_strings_with_e2b_attributes() -> None:
    message = OutputMessage("line\n", 42, True)
    assert message == "line\n" and message + "!" == "line\n!" and message.line == "line\n"
    assert (message.timestamp, message.error) == (42, True)
    again = pickle.loads(pickle.dumps(message))
    assert (again, again.timestamp, again.error) == ("line\n", 42, True)


def test_a_result_as_json_and_repr() -> None:
    result = wire.result_of(
        {"type": "result", "text": "x", "json": {"a": 1}, "extra": {"image/gif": "R0"}}
    )
    assert result.formats() == ["text", "json", "image/gif"]
    assert result.to_dict() == {
        "text": "x",
        "json": {"a": 1},
        "extra": {"image/gif": "R0"},
        "is_main_result": False,
    }
    assert repr(result) == "Result('x', formats=['text', 'json', 'image/gif'])"
    json.dumps(result.to_dict())


@pytest.mark.parametrize(
    ("status", "code", "detail", "lacks"),
    [
        (404, None, "Not Found", True),  # upstream's python runtime (FastAPI)
        (404, None, "no route for POST /code/execute", True),  # an older local runtime
        (404, "context_not_found", "no code context", False),
        (404, "not_found", "no sandbox", False),  # the broker's: the sandbox is gone
        (404, None, "something else", False),  # a proxy's: not taken for a missing feature
        (500, None, "Not Found", False),
    ],
)
def test_a_runtime_without_code_is_recognised(
    status: int, code: str | None, detail: str, lacks: bool
) -> None:
    error = BrokerError("x", status_code=status, code=code, detail=detail)
    assert wire.lacks_code(error) is lacks
