"""commands.run and background commands end to end through AsyncSandbox: the sync suite's rules
with coroutine callbacks, cancellation killing the remote process group, async iteration, and 64
background commands waited concurrently from one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from k8s_agent_sandbox_awx import AsyncCommandHandle, AsyncSandbox
from k8s_agent_sandbox_awx.client.http._exchange import Answered
from k8s_agent_sandbox_awx.client.wire._dialect import SANDBOX_ENV
from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    BrokerUnavailableError,
    CommandTimeoutError,
    CommandWaitTimeoutError,
    UnsupportedByRuntimeError,
)
from tests._support.isolation import HOST_PIDS, host_processes_only
from tests._support.programs import process_gone

# Data-plane behaviour is the same under both dialects: one dialect (v1) for most tests, and
# a small rpc data-plane smoke set (``RPC_SMOKE``: once per dialect) so that the /rpc data path
# stays covered. Tests whose behaviour depends on the dialect request ``dialect`` themselves.
pytestmark = pytest.mark.e2e
RPC_SMOKE = pytest.mark.usefixtures("dialect")  # once per dialect
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def create(broker: Any, **env: str) -> AsyncSandbox:
    return await AsyncSandbox.create(environ=broker.environ("kubernetes"), env=env or None)


def test_shell_rules_envs_cwd_and_errors_before_sending(broker: Any, dialect: str) -> None:
    base = {"BASE_VAR": "base"} if SANDBOX_ENV in get_dialect(dialect).features else {}

    async def main() -> None:
        async with await create(broker, **base) as sandbox:
            assert (await sandbox.commands.run("echo a | tr a b")).stdout == "b\n"
            assert (await sandbox.commands.run(["echo", "a | b"])).stdout == "a | b\n"
            split = await sandbox.commands.run("printf '%s|' 'a b' $HOME", shell=False)
            assert split.stdout == "a b|$HOME|"
            result = await sandbox.commands.run(
                'echo "$BASE_VAR $MINE"; pwd', envs={"MINE": "m"}, cwd="/tmp"
            )
            assert result.stdout == f"{base.get('BASE_VAR', '')} m\n/tmp\n"
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


@pytest.mark.dialect_feature(SANDBOX_ENV, reason="the bash-less PATH is given through it")
def test_strings_run_through_sh_in_a_sandbox_without_bash(
    broker: Any, legacy_broker: Any, bashless_path: str
) -> None:
    """A sandbox whose PATH has no bash (``bashless_path``: what it simulates and what not):
    foreground, background with stdin and the legacy /execute path run a string with /bin/sh,
    once; with bash on the PATH the same strings run with bash."""
    script = "echo ran >> count; echo ${BASH_VERSION:-sh}"

    def shell(output: str) -> str:  # what ran the script: BASH_VERSION is a version number
        return "bash" if output[:1].isdigit() else output.split()[0]

    async def on_stdout(text: str) -> None:
        chunks.append(text)

    chunks: list[str] = []

    async def main() -> None:
        for env, expected in (({"PATH": bashless_path}, "sh"), ({}, "bash")):
            async with await create(broker, **env) as sandbox:
                result = await sandbox.commands.run(script, on_stdout=on_stdout)
                assert shell(result.stdout) == expected and "".join(chunks) == result.stdout
                handle = await sandbox.commands.run(
                    f"read line; {script} $line", background=True, stdin=True
                )
                await handle.send_stdin("hi\n", eof=True)
                waited = await handle.wait()
                assert shell(waited.stdout) == expected and waited.stdout.endswith(" hi\n")
                assert (await sandbox.commands.run(["cat", "count"])).stdout == "ran\nran\n"
                assert broker.execution_count(sandbox.name) == 3  # one start each, no retry
                chunks.clear()
        legacy = legacy_broker.environ("kubernetes")
        async with await AsyncSandbox.create(environ=legacy, env={"PATH": bashless_path}) as sb:
            assert (await sb.commands.run(script)).stdout == "sh\n"
            assert (await sb.commands.run(["cat", "count"])).stdout == "ran\n"
            assert legacy_broker.execution_count(sb.name) == 3  # the 404, then 2 /execute

    run(main())


@RPC_SMOKE
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


@pytest.mark.slow
def test_a_run_whose_kill_cannot_be_delivered_says_the_command_may_still_run(
    broker: Any,
) -> None:
    """The broker goes down (every data-plane request 503) while a foreground run waits: the
    wait gives up, or the task is cancelled, and the kill after it fails too. The raised error
    (the ``BrokerUnavailableError``, the ``CancelledError``) carries a note naming the sandbox
    and the command, saying it may still be running and how to stop it, without any token."""
    token = Path(broker.environ("kubernetes")["AGENT_SANDBOX_TOKEN_FILE"]).read_text().strip()

    def check(exc: BaseException, sandbox: AsyncSandbox, command_id: str) -> None:
        notes = "\n".join(getattr(exc, "__notes__", []))
        assert f"Command {command_id!r} may still be running" in notes
        assert f"in sandbox {sandbox.sandbox_id!r}" in notes
        assert f'sandbox.commands.get("{command_id}").kill()' in notes
        assert token not in notes + str(exc)

    async def running(sandbox: AsyncSandbox) -> str:
        broker.clear_faults()
        [command] = [c for c in await sandbox.commands.list() if c.running]
        assert (await (await sandbox.commands.get(command.command_id)).kill()).state == "cancelled"
        return command.command_id

    async def main() -> None:
        async with await create(broker) as sandbox:
            down = {"retry_after": 0, "scope": "data", "sandbox": sandbox.name}
            broker.cut_event_streams(after_events=2, sandbox=sandbox.name)
            with pytest.raises(BrokerUnavailableError) as info:
                await sandbox.commands.run(
                    "echo started; exec sleep 60",
                    on_stdout=lambda _text: broker.inject_unavailable(100_000, **down),
                )
            check(info.value, sandbox, await running(sandbox))

            started = asyncio.Event()
            task = asyncio.create_task(
                sandbox.commands.run(
                    "echo started; exec sleep 60", on_stdout=lambda _: started.set()
                )
            )
            await started.wait()
            broker.inject_unavailable(100_000, **down)
            task.cancel()
            with pytest.raises(asyncio.CancelledError) as cancelled:
                await task
            check(cancelled.value, sandbox, await running(sandbox))

    run(main())


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_start_cancelled_before_its_command_id_is_found_and_killed(
    broker: Any, process_gone: Any, background: bool
) -> None:
    """The start's answer is held back after the runtime started the command (its head
    arrived, its command id not read), and the task is cancelled then: the cleanup finds the
    command by the start's request id and kills it before ``CancelledError`` propagates
    (before: it ran on, and nobody had its id to kill it)."""

    async def main() -> None:
        async with await create(broker) as sandbox:
            lease = sandbox.commands._transport._http  # what sends each request
            send = lease.send
            answered = asyncio.Event()

            async def held_back(request: Any) -> Any:
                response = await send(request)
                if (request.method, request.url.path) != ("POST", "/commands"):
                    return response
                answered.set()
                try:
                    await asyncio.sleep(3600)  # the answer's body never comes
                finally:
                    await response.aclose()
                return response

            lease.send = held_back  # type: ignore[method-assign]
            task = asyncio.create_task(sandbox.commands.run("exec sleep 60", background=background))
            await answered.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError) as info:
                await task
            del lease.send
            [started] = [
                c for c in await sandbox.commands.list() if c.command[-1] == "exec sleep 60"
            ]
            assert started.state == "cancelled" and started.pid is not None
            assert process_gone(started.pid)
            notes = " ".join(getattr(info.value, "__notes__", []))
            assert f"{started.command_id!r} (killed)" in notes

    run(main())


@RPC_SMOKE
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


@pytest.mark.dialect_feature(SANDBOX_ENV, reason="the runtime's limit is raised through it")
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


class StreamRequests:
    """Wraps an async transport's ``events``: the cursor (``after``) of every event-stream
    request and the failures (dropped connections) the client saw while reading them."""

    def __init__(self, open_events: Any) -> None:
        self._open_events = open_events
        self.cursors: list[int] = []
        self.failures: list[Exception] = []

    async def __call__(self, spec: Any, **options: Any) -> Any:
        self.cursors.append(int(spec.params.get("after", 0)))  # a streamed start: from 0
        opened = await self._open_events(spec, **options)
        return opened if isinstance(opened, Answered) else self._values(opened)

    async def _values(self, values: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async for value in values:
                yield value
        except Exception as exc:
            self.failures.append(exc)
            raise


@pytest.mark.slow
def test_a_long_stream_cut_every_50_events_and_dropped_mid_line_loses_and_repeats_nothing(
    broker: Any, long_stream: Any, mid_line_drops: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "10-minute" stream (see the sync test): cut every 50 events, dropped inside a line
    every 200 events, compared byte for byte, through a coroutine callback and async iteration."""

    async def main() -> None:
        async with await create(broker) as sandbox:
            broker.cut_event_streams(after_events=50, sandbox=sandbox.name)
            inject = mid_line_drops(broker, sandbox.name)
            streams = StreamRequests(sandbox.commands._transport.open_events)
            monkeypatch.setattr(sandbox.commands._transport, "open_events", streams)
            chunks: list[str] = []

            async def on_stdout(text: str) -> None:
                chunks.append(text)
                inject(len(chunks))

            result = await sandbox.commands.run(long_stream.argv, on_stdout=on_stdout)
            assert result.stdout == long_stream.expected == "".join(chunks)  # byte for byte
            # that many events (1600 writes; a loaded runtime reads a few together): the cuts
            # are not vacuous
            assert len(chunks) >= 1000
            assert len(streams.cursors) >= len(chunks) // 50 >= 20  # a request per cut
            assert len(streams.failures) >= 7  # the injected mid-line drops, survived
            assert streams.cursors[0] == 0 and streams.cursors == sorted(streams.cursors)

            handle = await sandbox.commands.run(long_stream.argv, background=True)
            streams.cursors.clear()
            streams.failures.clear()
            events = []
            async for event in handle:
                events.append(event)
                inject(1600 + len(events))
            assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no gap/repeat
            assert "".join(e.data for e in events) == long_stream.expected
            assert len(streams.cursors) >= 30 and len(streams.failures) >= 7
            assert events[-1].type == "exit" and events[-1].exit_code == 0

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


