"""AsyncSandbox.pty end to end: the sync suite's terminal rules through the async transport —
size and resize (``stty size``, a ``SIGWINCH`` trap), Ctrl-C interrupting ``sleep``, a stream
cut and dropped mid-line losing no byte (``async for`` and a coroutine ``on_data``), kill and
wait, envs/cwd, bytes that are not UTF-8 both ways, and a runtime without terminals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from k8s_agent_sandbox_awx import AsyncPtyHandle, AsyncSandbox
from k8s_agent_sandbox_awx.errors import CommandWaitTimeoutError, UnsupportedByRuntimeError
from tests._support.terminal import Screen, produced, producer_argv

pytestmark = pytest.mark.e2e
T = TypeVar("T")

WINCH_TRAP = (
    "trap 'echo winch; stty size' WINCH; stty size; echo ready; while :; do sleep 0.05; done"
)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def create(broker: Any, **env: str) -> AsyncSandbox:
    return await AsyncSandbox.create(environ=broker.environ("kubernetes"), env=env or None)


def test_size_resize_and_sigwinch(broker: Any, dialect: str) -> None:
    async def main() -> None:
        async with await create(broker) as sandbox:
            screen = Screen()
            term = await sandbox.pty.create(100, 30, on_data=screen)
            assert isinstance(term, AsyncPtyHandle) and (await term.status()).pty == (100, 30)
            await term.send_stdin("stty size\r")
            await screen.aexpect(rb"\r30 100\r\n")
            await term.resize(132, 43)
            await term.send_stdin(b"stty size; exit 3\r")
            await screen.aexpect(rb"\r43 132\r\n")
            assert (await term.wait(timeout=15)).exit_code == 3

            trapped = Screen()
            term = await sandbox.pty.create(command=WINCH_TRAP, on_data=trapped)
            await trapped.aexpect(rb"24 80\r\nready\r\n")
            await term.resize(90, 20)
            await trapped.aexpect(rb"winch\r\n20 90\r\n")
            assert (await term.kill()).state == "cancelled"

    run(main())


def test_ctrl_c_interrupts_sleep_kill_and_wait(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker) as sandbox:
            screen = Screen()
            term = await sandbox.pty.create(on_data=screen)
            await term.send_stdin("echo sta''rted; sleep 100\r")
            await screen.aexpect(rb"\rstarted\r\n")
            await asyncio.sleep(0.3)
            begun = time.monotonic()
            await term.send_stdin(b"\x03")
            await term.send_stdin("echo rc=$?\r")
            await screen.aexpect(rb"\rrc=130\r\n")
            assert time.monotonic() - begun < 10
            with pytest.raises(CommandWaitTimeoutError, match="still running"):
                await term.wait(timeout=0.3)  # the terminal goes on, and so does its reader
            await term.send_stdin("echo still\r")
            await screen.aexpect(rb"\rstill\r\n")
            killed = await term.kill()
            assert (killed.state, killed.exit_code) == ("cancelled", 137)
            assert (await term.wait(timeout=15)).state == "cancelled"

    run(main())


def test_a_stream_cut_and_dropped_mid_line_loses_and_repeats_no_byte(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker) as sandbox:
            broker.cut_event_streams(after_events=40, sandbox=sandbox.name)
            broker.drop_event_stream_mid_line(3, after_events=7, sandbox=sandbox.name)
            term = await sandbox.pty.create(command=producer_argv(800))
            chunks = [chunk async for chunk in term]
            assert all(isinstance(chunk, bytes) for chunk in chunks)
            assert b"".join(chunks) == produced(800) and len(chunks) >= 200

            broker.drop_event_stream_mid_line(3, after_events=11, sandbox=sandbox.name)
            received: list[bytes] = []

            async def on_data(chunk: bytes) -> None:  # a coroutine function
                await asyncio.sleep(0)
                received.append(chunk)

            term = await sandbox.pty.create(command=producer_argv(500), on_data=on_data)
            assert (await term.wait(timeout=60)).exit_code == 0
            assert b"".join(received) == produced(500)

    run(main())


def test_envs_cwd_and_bytes_that_are_not_utf8(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker) as sandbox:
            term = await sandbox.pty.create(
                command='echo "$A $TERM"; pwd; printf "\\377\\376"', envs={"A": "b"}, cwd="/tmp"
            )
            assert b"".join([c async for c in term]) == b"b xterm-256color\r\n/tmp\r\n\xff\xfe"
            screen = Screen()
            term = await sandbox.pty.create(
                command="stty raw -echo; echo ready; head -c 3 | od -An -tx1", on_data=screen
            )
            await screen.aexpect(rb"ready")
            await term.send_stdin(b"\xff\x00\x03")
            await screen.aexpect(rb"ff 00 03")
            assert (await term.wait(timeout=15)).exit_code == 0

    run(main())


def test_a_runtime_without_terminals_is_unsupported(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker, SANDBOX_COMMAND_PTY="0") as sandbox:
            with pytest.raises(UnsupportedByRuntimeError, match="no terminals") as info:
                await sandbox.pty.create()
            assert info.value.options == ("pty",)

    run(main())


def test_closing_the_sandbox_under_a_reading_terminal_logs_no_warning(
    broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        screen = Screen()
        async with await create(broker) as sandbox:
            term = await sandbox.pty.create(command="echo up; sleep 100", on_data=screen)
            await screen.aexpect(rb"up\r\n")
        assert term._reader is not None
        await asyncio.wait([term._reader], timeout=10)
        assert term._reader.done()

    run(main())
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "terminal" in r.message]
