"""sandbox.pty end to end (sync) against the local broker: the terminal's size (``stty size``)
and its resize (seen by ``stty`` and by a ``SIGWINCH`` trap), Ctrl-C interrupting ``sleep``, an
output stream cut and dropped mid-line losing no byte, kill, wait and the exit code, envs/cwd,
bytes that are not UTF-8 both ways, reattaching, and runtimes without terminals. The data plane
is the same under both dialects but for its routing header: the first test runs under each."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx import PtyHandle, Sandbox
from k8s_agent_sandbox_awx.errors import CommandWaitTimeoutError, UnsupportedByRuntimeError
from tests._support.terminal import Screen, produced, producer_argv

pytestmark = pytest.mark.e2e

WINCH_TRAP = (
    "trap 'echo winch; stty size' WINCH; stty size; echo ready; while :; do sleep 0.05; done"
)


@pytest.fixture
def sandbox(broker: Any) -> Iterator[Sandbox]:
    with Sandbox.create(environ=broker.environ("kubernetes")) as sb:
        yield sb


def test_stty_size_shows_the_size_and_a_resize_changes_it(broker: Any, dialect: str) -> None:
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        screen = Screen()
        term = sandbox.pty.create(100, 30, on_data=screen)
        assert isinstance(term, PtyHandle) and term.status().pty == (100, 30)
        term.send_stdin("stty size\r")
        screen.expect(rb"\r30 100\r\n")
        term.resize(132, 43)
        assert term.status().pty == (132, 43)
        term.send_stdin(b"stty size; exit 3\r")
        screen.expect(rb"\r43 132\r\n")
        result = term.wait(timeout=15)
        assert (result.exit_code, result.state) == (3, "exited")

        trapped = Screen()  # the program in the foreground gets SIGWINCH
        term = sandbox.pty.create(80, 24, command=WINCH_TRAP, on_data=trapped)
        trapped.expect(rb"24 80\r\nready\r\n")
        term.resize(90, 20)
        trapped.expect(rb"winch\r\n20 90\r\n")
        assert term.kill().state == "cancelled"


def test_ctrl_c_interrupts_sleep_in_the_shell(sandbox: Sandbox) -> None:
    screen = Screen()
    term = sandbox.pty.create(on_data=screen)  # the login shell
    term.send_stdin("echo sta''rted; sleep 100\r")
    screen.expect(rb"\rstarted\r\n")
    time.sleep(0.3)  # sleep is in the foreground now
    begun = time.monotonic()
    term.send_stdin(b"\x03")
    term.send_stdin("echo rc=$?\r")
    screen.expect(rb"\rrc=130\r\n")  # 128 + SIGINT: interrupted, not ended
    assert time.monotonic() - begun < 10
    term.send_stdin("exit 5\r")
    assert term.wait(timeout=15).exit_code == 5


def test_a_program_killed_by_ctrl_c_ends_the_terminal(sandbox: Sandbox) -> None:
    screen = Screen()
    term = sandbox.pty.create(command=["sh", "-c", "echo ready; exec sleep 100"], on_data=screen)
    screen.expect(rb"ready\r\n")
    term.send_stdin("\x03")
    result = term.wait(timeout=15)
    assert (result.exit_code, result.state) == (130, "exited")  # 128 + SIGINT


def test_a_stream_cut_and_dropped_mid_line_loses_and_repeats_no_byte(
    broker: Any, sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker.cut_event_streams(after_events=40, sandbox=sandbox.name)
    broker.drop_event_stream_mid_line(3, after_events=7, sandbox=sandbox.name)
    transport = sandbox.pty._transport
    opened: list[int] = []
    events = transport.events

    def counting(spec: Any, **options: Any) -> Any:
        opened.append(int(spec.params.get("after", 0)))
        return events(spec, **options)

    monkeypatch.setattr(transport, "events", counting)
    term = sandbox.pty.create(command=producer_argv(800))
    chunks = list(term)  # iteration yields the output bytes
    assert all(isinstance(chunk, bytes) for chunk in chunks)
    assert b"".join(chunks) == produced(800)  # byte for byte: no loss, no repeat
    assert len(chunks) >= 200  # that many events: the cuts are not vacuous
    assert len(opened) >= len(chunks) // 40 >= 5 and opened == sorted(opened)
    assert term.wait().exit_code == 0


def test_kill_ends_the_terminal_and_wait_returns_its_result(sandbox: Sandbox) -> None:
    screen = Screen()
    term = sandbox.pty.create(command="echo up; sleep 100", on_data=screen)
    screen.expect(rb"up\r\n")
    with pytest.raises(CommandWaitTimeoutError, match="still running"):
        term.wait(timeout=0.3)  # the terminal goes on
    assert term.status().running
    killed = term.kill()
    assert (killed.state, killed.exit_code, killed.command_id) == (
        "cancelled",
        137,
        term.command_id,
    )
    assert term.wait(timeout=15).state == "cancelled" and term.kill().state == "cancelled"
    assert not term.status().running


def test_envs_cwd_and_term(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(command='echo "$A $TERM"; pwd', envs={"A": "b"}, cwd="/tmp")
    assert b"".join(term) == b"b xterm-256color\r\n/tmp\r\n"
    mine = sandbox.pty.create(command="echo $TERM", envs={"TERM": "dumb"})
    assert b"".join(mine) == b"dumb\r\n"


def test_bytes_that_are_not_utf8_go_both_ways_exactly(sandbox: Sandbox) -> None:
    out = sandbox.pty.create(command=["printf", "\\377\\376ok\\303\\n"])
    assert b"".join(out) == b"\xff\xfeok\xc3\r\n"
    screen = Screen()
    term = sandbox.pty.create(
        command="stty raw -echo; echo ready; head -c 4 | od -An -tx1", on_data=screen
    )
    screen.expect(rb"ready")
    term.send_stdin(bytearray(b"\xff\x00\xfe\x03"))  # raw mode: Ctrl-C is a byte like another
    screen.expect(rb"ff 00 fe 03")
    assert term.wait(timeout=15).exit_code == 0


def test_reattach_replays_the_output_and_a_pipe_command_is_no_terminal(sandbox: Sandbox) -> None:
    screen = Screen()
    term = sandbox.pty.create(command="echo one; read x; echo got $x", on_data=screen)
    screen.expect(rb"one\r\n")
    again = sandbox.pty.connect(term.command_id)  # another handle, as another process has
    again.send_stdin("two\r")
    assert b"".join(again) == b"one\r\ntwo\r\ngot two\r\n"  # replayed from the start
    assert term.wait(timeout=15).exit_code == 0 and screen.data == b"one\r\ntwo\r\ngot two\r\n"
    piped = sandbox.commands.run("sleep 30", background=True)
    with pytest.raises(ValueError, match="does not run on a terminal"):
        sandbox.pty.connect(piped.command_id)
    piped.kill()


def test_the_on_data_handle_is_not_iterated(sandbox: Sandbox) -> None:
    screen = Screen()
    term = sandbox.pty.create(command="echo hi", on_data=screen)
    with pytest.raises(TypeError, match="on_data"):
        list(term)
    with pytest.raises(ValueError, match="on_data"):
        term.wait(on_data=print)
    assert term.wait(timeout=15).exit_code == 0 and bytes(screen.data) == b"hi\r\n"


def test_a_runtime_without_terminals_is_unsupported_and_nothing_runs(
    broker: Any, legacy_broker: Any
) -> None:
    with Sandbox.create(
        environ=broker.environ("kubernetes"), env={"SANDBOX_COMMAND_PTY": "0"}
    ) as sandbox:
        before = broker.execution_count(sandbox.name)
        with pytest.raises(UnsupportedByRuntimeError, match="no terminals") as info:
            sandbox.pty.create(command="echo ran > ran")
        assert info.value.options == ("pty",)
        assert broker.execution_count(sandbox.name) == before + 1  # one start, refused
        assert sandbox.commands.run("ls").stdout == ""
    with Sandbox.create(environ=legacy_broker.environ("kubernetes")) as legacy:
        with pytest.raises(UnsupportedByRuntimeError, match="no managed commands"):
            legacy.pty.create()


def test_closing_the_sandbox_under_a_reading_terminal_logs_no_warning(
    broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    screen = Screen()
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        term = sandbox.pty.create(command="echo up; sleep 100", on_data=screen)
        screen.expect(rb"up\r\n")
    assert term._reader is not None and term._reader.done.wait(10)  # it ended
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "terminal" in r.message]
