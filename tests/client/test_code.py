"""``sandbox.run_code`` and the code contexts end to end (sync) against the local broker: state
kept between calls, results and errors as results, live callbacks, contexts (create, list,
restart, remove, busy, the bound), time limits, an interrupted wait, a lost start answer, cut
streams, a context killed from outside, and the refusal on a runtime without ``/code``."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import CodeContext, Execution, OutputMessage, Result, Sandbox
from k8s_agent_sandbox_awx.client.wire._dialect import SANDBOX_ENV
from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect
from k8s_agent_sandbox_awx.errors import (
    BrokerUnavailableError,
    CodeContextBusyError,
    CodeContextLimitError,
    CodeContextNotFoundError,
    UnsupportedByRuntimeError,
)
from tests._support.brokers import dialect_of

pytestmark = pytest.mark.e2e
RPC_SMOKE = pytest.mark.usefixtures("dialect")  # once per dialect: the /rpc data path too


@pytest.fixture
def sandbox(broker: Any) -> Iterator[Sandbox]:
    """A sandbox of ``broker`` (the test's dialect: see ``RPC_SMOKE``)."""
    with Sandbox.create(environ=broker.environ("kubernetes")) as sb:
        yield sb


# ------------------------------------------------------------------------- state and results


@RPC_SMOKE
def test_state_persists_and_an_error_is_a_result(sandbox: Sandbox) -> None:
    first = sandbox.run_code("x = 41")
    assert isinstance(first, Execution) and first.error is None and first.text is None
    second = sandbox.run_code("x + 1")
    assert second.text == "42" and second.execution_count == 2
    failed = sandbox.run_code("print('before'); undefined_name")
    assert failed.logs.stdout == ["before\n"] and failed.text is None
    assert failed.error is not None
    assert (failed.error.name, failed.error.value) == (
        "NameError",
        "name 'undefined_name' is not defined",
    )
    assert "<cell 3>" in failed.error.traceback
    assert sandbox.run_code("x").text == "41"  # the context goes on after an error


def test_results_logs_and_their_json(sandbox: Sandbox) -> None:
    execution = sandbox.run_code(
        "import sys\n"
        "class Chart:\n"
        "    def _repr_png_(self): return b'png-bytes'\n"
        "    def _repr_html_(self): return '<table></table>'\n"
        "    def __repr__(self): return 'Chart()'\n"
        "print('out'); print('err', file=sys.stderr)\n"
        "display({'shown': True})\n"
        "Chart()"
    )
    shown, main = execution.results
    assert isinstance(main, Result) and main.is_main_result and not shown.is_main_result
    assert main.formats() == ["text", "html", "png"]
    assert base64.b64decode(main.png or "") == b"png-bytes"
    assert (main.text, main.html, execution.text) == ("Chart()", "<table></table>", "Chart()")
    assert shown.text == "{'shown': True}"
    assert "".join(execution.logs.stdout) == "out\n" and "".join(execution.logs.stderr) == "err\n"
    as_json = json.loads(execution.to_json())
    assert as_json["results"][1]["png"] == main.png and as_json["error"] is None
    assert as_json["logs"] == {"stdout": ["out\n"], "stderr": ["err\n"]}


def test_callbacks_get_the_output_while_the_code_runs(sandbox: Sandbox) -> None:
    """The code waits for a file that the ``on_stdout`` callback writes: it ends only if the
    callback got its output while it ran."""
    messages: list[OutputMessage] = []

    def on_stdout(message: OutputMessage) -> None:
        messages.append(message)
        if message == "waiting\n":
            sandbox.files.write("released", b"")

    results: list[Result] = []
    errors: list[Any] = []
    execution = sandbox.run_code(
        "import os, time\n"
        "print('waiting')\n"
        "while not os.path.exists('released'):\n"
        "    time.sleep(0.02)\n"
        "print('done')\n"
        "raise ValueError('at the end')",
        on_stdout=on_stdout,
        on_result=results.append,
        on_error=errors.append,
        timeout=60,
    )
    assert [str(m) for m in messages] == ["waiting\n", "done\n"]
    assert messages[0].line == "waiting\n" and messages[0].error is False
    assert messages[0].timestamp <= messages[1].timestamp
    assert errors == [execution.error] and execution.error is not None
    assert execution.error.value == "at the end" and results == []


def test_envs_and_timeout_zero(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("import os; os.environ['ONE']", envs={"ONE": "1"}, timeout=0)
    assert execution.text == "'1'" and not execution.timed_out


# -------------------------------------------------------------------------------- contexts


def test_contexts_are_independent_and_listed(sandbox: Sandbox) -> None:
    context = sandbox.create_code_context(cwd="/workspace", envs={"WHERE": "ctx"})
    assert isinstance(context, CodeContext)
    assert (context.language, context.cwd, context.state) == ("python", "/workspace", "not_started")
    sandbox.run_code("value = 'default'")
    sandbox.run_code("value = 'mine'", context=context)
    assert sandbox.run_code("value").text == "'default'"
    mine = sandbox.run_code(
        "import os; (value, os.getcwd()[-9:], os.environ['WHERE'])", context=context.id
    )
    assert mine.text == "('mine', 'workspace', 'ctx')" and mine.context_id == context.id
    listed = sandbox.list_code_contexts()
    assert [c.id for c in listed] == ["default", context.id]
    assert listed[1].execution_count == 2 and listed[1].state == "idle"
    restarted = sandbox.restart_code_context(context)
    assert restarted.state == "not_started"
    error = sandbox.run_code("value", context=context).error
    assert error is not None and error.name == "NameError"
    sandbox.remove_code_context(context.id)
    with pytest.raises(CodeContextNotFoundError) as info:
        sandbox.run_code("1", context=context)
    assert info.value.context_id == context.id and info.value.code == "context_not_found"
    with pytest.raises(CodeContextNotFoundError):
        sandbox.remove_code_context(context)
    assert [c.id for c in sandbox.list_code_contexts()] == ["default"]


def test_a_busy_context_refuses_other_code(sandbox: Sandbox) -> None:
    started = threading.Event()
    done: list[Execution] = []

    def run() -> None:
        done.append(
            sandbox.run_code(
                "print('started')\nimport time\ntime.sleep(60)",
                on_stdout=lambda _message: started.set(),
                timeout=1.5,
            )
        )

    runner = threading.Thread(target=run)
    runner.start()
    assert started.wait(30)
    with pytest.raises(CodeContextBusyError) as info:
        sandbox.run_code("1")
    assert info.value.context_id == "default" and info.value.execution_id
    assert "context_busy" in str(info.value)
    runner.join(60)
    assert done and done[0].timed_out and done[0].error is not None
    assert done[0].error.name == "TimeoutError" and not done[0].restarted
    assert sandbox.run_code("2").text == "2"


def test_the_number_of_contexts_is_bounded(broker: Any, request: pytest.FixtureRequest) -> None:
    if SANDBOX_ENV not in get_dialect(dialect_of(request)).features:
        pytest.skip("the sandbox's env is a /v1 feature")
    env = {"SANDBOX_CODE_MAX_CONTEXTS": "2"}
    with Sandbox.create(environ=broker.environ("kubernetes"), env=env) as sandbox:
        sandbox.create_code_context()
        with pytest.raises(CodeContextLimitError) as info:
            sandbox.create_code_context()
    assert info.value.limit == 2 and "SANDBOX_CODE_MAX_CONTEXTS" in str(info.value)


def test_bad_arguments_are_refused_before_anything_is_sent(broker: Any, sandbox: Sandbox) -> None:
    before = broker.execution_count(sandbox.name)
    with pytest.raises(TypeError, match="code must be a str"):
        sandbox.run_code(b"1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout must be a number"):
        sandbox.run_code("1", timeout=True)
    with pytest.raises(ValueError, match="timeout"):
        sandbox.run_code("1", timeout=-1)
    with pytest.raises(TypeError, match="on_stdout must be callable"):
        sandbox.run_code("1", on_stdout="print")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CodeContext"):
        sandbox.run_code("1", context=7)  # type: ignore[arg-type]
    context = CodeContext(id="x", language="r", cwd="/app")
    with pytest.raises(ValueError, match="not both"):
        sandbox.run_code("1", context=context)
    with pytest.raises(ValueError, match="relative"):
        sandbox.create_code_context(cwd="../etc")
    assert broker.execution_count(sandbox.name) == before


# ------------------------------------------------------------- limits, interrupts and faults


def test_a_runaway_cell_is_a_timed_out_result(sandbox: Sandbox) -> None:
    sandbox.run_code("kept = True")
    execution = sandbox.run_code("while True:\n    pass", timeout=1)
    assert execution.timed_out and not execution.restarted
    assert execution.error is not None and execution.error.name == "TimeoutError"
    assert "time limit of 1 s" in execution.error.value
    assert sandbox.run_code("kept").text == "True"


def test_an_interrupted_wait_interrupts_the_execution(sandbox: Sandbox) -> None:
    def interrupt(_message: OutputMessage) -> None:
        raise KeyboardInterrupt  # as Ctrl-C would, while the wait is under way

    with pytest.raises(KeyboardInterrupt):
        sandbox.run_code(
            "print('running', flush=True)\nimport time\ntime.sleep(60)",
            on_stdout=interrupt,
            timeout=120,
        )
    assert sandbox.run_code("'free again'").text == "'free again'"  # not busy: interrupted


def test_a_start_whose_answer_is_lost_is_found_and_interrupted(
    broker: Any, sandbox: Sandbox
) -> None:
    """The connection drops after the runtime started the code, before its execution id
    arrived: ``BrokerUnavailableError`` (never sent again), and the execution is found by its
    request id and interrupted, so the context is free at once; nothing ran twice."""
    sandbox.run_code("runs = 0")
    before = broker.execution_count(sandbox.name)
    broker.drop_event_stream_mid_line(1, after_events=0, sandbox=sandbox.name)
    with pytest.raises(BrokerUnavailableError, match="not idempotent") as info:
        sandbox.run_code("runs += 1\nimport time\ntime.sleep(60)", timeout=120)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "(interrupted)" in notes, notes
    assert broker.execution_count(sandbox.name) == before + 1
    # once at most: interrupted in its sleep, or (on a busy machine) before its code ran
    assert sandbox.run_code("runs").text in ("1", "0")


def test_cut_streams_are_followed_to_the_end(broker: Any, sandbox: Sandbox) -> None:
    broker.cut_event_streams(after_events=3, sandbox=sandbox.name)
    got: list[str] = []
    execution = sandbox.run_code(
        "import time\nfor i in range(40):\n    print(i)\n    time.sleep(0.005)\n'end'",
        on_stdout=got.append,
    )
    assert "".join(got) == "".join(f"{i}\n" for i in range(40))
    assert "".join(execution.logs.stdout) == "".join(got) and execution.text == "'end'"


def test_a_context_killed_from_outside_is_reported_by_the_next_call(sandbox: Sandbox) -> None:
    sandbox.run_code("kept = 1")
    [default] = [c for c in sandbox.list_code_contexts() if c.id == "default"]
    assert default.pid is not None and default.state == "idle"
    sandbox.commands.run(f"kill -9 {default.pid}")  # the sandbox's own view of the process
    for _ in range(300):
        if sandbox.list_code_contexts()[0].state == "not_started":
            break
        time.sleep(0.05)
    reported = sandbox.run_code("print('not run')")
    assert reported.error is not None and reported.error.name == "ContextDied"
    assert "SIGKILL" in reported.error.value and reported.logs.stdout == []
    assert reported.restarted
    assert sandbox.run_code("'kept' in dir()").text == "False"  # a new interpreter


@pytest.mark.usefixtures("dialect")
def test_a_runtime_without_code_refuses_run_code(legacy_broker: Any) -> None:
    """Upstream's python runtime (and the deployed runtimes, behind either dialect) has no
    ``/code``: ``UnsupportedByRuntimeError`` naming run_code, nothing runs; the sandbox's
    next call is refused without a request."""
    with Sandbox.create(environ=legacy_broker.environ("kubernetes")) as sandbox:
        with pytest.raises(UnsupportedByRuntimeError) as info:
            sandbox.run_code("1")
        assert info.value.options == ("run_code",)
        assert "has no code contexts" in str(info.value) and "Nothing was run" in str(info.value)
        count = legacy_broker.execution_count(sandbox.name)
        with pytest.raises(UnsupportedByRuntimeError):
            sandbox.run_code("1")
        assert legacy_broker.execution_count(sandbox.name) == count  # not sent again
        for call in (sandbox.create_code_context, sandbox.list_code_contexts):
            with pytest.raises(UnsupportedByRuntimeError, match="code_context"):
                call()
        assert sandbox.commands.run("echo still works").stdout == "still works\n"


def test_the_callers_token_never_reaches_the_interpreter(broker: Any) -> None:
    environ = broker.environ("kubernetes")
    token = Path(environ["AGENT_SANDBOX_TOKEN_FILE"]).read_text().strip()
    with Sandbox.create(environ=environ) as sandbox:
        seen = sandbox.run_code(
            "import os\n"
            "environ = open('/proc/self/environ', 'rb').read().decode(errors='replace')\n"
            "print(repr(dict(os.environ)), environ, sep='\\n')"
        )
    dump = "".join(seen.logs.stdout)
    assert "PATH" in dump and token not in dump
    assert not any(name.startswith("AGENT_SANDBOX_TOKEN") for name in dump.split("'"))
