"""``agent-sandbox-awx shell`` under a real terminal: the CLI runs in a child process whose
controlling terminal is a pseudo-terminal this test holds (so a resize of it is a kernel
``SIGWINCH`` to the CLI, as in a terminal emulator). The remote terminal has the local one's
size and follows its resizes, Ctrl-C interrupts the remote ``sleep`` (not the CLI), the CLI
exits with the remote exit code, the local terminal's attributes are restored, ``--new``
deletes its sandbox (``--keep`` keeps it), and without a terminal the CLI refuses clearly."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx import Sandbox
from tests._support.terminal import Screen

pytestmark = pytest.mark.e2e


def set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Tty:
    """The CLI on a pseudo-terminal: ``screen`` is what it shows, ``type`` types into it."""

    def __init__(self, broker: Any, *argv: str, rows: int = 30, cols: int = 100) -> None:
        self.master, self.slave = os.openpty()
        set_size(self.master, rows, cols)
        self.before = termios.tcgetattr(self.slave)
        env = {
            **os.environ,
            **broker.environ("kubernetes"),
            "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
            "PYTHONFAULTHANDLER": "1",
        }
        cli = [sys.executable, "-m", "k8s_agent_sandbox_awx.cli._cli", "shell", *argv]
        self.proc = subprocess.Popen(  # its own session, the pty its controlling terminal
            cli,
            env=env,
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        self.screen = Screen()
        self.after: list[Any] | None = None  # the terminal's attributes once the CLI is gone
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # EIO: every writer of the pty is gone
            while chunk := os.read(self.master, 65536):
                self.screen(chunk)

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def exit_code(self, within: float = 30) -> int:
        """The CLI's exit code, once it has exited and ``screen`` holds all it wrote: the
        terminal's attributes are kept in ``after``, then this side of the pty is closed so
        the reader reads to the end (EIO) instead of racing the exit."""
        try:
            code = self.proc.wait(within)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # its threads' stacks, on the screen
            self.proc.wait(10)
            pytest.fail(f"the CLI did not exit within {within}s: {bytes(self.screen.data)!r}")
        self.after = termios.tcgetattr(self.slave)
        self._close_slave()
        self._reader.join(10)
        assert not self._reader.is_alive(), "the pty still has a writer after the CLI exited"
        return code

    def _close_slave(self) -> None:
        if self.slave >= 0:
            os.close(self.slave)
            self.slave = -1

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_slave()
        os.close(self.master)


@pytest.fixture
def tty(broker: Any) -> Iterator[Any]:
    made: list[Tty] = []

    def start(*argv: str, **size: int) -> Tty:
        made.append(Tty(broker, *argv, **size))
        return made[-1]

    yield start
    for one in made:
        one.close()


def test_shell_new_follows_the_terminal_and_exits_with_the_remote_code(
    broker: Any, tty: Any
) -> None:
    term = tty("--new")
    term.type(b"stty size\r")
    term.screen.expect(rb"\r30 100\r\n")  # the local terminal's size
    set_size(term.master, 40, 120)  # the kernel sends SIGWINCH to the CLI
    time.sleep(0.2)
    term.type(b"stty size\r")
    term.screen.expect(rb"\r40 120\r\n")
    term.type(b"echo sta''rted; sleep 100\r")
    term.screen.expect(rb"\rstarted\r\n")
    time.sleep(0.3)
    term.type(b"\x03")  # raw mode: a byte for the remote terminal, not a local SIGINT
    term.type(b"echo rc=$?\r")
    term.screen.expect(rb"\rrc=130\r\n")
    assert term.proc.poll() is None
    [sandbox] = broker.sandboxes()
    term.type(b"exit 3\r")
    assert term.exit_code() == 3
    assert term.after == term.before  # the local terminal restored
    assert broker.sandboxes() == []  # --new: deleted at the end
    del sandbox


def test_shell_name_keeps_the_sandbox_and_runs_a_given_command(broker: Any, tty: Any) -> None:
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        sandbox.commands.run("echo hi > greeting")
        term = tty(sandbox.name, "--", "sh", "-c", "cat greeting; read x; exit $x")
        term.screen.expect(rb"hi\r\n")
        term.type(b"7\r")
        assert term.exit_code() == 7
        assert term.after == term.before
        assert sandbox.is_running() and sandbox.commands.run("cat greeting").stdout == "hi\n"

        kept = tty("--new", "--keep", "--", "sh", "-c", "exit 0")
        assert kept.exit_code() == 0
        assert b"(kept)" in kept.screen.data
        assert len(broker.sandboxes()) == 2


def test_an_error_mid_session_restores_the_terminal(broker: Any, tty: Any) -> None:
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        term = tty(sandbox.name)
        term.type(b"echo sta''rted\r")
        term.screen.expect(rb"\rstarted\r\n")
        sandbox.kill()  # the sandbox goes away under the session
        assert term.exit_code(60) != 0
        assert term.after == term.before
        assert b"error" in term.screen.data


class _Ended:
    name = "sbx-gone"

    def __init__(self, running: bool) -> None:
        self.running, self.asked = running, 0

    def is_running(self) -> bool:
        self.asked += 1
        return self.running


def test_a_program_killed_with_its_sandbox_is_an_error_naming_the_sandbox() -> None:
    """The runtime may report the terminal's program killed (137) before its sandbox is gone:
    the session's end then says why, not a bare 137 (the race of the test above)."""
    from k8s_agent_sandbox_awx.cli._shell import _exit_code
    from k8s_agent_sandbox_awx.errors import SandboxNotFoundError

    with pytest.raises(SandboxNotFoundError, match=r"sandbox 'sbx-gone' ended during the session"):
        _exit_code(_Ended(running=False), 137)
    alive = _Ended(running=True)
    assert _exit_code(alive, 137) == 137  # `kill -9 $$` in a sandbox that lives on
    quiet = _Ended(running=False)
    assert _exit_code(quiet, 3) == 3 and quiet.asked == 0  # a plain exit asks nothing


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_cli_restores_the_terminal_and_kills_the_remote_one(
    broker: Any, tty: Any, signum: int
) -> None:
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        term = tty(sandbox.name)
        term.type(b"echo sta''rted\r")
        term.screen.expect(rb"\rstarted\r\n")
        term.proc.send_signal(signum)
        assert term.exit_code() == 128 + signum
        assert term.after == term.before
        [remote] = sandbox.commands.list()
        assert remote.pty is not None and remote.state == "cancelled"
        assert sandbox.is_running()  # shell NAME leaves the sandbox


