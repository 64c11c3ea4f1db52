"""Issue 30, E2B habits: what an E2B user types gets the right spelling or a message that
says what it is here (``sbx.get_host``, ``commands.kill(pid)``, ``pty`` by id,
``pty.create(size=...)``). Each test reads what the SDK's user sees: ``str(exc)`` or the
result."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import pytest

from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox
from k8s_agent_sandbox_awx.errors import UnsupportedOperationError
from tests._support.terminal import Screen

pytestmark = pytest.mark.e2e


@dataclass
class PtySize:  # E2B's shape: rows and cols
    rows: int
    cols: int


def test_get_host_on_the_sandbox_and_kill_by_pid_and_pty_by_id(broker: Any) -> None:
    """Item 14: ``sbx.get_host(8000)`` was an AttributeError; now the typed error of
    ``sbx.ports.get_host`` with its guidance. Item 15: ``commands.kill(20)`` said "command_id
    must be the non-empty id ..., got 20"; the terminal by id (``pty.send_stdin(pid, ...)``,
    ``pty.resize(pid, size)``, ``pty.kill(pid)``, ``.pid``, ``pty.create(size=...)``)."""
    with Sandbox.create(environ=broker.environ("kubernetes")) as sbx:
        with pytest.raises(UnsupportedOperationError) as info:
            sbx.get_host(8000)
        assert (
            "sandbox.ports.forward(8000)" in str(info.value) and info.value.operation == "get_host"
        )
        with pytest.raises(ValueError) as killed:
            sbx.commands.kill(20)  # type: ignore[arg-type]
        said = str(killed.value)
        assert "20 is not a command id" in said and "handle.command_id" in said, said
        assert "commands.list()" in said and "pid" in said
        screen = Screen()
        term = sbx.pty.create(size=PtySize(rows=30, cols=100), on_data=screen)
        assert term.pid == term.command_id and term.status().pty == (100, 30)
        sbx.pty.resize(term.pid, PtySize(rows=20, cols=90))
        assert term.status().pty == (90, 20)
        sbx.pty.send_stdin(term.pid, "stty size\r")
        screen.expect(rb"\r20 90\r\n")
        assert sbx.pty.kill(term.pid).state == "cancelled"
        with pytest.raises(TypeError, match="not both"):
            sbx.pty.create(80, size=PtySize(rows=1, cols=1))


def test_the_async_sandbox_has_the_same_spellings(broker: Any) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(environ=broker.environ("kubernetes")) as sbx:
            with pytest.raises(UnsupportedOperationError, match=r"ports\.forward\(8000\)"):
                sbx.get_host(8000)
            term = await sbx.pty.create(size=PtySize(rows=25, cols=81))
            assert term.pid == term.command_id and (await term.status()).pty == (81, 25)
            await sbx.pty.resize(term.pid, cols=82, rows=26)
            assert (await term.status()).pty == (82, 26)
            await sbx.pty.send_stdin(term.pid, b"exit 4\r")
            assert (await term.wait(timeout=15)).exit_code == 4
            assert (await sbx.pty.kill(term.pid)).state == "exited"  # already ended: its end

    asyncio.run(scenario())


def test_readers_end_quietly_when_this_process_deleted_the_sandbox(
    broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 16: ``Sandbox.kill(sbx.sandbox_id)`` on the class worked, but the readers of the
    same process's background command and terminal then printed "stopped following the output
    of command ..." and "the output of terminal ... is no longer read: BrokerNotFoundError" (the
    instance's ``sbx.kill()`` was quiet). Now they end quietly; ``wait()`` may still raise."""
    environ = broker.environ("kubernetes")
    sbx = Sandbox.create(environ=environ)
    seen: list[str] = []
    command = sbx.commands.run(
        ["sh", "-c", "echo up; exec sleep 300"], background=True, timeout=0, on_stdout=seen.append
    )
    screen = Screen()
    term = sbx.pty.create(command=["sh", "-c", "echo ready; exec sleep 300"], on_data=screen)
    screen.expect(rb"ready")
    caplog.set_level(logging.WARNING, logger="k8s_agent_sandbox_awx")
    assert Sandbox.kill(sbx.sandbox_id, environ=environ) is True
    for handle in (command, term):
        try:
            handle.wait(timeout=30)
        except Exception as exc:  # the sandbox is gone: wait() may say so
            assert "CommandWaitTimeout" not in type(exc).__name__, exc
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "no longer read" in m or "stopped following" in m], said
    sbx.close_connection()


def test_the_documented_shell_without_profile_scripts_runs_none(broker: Any) -> None:
    """Item 6 (the docs' way): a login shell runs the profile scripts it finds (on the local
    runtime, the host user's, whose complaints reach the terminal); docs/client.md says how to
    choose a shell that runs none, and that spelling does: a profile that would speak is
    silent."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs/client.md").read_text()
    assert 'pty.create(command=["bash", "--noprofile", "--norc"])' in text
    assert "agent-sandbox-awx shell NAME -- bash --noprofile --norc" in text
    with Sandbox.create(environ=broker.environ("kubernetes")) as sbx:
        sbx.files.write("profile-home/.bash_profile", "echo PROFILE-RAN\n")
        home = sbx.commands.run("cd profile-home && pwd").stdout.strip()
        for argv, ran in ((["bash", "-l"], True), (["bash", "--noprofile", "--norc"], False)):
            screen = Screen()
            term = sbx.pty.create(command=argv, envs={"HOME": home}, on_data=screen)
            term.send_stdin("echo DONE-$((6*7)); exit\r")
            screen.expect(rb"DONE-42")
            term.wait(timeout=15)
            assert (b"PROFILE-RAN" in screen.data) is ran, (argv, screen.data)
