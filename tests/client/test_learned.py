"""What an operation finds out about a sandbox's runtime (it has the file API, it has no managed
commands) is yielded as a ``Learned`` step, never stored by the operation: the keeper of that
knowledge (``FileAPI``, ``RuntimeFeatures``) records it, in one place."""

from __future__ import annotations

from typing import Any

import pytest

from k8s_agent_sandbox_awx._driver import drive
from k8s_agent_sandbox_awx.client.core import _command_ops as ops
from k8s_agent_sandbox_awx.client.core import _fsapi as fsapi
from k8s_agent_sandbox_awx.client.core._command_rules import StartPlan
from k8s_agent_sandbox_awx.client.core._command_start import RuntimeFeatures
from k8s_agent_sandbox_awx.client.core._steps import Call, Learned, learning
from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    FileAPIUnsupportedError,
    UnsupportedByRuntimeError,
)


def test_a_file_operation_yields_what_it_learns_and_changes_nothing() -> None:
    api = fsapi.FileAPI(RouterTarget("s"))
    op = fsapi.exists.__wrapped__(api, "a", None)  # type: ignore[attr-defined]
    assert next(op).spec.path == "/fs/exists"
    assert op.throw(FileAPIUnsupportedError("404 without a code")) == Learned("file_api", False)
    assert api.has_fs is None  # the operation itself keeps nothing
    assert op.send(None).spec.path == "/exists/a"  # the legacy endpoint
    with pytest.raises(StopIteration):
        op.send(True)
    assert api.has_fs is None


def test_the_keeper_records_what_the_operation_learned() -> None:
    api = fsapi.FileAPI(RouterTarget("s"))
    assert drive(fsapi.exists(api, "a", None), lambda call: True) is True
    assert api.has_fs is True  # recorded by FileAPI.record, handed over by the operation


def test_a_command_start_learns_whether_the_runtime_has_managed_commands() -> None:
    legacy = BrokerError("404", status_code=404, detail="Not Found")
    for answer, managed in (("c1", True), (legacy, False)):
        features = RuntimeFeatures()
        plan = StartPlan.make("true", 5, background=True)

        def perform(call: Any, answer: Any = answer) -> Any:
            if isinstance(answer, Exception):
                raise answer
            return answer

        if managed:
            assert drive(ops.start(RouterTarget("s"), plan, features), perform) == "c1"
        else:
            with pytest.raises(UnsupportedByRuntimeError):
                drive(ops.start(RouterTarget("s"), plan, features), perform)
        assert features.managed is managed


def test_learning_hands_over_learned_steps_and_passes_the_rest() -> None:
    recorded: list[Learned] = []
    seen: list[Any] = []

    def op() -> Any:
        yield Learned("x", True)
        try:
            seen.append((yield "first"))
            yield "second"
        except ValueError as exc:
            seen.append(exc)
            return "recovered"
        return "done"

    wrapped = learning(op(), recorded.append)
    assert next(wrapped) == "first" and recorded == [Learned("x", True)]
    assert wrapped.send(1) == "second" and seen == [1]
    with pytest.raises(StopIteration) as done:
        wrapped.throw(ValueError("thrown"))
    assert done.value.value == "recovered" and isinstance(seen[-1], ValueError)
    assert not isinstance(Learned("x", True), Call)
