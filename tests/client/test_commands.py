"""commands.run and background commands end to end (sync) against the local broker: shell rules,
envs/cwd, live callbacks, results, kill on an interrupted wait, background handles (wait, kill,
status, stdin, iteration), reattach, list, long streams across forced reconnects and token
rotation, and the /execute fallback on a runtime without managed commands."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import CommandHandle, Sandbox
from k8s_agent_sandbox_awx._upstream import ExecutionResult
from k8s_agent_sandbox_awx.client.wire._dialect import SANDBOX_ENV
from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    BrokerUnavailableError,
    CommandTimeoutError,
    CommandWaitTimeoutError,
    UnsupportedByRuntimeError,
)
from tests._support.brokers import dialect_of
from tests._support.isolation import HOST_PIDS, HOST_TMP, host_processes_only
from tests._support.programs import process_gone

# Data-plane behaviour is the same under both dialects: one dialect (v1) for most tests, and
# a small rpc data-plane smoke set (``RPC_SMOKE``: once per dialect) so that the /rpc data path
# stays covered. Tests whose behaviour depends on the dialect request ``dialect`` themselves.
pytestmark = pytest.mark.e2e
RPC_SMOKE = pytest.mark.usefixtures("dialect")  # once per dialect


@pytest.fixture
def sandbox(broker: Any, request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """A sandbox of ``broker`` (the test's dialect: see ``RPC_SMOKE``)."""
    features = get_dialect(dialect_of(request)).features
    env = {"BASE_VAR": "base"} if SANDBOX_ENV in features else {}
    with Sandbox.create(environ=broker.environ("kubernetes"), env=env) as sb:
        yield sb


# ------------------------------------------------------------------------------- shell rules


@RPC_SMOKE
def test_a_string_runs_through_bash_and_a_list_is_an_argv(sandbox: Sandbox) -> None:
    assert sandbox.commands.run("echo a | tr a b").stdout == "b\n"
    assert sandbox.commands.run("cd /tmp && pwd").stdout == "/tmp\n"
    assert sandbox.commands.run("echo $BASH_VERSION | cut -c1").stdout.strip().isdigit()
    assert sandbox.commands.run(["echo", "a | tr a b", "$HOME"]).stdout == "a | tr a b $HOME\n"
    split = sandbox.commands.run("printf '%s|' 'a b' c $HOME", shell=False)
    assert split.stdout == "a b|c|$HOME|"  # shell-like split, no shell: nothing expanded
    assert sandbox.commands.run("echo explicit", shell=True).stdout == "explicit\n"


def test_every_string_command_runs_through_bash_and_once(broker: Any, sandbox: Sandbox) -> None:
    before = broker.execution_count(sandbox.name)
    assert sandbox.commands.run("echo ran >> count; echo ${BASH_VERSION:-sh}").stdout[0].isdigit()
    handle = sandbox.commands.run(
        "read line; echo ${BASH_VERSION:-sh} $line", background=True, stdin=True
    )
    handle.send_stdin("hi\n", eof=True)
    assert handle.wait().stdout[0].isdigit() and handle.wait().stdout.endswith(" hi\n")
    assert sandbox.commands.run("cat count").stdout == "ran\n"  # ran once
    assert broker.execution_count(sandbox.name) == before + 3  # one start per command


@host_processes_only(HOST_TMP)
@pytest.mark.dialect_feature(SANDBOX_ENV, reason="the bash-less PATH is given through it")
def test_strings_run_through_sh_in_a_sandbox_without_bash(
    broker: Any, legacy_broker: Any, bashless_path: str
) -> None:
    """A sandbox whose PATH has no bash (``bashless_path``: what it simulates and what not):
    foreground (with live output), background with stdin, and the legacy /execute path all run
    a string with /bin/sh, once, with no retry."""
    env = {"PATH": bashless_path}
    with Sandbox.create(environ=broker.environ("kubernetes"), env=env) as sandbox:
        chunks: list[str] = []
        script = "echo ran >> count; echo ${BASH_VERSION:-sh} | tr a-z A-Z; exit 3"
        result = sandbox.commands.run(script, on_stdout=chunks.append)
        assert (result.stdout, result.exit_code, "".join(chunks)) == ("SH\n", 3, "SH\n")
        handle = sandbox.commands.run(
            "echo ran >> count; read line; echo ${BASH_VERSION:-sh} got $line",
            background=True,
            stdin=True,
        )
        handle.send_stdin("hi\n", eof=True)
        assert handle.wait().stdout == "sh got hi\n"
        assert sandbox.commands.run("cat count").stdout == "ran\nran\n"  # each ran once
        assert broker.execution_count(sandbox.name) == 3  # one start each, no retry
    with Sandbox.create(environ=legacy_broker.environ("kubernetes"), env=env) as sandbox:
        result = sandbox.commands.run("echo ran >> count; echo ${BASH_VERSION:-sh} | tr s S")
        assert (result.stdout, result.exit_code) == ("Sh\n", 0)
        assert sandbox.commands.run(["cat", "count"]).stdout == "ran\n"
        assert legacy_broker.execution_count(sandbox.name) == 3  # the 404, then 2 /execute


@pytest.mark.parametrize(
    ("command", "options", "error", "match"),
    [
        (["echo", "x"], {"shell": True}, ValueError, "shell=True needs the command as one string"),
        ("cat", {"stdin": True}, ValueError, "stdin=True needs background=True"),
        ("", {}, ValueError, "empty"),
        ("   ", {}, ValueError, "empty"),
        ([], {}, ValueError, "empty"),
        ("echo a\0b", {}, ValueError, "NUL"),
        (["echo", "a\0"], {}, ValueError, "NUL"),
        (b"echo", {}, TypeError, "str"),
        # a relative cwd is relative to /app now (issue 23); one that climbs out is not
        ("true", {"cwd": "../up"}, ValueError, "contains '..'"),
        ("true", {"envs": {"A=B": "x"}}, ValueError, "invalid variable"),
        ("true", {"envs": {"A": 1}}, TypeError, "str to str"),
        ("true", {"timeout": 0}, ValueError, "greater than 0"),
        ("true", {"on_stdout": "print"}, TypeError, "callable"),
        # background=True with on_stdout is accepted now (issue 23: delivered while it runs)
        # env= is accepted now (upstream's spelling of envs=, issue 23): a misspelling is not
        ("true", {"evns": {"A": "b"}}, TypeError, "did you mean 'envs'"),
    ],
)
def test_bad_commands_are_refused_before_anything_is_sent(
    broker: Any, sandbox: Sandbox, command: Any, options: dict[str, Any], error: Any, match: str
) -> None:
    with pytest.raises(error, match=match):
        sandbox.commands.run(command, **options)
    assert broker.execution_count(sandbox.name) == 0


def test_envs_merge_over_the_sandbox_environment_and_cwd_applies(sandbox: Sandbox) -> None:
    result = sandbox.commands.run(
        'echo "$BASE_VAR $MINE"; pwd', envs={"MINE": "mine value"}, cwd="/tmp"
    )
    base = "base" if SANDBOX_ENV in sandbox.client.dialect.features else ""
    assert result.stdout == f"{base} mine value\n/tmp\n"
    assert sandbox.commands.run('echo "[$MINE]"').stdout == "[]\n"  # per command
    with pytest.raises(BrokerError, match="400"):
        sandbox.commands.run("true", cwd="/no/such/dir")


# ----------------------------------------------------------------------- results and callbacks


@pytest.mark.upstream  # upstream's ExecutionResult
def test_result_carries_the_command_id_state_and_a_non_zero_exit(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("echo out; echo err >&2; exit 3")
    assert isinstance(result, ExecutionResult)
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
    assert result.state == "exited" and not result.timed_out and not result.output_truncated
    assert result.command_id and sandbox.commands.get(result.command_id).status().exit_code == 3


@RPC_SMOKE
def test_callbacks_get_the_output_while_the_command_runs(sandbox: Sandbox) -> None:
    seen: list[tuple[str, str, str]] = []

    def on_stdout(text: str) -> None:
        [mine] = [c for c in sandbox.commands.list() if c.command[-1] == script]
        seen.append(("out", text, mine.state))

    script = "echo first; sleep 0.5; echo second >&2; sleep 0.5; printf 'no newline'"
    result = sandbox.commands.run(
        script, on_stdout=on_stdout, on_stderr=lambda t: seen.append(("err", t, "-"))
    )
    assert seen[0] == ("out", "first\n", "running")  # delivered before the command ended
    assert ("err", "second\n", "-") in seen
    assert "".join(t for kind, t, _ in seen if kind == "out") == result.stdout
    assert result.stdout == "first\nno newline" and result.stderr == "second\n"


@pytest.mark.parametrize(
    "text",
    ['tab\there "quoted" back\\slash\r\nCR é€😀\u2028 end\n', "\x1b[31mred\x1b[0m \x01\x7f\n"],
)
def test_any_text_arrives_byte_for_byte(sandbox: Sandbox, text: str) -> None:
    """The runtime escapes usual output with a few replaces and anything else (control
    characters) with ``json``: both arrive as printed."""
    chunks: list[str] = []
    # python3 from PATH: the sandbox's own (a pod's image has none at this host's path)
    argv = ["python3", "-c", "import sys; sys.stdout.write(sys.argv[1])", text]
    result = sandbox.commands.run(argv, on_stdout=chunks.append)
    assert result.stdout == text == "".join(chunks)


def test_invalid_utf8_is_replaced(sandbox: Sandbox) -> None:
    chunks: list[str] = []
    result = sandbox.commands.run(r"printf 'a\377b'", on_stdout=chunks.append)
    assert result.stdout == "a\ufffdb" == "".join(chunks)


def test_a_command_over_its_time_limit_is_killed(sandbox: Sandbox) -> None:
    with pytest.raises(CommandTimeoutError) as info:
        sandbox.commands.run("echo started; sleep 30", timeout=1)
    assert info.value.result is not None and info.value.result.state == "timed_out"
    assert info.value.result.stdout == "started\n"
    result = sandbox.commands.run("sleep 30", timeout=1, raise_on_timeout=False)
    assert (result.state, result.exit_code, result.timed_out) == ("timed_out", 124, True)


@host_processes_only(HOST_PIDS)
def test_an_interrupted_foreground_run_kills_the_process_group(
    sandbox: Sandbox, process_gone: Any
) -> None:
    pids: list[int] = []

    def interrupt(text: str) -> None:
        pids.append(int(text.split()[0]))
        raise KeyboardInterrupt  # as Ctrl-C would, while the wait is under way

    with pytest.raises(KeyboardInterrupt):
        sandbox.commands.run("sleep 60 & echo $!; wait", on_stdout=interrupt)
    [mine] = [c for c in sandbox.commands.list() if c.command[-1].startswith("sleep 60 &")]
    assert mine.state == "cancelled"
    assert process_gone(pids[0])  # the background child of the shell too: the whole group


@pytest.mark.slow
def test_a_run_whose_kill_cannot_be_delivered_says_the_command_may_still_run(
    broker: Any, sandbox: Sandbox
) -> None:
    """The broker goes down (every data-plane request 503) once the command printed: the wait
    gives up (``BrokerUnavailableError``), and so does the kill after it. The error's note
    names the sandbox and the command, says it may still be running and how to stop it, and
    quotes no token (before: the kill's failure was only logged, and the error said nothing)."""
    token = Path(broker.environ("kubernetes")["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
    broker.cut_event_streams(after_events=2, sandbox=sandbox.name)  # the id line, "started"

    def outage(_text: str) -> None:
        broker.inject_unavailable(100_000, retry_after=0, scope="data", sandbox=sandbox.name)

    with pytest.raises(BrokerUnavailableError) as info:
        sandbox.commands.run("echo started; exec sleep 60", on_stdout=outage)
    broker.clear_faults()
    [running] = [c for c in sandbox.commands.list() if c.running]
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"Command {running.command_id!r} may still be running" in notes
    assert f"in sandbox {sandbox.sandbox_id!r}" in notes
    assert f'sandbox.commands.get("{running.command_id}").kill()' in notes
    assert token.strip() not in notes + str(info.value)
    assert sandbox.commands.get(running.command_id).kill().state == "cancelled"


def interrupt_after_the_start_is_sent(monkeypatch: pytest.MonkeyPatch, sandbox: Sandbox) -> None:
    """From now on, a ``POST /commands`` of ``sandbox`` is sent and its answer's head arrives
    (the runtime started the command), then Ctrl-C strikes before the command id is read."""
    transport = sandbox.commands._transport
    perform = transport.perform

    def interrupting(step: Any) -> Any:
        response = perform(step)
        request = getattr(step, "request", None)
        if request is not None and (request.method, request.url.path) == ("POST", "/commands"):
            response.close()
            raise KeyboardInterrupt
        return response

    monkeypatch.setattr(transport, "perform", interrupting)


@host_processes_only(HOST_PIDS)
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_start_interrupted_before_its_command_id_is_found_and_killed(
    monkeypatch: pytest.MonkeyPatch, sandbox: Sandbox, process_gone: Any, background: bool
) -> None:
    """Ctrl-C between sending a start and reading its command id: the cleanup finds the command
    by the start's request id (``GET /commands?request_id=``) and kills it; the interrupt says
    so (before: the command ran on, and nobody had its id to kill it)."""
    interrupt_after_the_start_is_sent(monkeypatch, sandbox)
    with pytest.raises(KeyboardInterrupt) as info:
        sandbox.commands.run("exec sleep 60", background=background)
    monkeypatch.undo()
    [started] = [c for c in sandbox.commands.list() if c.command[-1] == "exec sleep 60"]
    assert started.state == "cancelled" and started.pid is not None
    assert process_gone(started.pid)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f"{started.command_id!r} (killed)" in notes and started.request_id in notes


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_start_whose_answer_is_lost_is_found_and_killed(
    broker: Any, sandbox: Sandbox, background: bool
) -> None:
    """The connection drops after the runtime started the command, before its id arrived (the
    streamed start's first line; a plain start's answer): ``BrokerUnavailableError``, and the
    command is found by its request id and killed, not left running unseen; nothing ran twice."""
    if background:
        broker.drop_connection_after_execute(1, sandbox=sandbox.name)
    else:
        broker.drop_event_stream_mid_line(1, after_events=0, sandbox=sandbox.name)
    with pytest.raises(BrokerUnavailableError, match="not idempotent"):
        sandbox.commands.run("exec sleep 60", background=background)
    assert [c.state for c in sandbox.commands.list()] == ["cancelled"]
    assert broker.execution_count(sandbox.name) == 1


# ------------------------------------------------------------------------------- background


@RPC_SMOKE
def test_a_background_server_is_waited_on_and_killed(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("echo ready; exec sleep 60", background=True)
    assert isinstance(handle, CommandHandle) and handle.command_id
    events = iter(handle)
    first = next(events)
    assert (first.type, first.data, first.seq) == ("stdout", "ready\n", 1)
    assert handle.status().state == "running"
    with pytest.raises(CommandWaitTimeoutError) as info:
        handle.wait(timeout=0.5)
    assert (info.value.command_id, info.value.timeout) == (handle.command_id, 0.5)
    assert "after 0.5s" in str(info.value)
    assert handle.status().state == "running"  # a wait timeout does not kill
    final = handle.kill()
    assert (final.state, final.exit_code, final.stdout) == ("cancelled", 137, "ready\n")
    assert handle.kill() == final  # safe to repeat
    waited = handle.wait()
    assert (waited.state, waited.stdout) == ("cancelled", "ready\n")
    assert list(events) == []  # wait() read on to the exit: reading continues, nothing repeated
    assert [e.type for e in sandbox.commands.get(handle.command_id)] == ["stdout", "exit"]


@host_processes_only(HOST_PIDS)
def test_a_background_command_without_a_time_limit_runs_until_its_sandbox_ends(
    broker: Any,
) -> None:
    """``background=True, timeout=0`` (E2B's spelling): past the runtime's cap (1 s here, which
    still refuses a larger number) the command runs; deleting the sandbox ends it."""
    env = {"SANDBOX_EXEC_TIMEOUT_SECONDS": "1"}
    with Sandbox.create(environ=broker.environ("kubernetes"), env=env) as sandbox:
        with pytest.raises(BrokerError, match="at most 1"):
            sandbox.commands.run("sleep 5", background=True, timeout=2)
        server = sandbox.commands.run("echo $$; exec sleep 300", background=True, timeout=0)
        pid = int(next(iter(server)).data)
        time.sleep(2.5)  # past the cap, and the default (min(60 s, the cap))
        status = server.status()
        assert (status.state, status.no_time_limit, status.pid) == ("running", True, pid)
        also = sandbox.commands.run("exec sleep 300", background=True, timeout=None)
        assert also.status().no_time_limit
        sandbox.kill()
        assert process_gone(pid)


def test_stdin_and_iteration(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run(["cat"], background=True, stdin=True)
    handle.send_stdin("hello\n")
    handle.send_stdin("wörld".encode())
    handle.send_stdin("", eof=True)
    out = [(e.type, e.data) for e in handle if e.type != "exit"]
    assert "".join(data for _, data in out) == "hello\nwörld"
    assert handle.wait().exit_code == 0
    with pytest.raises(BrokerError, match="409"):
        handle.send_stdin("late")


def test_stdin_over_the_runtimes_limit_is_refused_before_sending(sandbox: Sandbox) -> None:
    """Issue 19 item 11: 2 MB of stdin was reported as an unreachable sandbox (502, "create a
    new sandbox"), and 0.9 MB of text that JSON escaping makes 1.2 MB as a 400. Both are now
    refused before anything is sent, with the limit and how to send more (in chunks, which
    work: the command reads all of it)."""
    from k8s_agent_sandbox_awx.errors import StdinTooLargeError

    handle = sandbox.commands.run(["wc", "-c"], background=True, stdin=True)
    big, escaped = "x" * (2 * 1024 * 1024), '"' * (900 * 1024)  # a quote is sent as \"
    for data in (big, escaped, big.encode()):
        with pytest.raises(StdinTooLargeError) as info:
            handle.send_stdin(data)
        error = info.value
        assert isinstance(error, ValueError) and error.limit == 1024 * 1024
        assert error.size is not None and error.size > error.limit and not error.request_sent
        assert "1048576 bytes" in str(error) and "chunks of at most 65536" in str(error)
    for start in range(0, len(big), 65536):
        handle.send_stdin(big[start : start + 65536])
    handle.send_stdin("", eof=True)
    assert handle.wait().stdout.strip() == str(len(big))  # nothing of the refused writes


@pytest.mark.dialect_feature(SANDBOX_ENV, reason="the runtime's limits are set through it")
def test_a_background_server_keeps_serving_while_its_iterator_is_held_unread(
    broker: Any, logging_server: Any
) -> None:
    """``events = iter(handle)``, one event read (the server's port), then the iterator is held
    without reading while the server serves and logs 37.5 MiB, far beyond every buffer on the
    way to the iterator (the runtime, the broker, the client's socket): the runtime's stream
    stalls, and after the grace time (0.5 s here) it no longer holds the server's output pipe
    (before: it held it for good and the server stopped serving until the client went away).
    The stream's unacknowledged bound is raised so that the stream cannot end at it first.
    Read again, the iterator goes on from its cursor and gets every event up to the exit: the
    window kept what it had not acknowledged (up to the window plus the unacknowledged bound,
    256 MiB here; beyond it the oldest would be skipped, with a 410)."""
    env = {
        "SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES": "4096",
        "SANDBOX_COMMAND_LIVE_WINDOW_BYTES": "65536",
        "SANDBOX_COMMAND_UNACKED_BYTES": str(256 * 1024 * 1024),
        "SANDBOX_COMMAND_FOLLOWER_GRACE_SECONDS": "0.5",
    }
    with Sandbox.create(environ=broker.environ("kubernetes"), env=env) as sandbox:
        handle = sandbox.commands.run(logging_server.argv, background=True)
        events = iter(handle)
        try:
            port = int(next(events).data)
            assert logging_server.serves(port, 400) < 5.0
            assert handle.status().state == "running"
            assert next(events).seq == 2
            handle.kill()
            rest = [(event.seq, event.type) for event in events]
            assert [seq for seq, _ in rest] == list(range(3, len(rest) + 3))
            assert rest[-1][1] == "exit" and handle.wait().state == "cancelled"
        finally:
            events.close()
            handle.kill()


@RPC_SMOKE
def test_wait_callbacks_and_reattach_replays_the_output(broker: Any, sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("echo one; sleep 0.3; echo two", background=True)
    got: list[str] = []
    assert handle.wait(on_stdout=got.append).stdout == "one\ntwo\n" == "".join(got)
    other = Sandbox.connect(sandbox.name, environ=broker.environ("kubernetes"))
    try:
        again = other.commands.get(handle.command_id)
        assert again.wait().stdout == "one\ntwo\n"  # replayed from the start
        listed = {c.command_id: c for c in other.commands.list()}
        assert listed[handle.command_id].state == "exited"
        assert listed[handle.command_id].stdout is None  # a listing has no output
        with pytest.raises(BrokerError, match="404"):
            other.commands.get("no-such-command")
    finally:
        other.close_connection()  # the sandbox keeps running


def test_reattach_from_another_process(broker: Any, sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 0.5; echo from-afar", background=True)
    script = (
        "import sys\nfrom k8s_agent_sandbox_awx import Sandbox\n"
        "sb = Sandbox.connect(sys.argv[1])\n"
        "print(sb.commands.get(sys.argv[2]).wait().stdout, end='')\n"
    )
    env = {
        **os.environ,
        **broker.environ("kubernetes"),
        "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", script, sandbox.name, handle.command_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout) == (0, "from-afar\n"), out.stderr


def test_the_running_limit_is_a_clear_error(sandbox: Sandbox) -> None:
    handles = [sandbox.commands.run("sleep 60", background=True) for _ in range(16)]
    with pytest.raises(BrokerError, match=r"429.*16"):
        sandbox.commands.run("true")
    for handle in handles:
        handle.kill()
    assert sandbox.commands.run("echo room").stdout == "room\n"


# ----------------------------------------------------------------------- long streams


class StreamRequests:
    """Wraps a transport's ``events``: the cursor (``after``) of every event-stream request and
    the failures (dropped connections) the client saw while reading them."""

    def __init__(self, events: Any) -> None:
        self._events = events
        self.cursors: list[int] = []
        self.failures: list[Exception] = []

    def __call__(self, spec: Any, **options: Any) -> Iterator[Any]:
        self.cursors.append(int(spec.params.get("after", 0)))  # a streamed start: from 0
        try:
            yield from self._events(spec, **options)
        except Exception as exc:
            self.failures.append(exc)
            raise


@pytest.mark.slow
def test_a_long_stream_cut_every_50_events_and_dropped_mid_line_loses_and_repeats_nothing(
    broker: Any,
    sandbox: Sandbox,
    long_stream: Any,
    mid_line_drops: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The "10-minute" stream: a proxy cut every 50 events (as every 20 s would be for an hour)
    and a drop inside a line every 200 events, the output compared byte for byte."""
    broker.cut_event_streams(after_events=50, sandbox=sandbox.name)
    inject = mid_line_drops(broker, sandbox.name)
    streams = StreamRequests(sandbox.commands._transport.events)
    monkeypatch.setattr(sandbox.commands._transport, "events", streams)
    chunks: list[str] = []

    def on_stdout(text: str) -> None:
        chunks.append(text)
        inject(len(chunks))

    result = sandbox.commands.run(long_stream.argv, on_stdout=on_stdout)
    assert result.stdout == long_stream.expected == "".join(chunks)  # byte for byte
    # 1600 lines, one event each on a quiet machine; a busy one may read several lines at once
    # (fewer events, so fewer cuts and drops): each count is checked against the events seen
    assert len(chunks) >= 400  # that many events: the cuts below are not vacuous
    assert len(streams.cursors) >= len(chunks) // 50 >= 8  # re-requested at every cut
    assert len(streams.failures) >= len(chunks) // 200 - 1 >= 1  # the mid-line drops survived
    assert streams.cursors[0] == 0 and streams.cursors == sorted(streams.cursors)

    handle = sandbox.commands.run(long_stream.argv, background=True)
    streams.cursors.clear()
    streams.failures.clear()
    events = []
    for event in handle:
        events.append(event)
        inject(1600 + len(events))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no gap, no repeat
    assert "".join(e.data for e in events) == long_stream.expected
    assert len(streams.cursors) >= len(events) // 50 >= 8
    assert len(streams.failures) >= (1600 + len(events)) // 200 - max(8, len(chunks) // 200) - 1
    assert events[-1].type == "exit" and events[-1].exit_code == 0


def test_a_long_stream_survives_token_rotation(broker: Any, tmp_path: Path) -> None:
    path = tmp_path / "tokens" / "agent-sandbox-token"
    env = broker.environ("kubernetes", token_file=path)
    old = path.read_text()
    with Sandbox.create(environ=env) as sandbox:
        broker.cut_event_streams(after_events=5, sandbox=sandbox.name)  # many re-requests
        rotated = threading.Event()

        def on_stdout(text: str) -> None:
            if "tick 3\n" in text and not rotated.is_set():
                broker.write_projected_token(path)  # kubelet-style swap
                broker.revoke_token(old)  # only the re-read token works from now on
                rotated.set()

        script = "for i in $(seq 1 12); do echo tick $i; sleep 0.1; done"
        result = sandbox.commands.run(script, on_stdout=on_stdout)
        assert rotated.is_set()
        assert result.stdout == "".join(f"tick {i}\n" for i in range(1, 13))


# ----------------------------------------------------------------------- the streamed start


def test_the_streamed_start_delivers_the_output_live_in_one_request(
    broker: Any,
    sandbox: Sandbox,
    long_output: tuple[list[str], str],
    streams_opened: Any,
) -> None:
    """A foreground run asks for the streamed start: the answer to ``POST /commands`` goes on
    with the command's events as they are produced, so no ``GET .../events`` is needed."""
    opened = streams_opened(sandbox)
    states: list[str] = []

    def on_stdout(text: str) -> None:
        if not states:
            states.append(sandbox.commands.list()[-1].state)

    first = sandbox.commands.run("echo first; sleep 0.5; echo second", on_stdout=on_stdout)
    assert (first.stdout, states) == ("first\nsecond\n", ["running"])  # live
    script, expected = long_output
    chunks: list[str] = []
    result = sandbox.commands.run(script, on_stdout=chunks.append)
    assert result.stdout == expected == "".join(chunks)  # byte for byte
    assert opened == ["POST", "POST"]
    assert broker.execution_count(sandbox.name) == 2


def test_a_run_without_callbacks_prefers_its_answer_whole(
    broker: Any, sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No output shown live: the streamed start says so (``Prefer: no-live-output``) and the
    runtime answers whole at the exit; with a callback it streams. Both are one request."""
    transport = sandbox.commands._transport
    seen: list[tuple[str | None, str | None]] = []
    events = transport.events

    def recording(spec: Any, **options: Any) -> Any:
        yield from events(spec, **options)
        seen.append((spec.method, (spec.headers or {}).get("Prefer")))

    monkeypatch.setattr(transport, "events", recording)
    quiet = sandbox.commands.run(["sh", "-c", "echo quiet; exit 2"])
    chunks: list[str] = []
    live = sandbox.commands.run(["sh", "-c", "echo live; exit 3"], on_stdout=chunks.append)
    assert (quiet.stdout, quiet.exit_code, live.stdout, live.exit_code) == (
        "quiet\n",
        2,
        "live\n",
        3,
    )
    assert chunks == ["live\n"]
    assert seen == [("POST", "no-live-output"), ("POST", None)]
    assert broker.execution_count(sandbox.name) == 2


def test_a_whole_answer_cut_by_the_broker_resumes_without_loss(
    broker: Any, sandbox: Sandbox, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker's stream cut (a proxy that times out) applies to an answer the runtime sent
    whole: it ends cleanly after the lines, the client goes on from its cursor, and the broker
    does not fail on the length the runtime announced."""
    broker.cut_event_streams(after_events=2, sandbox=sandbox.name)
    with caplog.at_level(logging.ERROR):
        result = sandbox.commands.run(["bash", "-c", "for i in 1 2 3 4; do echo $i; done; exit 7"])
    assert (result.stdout, result.exit_code) == ("1\n2\n3\n4\n", 7)
    assert broker.execution_count(sandbox.name) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("lines", [1, 6])
@RPC_SMOKE
def test_a_streamed_start_dropped_after_the_command_id_resumes_without_loss(
    broker: Any,
    sandbox: Sandbox,
    long_output: tuple[list[str], str],
    streams_opened: Any,
    lines: int,
) -> None:
    """The broker drops the streamed start inside the line after ``lines`` whole lines (the
    command id, then events): the client goes on with ``GET events`` from its cursor; nothing
    is lost or repeated and the start is not sent again."""
    script, expected = long_output
    broker.drop_event_stream_mid_line(1, after_events=lines, sandbox=sandbox.name)
    opened = streams_opened(sandbox)
    chunks: list[str] = []
    result = sandbox.commands.run(script, on_stdout=chunks.append)
    assert result.stdout == expected == "".join(chunks)
    assert opened[0] == "POST" and len(opened) == 2
    assert opened[1] == "0" if lines == 1 else 0 < int(opened[1]) < lines
    assert broker.execution_count(sandbox.name) == 1


def test_a_streamed_start_dropped_before_the_command_id_is_raised_not_retried(
    broker: Any, sandbox: Sandbox
) -> None:
    broker.drop_event_stream_mid_line(1, after_events=0, sandbox=sandbox.name)
    with pytest.raises(BrokerUnavailableError, match=r"start a command.*not idempotent"):
        sandbox.commands.run(["echo", "once"])
    assert broker.execution_count(sandbox.name) == 1
    assert [list(c.command) for c in sandbox.commands.list()] == [["echo", "once"]]  # ran once


@pytest.mark.dialect_feature(SANDBOX_ENV, reason="the runtime is told through it")
def test_a_runtime_without_the_streamed_start_answers_json_and_events_follow(
    broker: Any, streams_opened: Any
) -> None:
    env = {"SANDBOX_COMMAND_STREAM_START": "0"}  # the local runtime as one without it
    with Sandbox.create(environ=broker.environ("kubernetes"), env=env) as sandbox:
        opened = streams_opened(sandbox)
        chunks: list[str] = []
        result = sandbox.commands.run(
            "echo a; sleep 0.2; echo b >&2; exit 4", on_stdout=chunks.append
        )
        assert (result.stdout, result.stderr, result.exit_code) == ("a\n", "b\n", 4)
        assert chunks == ["a\n"] and opened == ["POST", "0"]
        assert broker.execution_count(sandbox.name) == 1


# ----------------------------------------------------------------------- legacy runtimes


@RPC_SMOKE
def test_a_runtime_without_managed_commands_falls_back_to_execute(legacy_broker: Any) -> None:
    with Sandbox.create(environ=legacy_broker.environ("kubernetes")) as sandbox:
        result = sandbox.commands.run("echo a | tr a b; cd /tmp && pwd")
        assert (result.stdout, result.exit_code, result.command_id) == ("b\n/tmp\n", 0, None)
        assert sandbox.commands.run(["echo", "a | b"]).stdout == "a | b\n"
        assert sandbox.commands.run("printf '%s|' 'a b' c", shell=False).stdout == "a b|c|"
        assert legacy_broker.execution_count(sandbox.name) == 4  # 1 POST /commands + 3 /execute


def test_options_an_old_runtime_cannot_honour_are_refused_and_nothing_runs(
    legacy_broker: Any, managed_only_options: list[tuple[str, dict[str, Any]]]
) -> None:
    with Sandbox.create(environ=legacy_broker.environ("kubernetes")) as sandbox:
        # the first call learns from POST /commands' 404 that the runtime is old: it raises
        # instead of running the command through /execute without live output
        with pytest.raises(UnsupportedByRuntimeError) as info:
            sandbox.commands.run("echo ran >> marker", on_stdout=print)
        message = str(info.value)
        for needle in ("on_stdout", "POST /commands", "v0.3.0", "v0.11.0", "Recreate"):
            assert needle in message
        assert info.value.options == ("on_stdout",)
        assert isinstance(info.value, NotImplementedError)
        assert legacy_broker.execution_count(sandbox.name) == 1  # the 404, no /execute
        for name, options in managed_only_options:  # remembered: refused before any request
            with pytest.raises(UnsupportedByRuntimeError, match=rf"{name}.*Recreate") as info:
                sandbox.commands.run("echo ran >> marker", **options)
            assert name in info.value.options
        assert legacy_broker.execution_count(sandbox.name) == 1
        check = sandbox.commands.run("test -e marker && echo ran || echo never")
        assert check.stdout == "never\n"  # the refused commands never ran
        assert legacy_broker.execution_count(sandbox.name) == 2  # straight to /execute


def test_background_first_on_an_old_runtime_is_refused(legacy_broker: Any) -> None:
    with Sandbox.create(environ=legacy_broker.environ("kubernetes")) as sandbox:
        with pytest.raises(UnsupportedByRuntimeError, match=r"background.*v0\.3\.0.*Recreate"):
            sandbox.commands.run("echo ran >> marker", background=True, stdin=True)
        assert sandbox.commands.run("test -e marker || echo never").stdout == "never\n"
        assert legacy_broker.execution_count(sandbox.name) == 2  # the 404, then /execute


def test_cli_run_on_an_old_runtime_prints_the_output_at_the_end(legacy_broker: Any) -> None:
    proc = cli_run(legacy_broker, "sh", "-c", "echo out; echo err >&2; exit 3")
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (3, "out\n"), err
    assert "err\n" in err and "Traceback" not in err


def cli_run(broker: Any, *argv: str) -> subprocess.Popen[str]:
    """``agent-sandbox-awx run -- ARGV`` in a child process, its output piped."""
    env = {
        **os.environ,
        **broker.environ("kubernetes"),
        "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTHONFAULTHANDLER": "1",  # SIGABRT prints every thread's stack (see exit_after)
    }
    cli = [sys.executable, "-m", "k8s_agent_sandbox_awx.cli._cli", "run", "--", *argv]
    pipe = subprocess.PIPE
    return subprocess.Popen(cli, env=env, stdout=pipe, stderr=pipe, text=True)


def test_cli_run_streams_and_exits_with_the_command_code(broker: Any) -> None:
    proc = cli_run(broker, "sh", "-c", "echo first; sleep 1; echo second; exit 7")
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first == "first\n" and proc.poll() is None  # printed while the command still runs
    rest, err = proc.communicate(timeout=60)
    assert (proc.returncode, rest) == (7, "second\n"), err
    assert "Traceback" not in err


def exit_after(proc: subprocess.Popen[str], within: float) -> tuple[str, str]:
    """``proc``'s remaining output once it exits; if it has not within ``within`` s, the test
    fails with its stderr and the stack of each of its threads (faulthandler, at SIGABRT)."""
    try:
        return proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the CLI did not exit within {within:g}s; its stderr and stacks:\n{err}")


@host_processes_only(HOST_PIDS)
def test_cli_run_ctrl_c_kills_the_remote_command(broker: Any, process_gone: Any) -> None:
    proc = cli_run(broker, "sh", "-c", "echo $$; exec sleep 60")
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    _, err = exit_after(proc, 60)  # 30 s at most to clean up (_run.CLEANUP_TIMEOUT), and more
    assert proc.returncode == 130 and "interrupted" in err, err
    assert process_gone(pid)
    assert broker.sandboxes() == []  # and the sandbox is gone too


def cli_with_stuck_kill(
    broker: Any, monkeypatch: pytest.MonkeyPatch, *, second_ctrl_c: bool
) -> tuple[int, str]:
    """``agent-sandbox-awx run`` in this process, Ctrl-C at the command's first output, and a
    kill request that never returns (in the field: a lock an interrupted library call left
    held); ``second_ctrl_c``: Ctrl-C again once the kill is stuck. Its exit code and stderr.
    A hang is ended by a Ctrl-C after 20 s and fails the test."""
    from k8s_agent_sandbox_awx.cli import _cli, _run
    from k8s_agent_sandbox_awx.client.http._transport import BrokerTransport

    for key, value in broker.environ("kubernetes").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    if not second_ctrl_c:
        monkeypatch.setattr(_run, "CLEANUP_TIMEOUT", 0.5)
    call, writer = BrokerTransport.call, _run._writer
    stuck = threading.Event()

    def kill_that_never_returns(self: Any, step: Any, sent: Any = None) -> Any:
        if step.spec.path.endswith("/kill"):
            stuck.set()
            if second_ctrl_c:
                threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            threading.Event().wait()  # a wait without a limit (a signal handler may raise)
        return call(self, step, sent)

    def ctrl_c_at_first_output(stream: Any) -> Any:
        write = writer(stream)

        def first(text: str) -> None:
            write(text)
            if not stuck.is_set():
                threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()

        return first

    rescued: list[bool] = []

    def rescue_ctrl_c() -> None:
        rescued.append(True)
        os.kill(os.getpid(), signal.SIGINT)

    rescue = threading.Timer(20, rescue_ctrl_c)
    monkeypatch.setattr(BrokerTransport, "call", kill_that_never_returns)
    monkeypatch.setattr(_run, "_writer", ctrl_c_at_first_output)
    err = io.StringIO()
    rescue.start()  # a bound for the hang, not a speed check
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = _cli.main(["run", "--", "sh", "-c", "echo started; exec sleep 60"])
    finally:
        rescue.cancel()
    assert stuck.is_set() and not rescued, "the CLI waited for the stuck kill: " + err.getvalue()
    return code, err.getvalue()


def test_cli_run_cleanup_stuck_after_ctrl_c_is_cut_and_the_sandbox_deleted(
    broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the cleanup's time limit the stuck step is cut, and the sandbox is deleted on new
    connections (the old ones may be what is stuck): a plain interruption, nothing left."""
    code, err = cli_with_stuck_kill(broker, monkeypatch, second_ctrl_c=False)
    assert code == 130 and "interrupted" in err, err
    deadline = time.monotonic() + 10
    while broker.sandboxes() and time.monotonic() < deadline:
        time.sleep(0.05)  # deleted; the local runtime is still stopping
    assert broker.sandboxes() == []


def test_cli_run_second_ctrl_c_cuts_the_cleanup_and_names_the_sandbox(
    broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, err = cli_with_stuck_kill(broker, monkeypatch, second_ctrl_c=True)
    assert code == 130 and "a second Ctrl-C stopped it" in err, err
    assert re.search(r"sandbox \S+ \(and the command in it\) may be left; delete it with", err)


def test_sequential_runs_reuse_one_connection(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event stream is read to its end after the exit event, so that its connection goes
    back to the pool (closing it early cost a TLS handshake per command)."""
    import httpcore

    opened: list[Any] = []
    create = httpcore.ConnectionPool.create_connection

    def counting(self: Any, origin: Any) -> Any:
        opened.append(origin)
        return create(self, origin)

    sandbox.commands.run("true")  # a connection is open and idle now
    monkeypatch.setattr(httpcore.ConnectionPool, "create_connection", counting)
    for _ in range(5):
        assert sandbox.commands.run(["echo", "hi"]).stdout == "hi\n"
    assert opened == []


def test_output_no_longer_retained_is_skipped_and_flagged(sandbox: Sandbox) -> None:
    """Nobody follows a command that prints 3 MB: past the runtime's 1 MiB cap its oldest live
    events are dropped; a later reader gets 410 for them, goes on after them and says so."""
    handle = sandbox.commands.run(
        "head -c 1048576 /dev/zero | tr '\\0' a; head -c 2000000 /dev/zero | tr '\\0' b; echo end",
        background=True,
    )
    deadline = time.monotonic() + 60
    while handle.status().running and time.monotonic() < deadline:
        time.sleep(0.2)  # not read: the runtime keeps the first 1 MiB and a live window
    result = sandbox.commands.get(handle.command_id).wait()
    assert (result.exit_code, result.output_truncated) == (0, True)
    assert result.stdout.startswith("a" * 1048576) and result.stdout.endswith("bbend\n")
    assert len(result.stdout) < 3000000 + 4  # the dropped part is not there