def test_an_async_run_without_callbacks_prefers_its_answer_whole(
    broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the sync client: ``Prefer: no-live-output`` without callbacks, none with one."""

    async def main() -> None:
        async with await create(broker) as sandbox:
            transport = sandbox.commands._transport
            seen: list[str | None] = []
            open_events = transport.open_events

            def recording(spec: Any, **options: Any) -> Any:
                seen.append((spec.headers or {}).get("Prefer"))
                return open_events(spec, **options)

            monkeypatch.setattr(transport, "open_events", recording)
            quiet = await sandbox.commands.run(["sh", "-c", "echo quiet; exit 2"])
            live = await sandbox.commands.run(["echo", "live"], on_stdout=lambda text: None)
            assert (quiet.stdout, quiet.exit_code, live.stdout) == ("quiet\n", 2, "live\n")
            assert seen == ["no-live-output", None]
            assert broker.execution_count(sandbox.name) == 2

    run(main())


@pytest.mark.dialect_feature(SANDBOX_ENV, reason="the runtime is told through it")
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
            assert legacy_broker.execution_count(sandbox.name) == 2  # the 404, then /execute

    run(main())


def test_options_an_old_runtime_cannot_honour_are_refused_and_nothing_runs(
    legacy_broker: Any, managed_only_options: list[tuple[str, dict[str, Any]]]
) -> None:

    async def on_stderr(text: str) -> None:
        pass

    async def main() -> None:
        env = legacy_broker.environ("kubernetes")
        async with await AsyncSandbox.create(environ=env) as sandbox:
            with pytest.raises(UnsupportedByRuntimeError) as info:  # learnt from the 404
                await sandbox.commands.run("echo ran >> marker", on_stderr=on_stderr)
            message = str(info.value)
            for needle in ("on_stderr", "POST /commands", "v0.3.0", "v0.11.0", "Recreate"):
                assert needle in message
            assert info.value.options == ("on_stderr",)
            for name, options in managed_only_options:  # remembered: refused before any request
                with pytest.raises(UnsupportedByRuntimeError, match=rf"{name}.*Recreate"):
                    await sandbox.commands.run("echo ran >> marker", **options)
            assert legacy_broker.execution_count(sandbox.name) == 1  # the 404 only
            check = await sandbox.commands.run("test -e marker && echo ran || echo never")
            assert check.stdout == "never\n"  # the refused commands never ran

    run(main())


@host_processes_only(HOST_PIDS)
def test_a_background_command_without_a_time_limit_runs_until_its_sandbox_ends(
    broker: Any,
) -> None:
    """Async ``background=True, timeout=0``: past the runtime's cap (1 s here) it runs, and a
    foreground run without a time limit is refused before anything is sent."""

    async def main() -> int:
        async with await create(broker, SANDBOX_EXEC_TIMEOUT_SECONDS="1") as sandbox:
            with pytest.raises(ValueError, match="background=True, timeout=0"):
                await sandbox.commands.run("sleep 5", timeout=0)
            assert broker.execution_count(sandbox.name) == 0
            server = await sandbox.commands.run(
                "echo $$; exec sleep 300", background=True, timeout=0
            )
            pid = int((await server.__aiter__().__anext__()).data)
            await asyncio.sleep(2.5)  # past the cap
            status = await server.status()
            assert (status.state, status.no_time_limit) == ("running", True)
            return pid

    pid = run(main())  # the sandbox is deleted when its block ends
    assert process_gone(pid)


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