def test_shell_refuses_without_a_terminal_and_before_making_a_sandbox(broker: Any) -> None:
    env = {
        **os.environ,
        **broker.environ("kubernetes"),
        "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    cli = [sys.executable, "-m", "k8s_agent_sandbox_awx.cli._cli", "shell"]
    proc = subprocess.run(
        [*cli, "--new"], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "shell needs a terminal" in proc.stderr, proc.stderr
    assert "standard input is not one" in proc.stderr and broker.sandboxes() == []
    proc = subprocess.run(cli, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    assert proc.returncode == 2 and "give a sandbox NAME or --new" in proc.stderr


@pytest.mark.parametrize(
    ("argv", "split"),
    [
        (["shell", "--new", "--", "sh", "-c", "x"], (["shell", "--new"], ["sh", "-c", "x"])),
        (
            ["--broker-url", "u", "shell", "n", "--", "top"],
            (["--broker-url", "u", "shell", "n"], ["top"]),
        ),
        (["shell", "n"], (["shell", "n"], None)),
        (
            ["run", "--", "echo", "shell", "--", "x"],
            (["run", "--", "echo", "shell", "--", "x"], None),
        ),
        (
            ["--broker-url", "shell", "run", "--", "x"],
            (["--broker-url", "shell", "run", "--", "x"], None),
        ),
    ],
)
def test_the_command_after_dashes_is_split_off_for_shell_only(
    argv: list[str], split: tuple[list[str], list[str] | None]
) -> None:
    from k8s_agent_sandbox_awx.cli import _cli

    assert _cli._split_command(argv) == split


def test_options_of_new_without_it_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from k8s_agent_sandbox_awx.cli import _cli

    assert _cli.main(["shell", "n", "--keep"]) == 2
    assert "--keep, --template and --ready-timeout go with --new" in capsys.readouterr().err
    assert _cli.main(["shell", "n", "--new"]) == 2
