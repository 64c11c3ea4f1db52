"""commands.run and background commands end to end through AsyncSandbox: the sync suite's rules
with coroutine callbacks, cancellation killing the remote process group, async iteration, and 64
background commands waited concurrently from one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from k8s_agent_sandbox_awx import AsyncCommandHandle, AsyncSandbox
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    BrokerUnavailableError,
    CommandTimeoutError,
    CommandWaitTimeoutError,
    UnsupportedByRuntimeError,
)

pytestmark = pytest.mark.e2e
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def create(broker: Any, **env: str) -> AsyncSandbox:
    return await AsyncSandbox.create(environ=broker.environ("kubernetes"), env=env or None)


def test_shell_rules_envs_cwd_and_errors_before_sending(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker, BASE_VAR="base") as sandbox:
            assert (await sandbox.commands.run("echo a | tr a b")).stdout == "b\n"
            assert (await sandbox.commands.run(["echo", "a | b"])).stdout == "a | b\n"
            split = await sandbox.commands.run("printf '%s|' 'a b' $HOME", shell=False)
            assert split.stdout == "a b|$HOME|"
            result = await sandbox.commands.run(
                'echo "$BASE_VAR $MINE"; pwd', envs={"MINE": "m"}, cwd="/tmp"
            )
            assert result.stdout == "base m\n/tmp\n"
            for command, options in (
                (["echo"], {"shell": True}),
                ("cat", {"stdin": True}),
                ("", {}),
                ("a\0b", {}),
            ):
                with pytest.raises(ValueError):
                    await sandbox.commands.run(command, **options)
            assert broker.execution_count(sandbox.name) == 4  # only the four runs above

    run(main())


def test_coroutine_callbacks_get_live_output_and_the_result_is_collected(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker) as sandbox:
            seen: list[tuple[str, str]] = []

            async def on_stdout(text: str) -> None:
                [mine] = [c for c in await sandbox.commands.list() if c.command[-1] == script]
                seen.append((text, mine.state))

            script = "echo first; sleep 0.5; echo second >&2; exit 4"
            result = await sandbox.commands.run(
                script, on_stdout=on_stdout, on_stderr=lambda t: seen.append((t, "err"))
            )
            assert seen == [("first\n", "running"), ("second\n", "err")]
            assert (result.stdout, result.stderr, result.exit_code) == ("first\n", "second\n", 4)
            assert result.state == "exited" and result.command_id
            with pytest.raises(CommandTimeoutError) as info:
                await sandbox.commands.run("sleep 30", timeout=1)
            assert info.value.result is not None and info.value.result.state == "timed_out"

    run(main())


def test_cancelling_a_foreground_run_kills_the_process_group(
    broker: Any, process_gone: Any
) -> None:
    async def main() -> None:
        async with await create(broker) as sandbox:
            pids: list[int] = []
            started = asyncio.Event()

            def on_stdout(text: str) -> None:
                pids.append(int(text.split()[0]))
                started.set()

            task = asyncio.create_task(
                sandbox.commands.run("sleep 60 & echo $!; wait", on_stdout=on_stdout)
            )
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            [mine] = [c for c in await sandbox.commands.list() if "sleep 60 &" in c.command[-1]]
            assert mine.state == "cancelled"
            assert process_gone(pids[0])

            # a timeout around the run (asyncio.wait_for) is a cancellation too
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sandbox.commands.run("exec sleep 60"), 1)
            [slept] = [c for c in await sandbox.commands.list() if c.command[-1] == "exec sleep 60"]
            assert slept.state == "cancelled"

    run(main())


def test_background_wait_kill_stdin_iteration_and_reattach(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker) as sandbox:
            server = await sandbox.commands.run("echo ready; exec sleep 60", background=True)
            assert isinstance(server, AsyncCommandHandle)
            async for event in server:
                assert (event.type, event.data) == ("stdout", "ready\n")
                break
            with pytest.raises(CommandWaitTimeoutError):
                await server.wait(timeout=0.5)
            assert (await server.status()).state == "running"
            with pytest.raises(TimeoutError):  # a cancelled wait leaves it running too
                await asyncio.wait_for(server.wait(), 0.5)
            assert (await server.status()).state == "running"
            final = await server.kill()
            assert (final.state, final.exit_code) == ("cancelled", 137)
            assert await server.kill() == final

            cat = await sandbox.commands.run(["cat"], background=True, stdin=True)
            await cat.send_stdin("hello ")
            await cat.send_stdin(b"world", eof=True)
            got: list[str] = []

            async def collect(text: str) -> None:
                got.append(text)

            assert (await cat.wait(on_stdout=collect)).stdout == "hello world" == "".join(got)
            again = await sandbox.commands.get(cat.command_id)  # replays the retained output
            assert "".join([e.data async for e in again if e.type == "stdout"]) == "hello world"
            with pytest.raises(BrokerError, match="404"):
                await sandbox.commands.get("no-such-command")

    run(main())


def test_64_background_commands_waited_concurrently(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker, SANDBOX_COMMAND_MAX_RUNNING="64") as sandbox:
            handles = await asyncio.gather(
                *(
                    sandbox.commands.run(f"read x; echo done {i} $x", background=True, stdin=True)
                    for i in range(64)
                )
            )
            running = [c for c in await sandbox.commands.list() if c.state == "running"]
            assert len(running) == 64  # all at once, each waiting for its stdin
            waits = [asyncio.ensure_future(h.wait(timeout=120)) for h in handles]
            await asyncio.gather(*(h.send_stdin("go\n", eof=True) for h in handles))
            results = await asyncio.gather(*waits)
            assert [r.stdout for r in results] == [f"done {i} go\n" for i in range(64)]
            assert {r.state for r in results} == {"exited"}

    run(main())


def test_forced_reconnects_lose_and_repeat_nothing(
    broker: Any, long_output: tuple[list[str], str]
) -> None:
    script, expected = long_output

    async def main() -> None:
        async with await create(broker) as sandbox:
            broker.cut_event_streams(after_events=50, sandbox=sandbox.name)
            broker.drop_event_stream_mid_line(3, after_events=20, sandbox=sandbox.name)
            chunks: list[str] = []
            result = await sandbox.commands.run(script, on_stdout=chunks.append)
            assert result.stdout == expected == "".join(chunks)
            handle = await sandbox.commands.run(script, background=True)
            assert "".join([e.data async for e in handle]) == expected

    run(main())


def test_the_streamed_start_is_live_resumes_after_a_drop_and_is_never_sent_twice(
    broker: Any, long_output: tuple[list[str], str], streams_opened: Any
) -> None:
    script, expected = long_output

    async def main() -> None:
        async with await create(broker) as sandbox:
            opened = streams_opened(sandbox)
            states: list[str] = []

            async def on_stdout(text: str) -> None:
                if not states:
                    states.append((await sandbox.commands.list())[-1].state)

            first = await sandbox.commands.run("echo a; sleep 0.5; echo b", on_stdout=on_stdout)
            assert (first.stdout, states, opened) == ("a\nb\n", ["running"], ["POST"])
            broker.drop_event_stream_mid_line(1, after_events=1, sandbox=sandbox.name)
            chunks: list[str] = []
            result = await sandbox.commands.run(script, on_stdout=chunks.append)
            assert result.stdout == expected == "".join(chunks)
            assert opened == ["POST", "POST", "0"]  # dropped after the command id: resumed
            broker.drop_event_stream_mid_line(1, after_events=0, sandbox=sandbox.name)
            with pytest.raises(BrokerUnavailableError, match=r"start a command.*not idempotent"):
                await sandbox.commands.run(["echo", "once"])
            assert broker.execution_count(sandbox.name) == 3
            assert list((await sandbox.commands.list())[-1].command) == ["echo", "once"]

    run(main())


def test_a_runtime_without_the_streamed_start_answers_json_and_events_follow(
    broker: Any, streams_opened: Any
) -> None:
    async def main() -> None:
        async with await create(broker, SANDBOX_COMMAND_STREAM_START="0") as sandbox:
            opened = streams_opened(sandbox)
            chunks: list[str] = []
            result = await sandbox.commands.run("echo a; exit 4", on_stdout=chunks.append)
            assert (result.stdout, result.exit_code, chunks) == ("a\n", 4, ["a\n"])
            assert opened == ["POST", "0"] and broker.execution_count(sandbox.name) == 1

    run(main())


def test_a_runtime_without_managed_commands_falls_back_to_execute(legacy_broker: Any) -> None:

    async def main() -> None:
        env = legacy_broker.environ("kubernetes")
        async with await AsyncSandbox.create(environ=env) as sandbox:
            result = await sandbox.commands.run("echo a | tr a b")
            assert (result.stdout, result.command_id) == ("b\n", None)
            with pytest.raises(UnsupportedByRuntimeError, match="POST /commands"):
                await sandbox.commands.run("sleep 1", background=True)

    run(main())


def test_a_long_stream_survives_token_rotation(broker: Any, tmp_path: Any) -> None:
    path = tmp_path / "tokens" / "agent-sandbox-token"
    env = broker.environ("kubernetes", token_file=path)
    old = path.read_text()

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env) as sandbox:
            broker.cut_event_streams(after_events=5, sandbox=sandbox.name)  # many re-requests
            rotated: list[bool] = []

            async def on_stdout(text: str) -> None:
                if "tick 3\n" in text and not rotated:
                    broker.write_projected_token(path)  # kubelet-style swap
                    broker.revoke_token(old)  # only the re-read token works from now on
                    rotated.append(True)

            script = "for i in $(seq 1 12); do echo tick $i; sleep 0.1; done"
            result = await sandbox.commands.run(script, on_stdout=on_stdout)
            assert rotated == [True]
            assert result.stdout == "".join(f"tick {i}\n" for i in range(1, 13))

    run(main())
