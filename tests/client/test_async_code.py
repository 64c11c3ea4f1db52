"""``AsyncSandbox.run_code`` and the code contexts end to end: the sync suite's rules with
coroutine callbacks, a cancelled task (and ``asyncio.wait_for``) interrupting the execution,
concurrent contexts from one event loop, time limits, and the refusal on a runtime without
``/code``."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from k8s_agent_sandbox_awx import AsyncSandbox, Execution, OutputMessage
from k8s_agent_sandbox_awx.errors import (
    CodeContextBusyError,
    CodeContextNotFoundError,
    UnsupportedByRuntimeError,
)

pytestmark = pytest.mark.e2e
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def create(broker: Any) -> AsyncSandbox:
    return await AsyncSandbox.create(environ=broker.environ("kubernetes"))


@pytest.mark.usefixtures("dialect")
def test_state_persists_with_coroutine_callbacks(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker) as sandbox:
            assert (await sandbox.run_code("x = 41")).error is None
            assert (await sandbox.run_code("x + 1")).text == "42"
            seen: list[str] = []

            async def on_stdout(message: OutputMessage) -> None:
                await asyncio.sleep(0)
                seen.append(message.line)

            errors: list[Any] = []
            execution = await sandbox.run_code(
                "print('one'); print('two'); 1/0", on_stdout=on_stdout, on_error=errors.append
            )
            assert "".join(seen) == "one\ntwo\n" and execution.logs.stdout == seen
            assert execution.error is not None and execution.error.name == "ZeroDivisionError"
            assert errors == [execution.error]

    run(main())


def test_contexts_run_concurrently_from_one_loop(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker) as sandbox:
            contexts = [await sandbox.create_code_context() for _ in range(3)]
            runs = [
                sandbox.run_code(f"import time; time.sleep(0.3); n = {i}; n * 10", context=c)
                for i, c in enumerate(contexts)
            ]
            done = await asyncio.gather(*runs)
            assert [e.text for e in done] == ["0", "10", "20"]
            assert [e.context_id for e in done] == [c.id for c in contexts]
            listed = await sandbox.list_code_contexts()
            assert [c.id for c in listed] == ["default", *[c.id for c in contexts]]
            restarted = await sandbox.restart_code_context(contexts[0])
            assert restarted.state == "not_started"
            failed = await sandbox.run_code("n", context=contexts[0])
            assert failed.error is not None and failed.error.name == "NameError"
            await sandbox.remove_code_context(contexts[1])
            with pytest.raises(CodeContextNotFoundError):
                await sandbox.run_code("n", context=contexts[1])

    run(main())


def test_a_cancelled_run_interrupts_the_execution(broker: Any) -> None:
    async def main() -> None:
        async with await create(broker) as sandbox:
            started = asyncio.Event()
            task = asyncio.create_task(
                sandbox.run_code(
                    "print('sleeping')\nimport time\ntime.sleep(60)",
                    on_stdout=lambda _message: started.set(),
                    timeout=120,
                )
            )
            await asyncio.wait_for(started.wait(), 30)
            with pytest.raises(CodeContextBusyError):
                await sandbox.run_code("1")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await sandbox.run_code("'free'")).text == "'free'"  # interrupted, not busy
            # a timeout around the call (asyncio.wait_for) is a cancellation too
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sandbox.run_code("import time; time.sleep(60)"), 1)
            assert (await sandbox.run_code("'free again'")).text == "'free again'"

    run(main())


def test_a_runaway_cell_is_a_timed_out_result(broker: Any) -> None:
    async def main() -> Execution:
        async with await create(broker) as sandbox:
            await sandbox.run_code("kept = 1")
            execution = await sandbox.run_code("while True: pass", timeout=1)
            assert (await sandbox.run_code("kept")).text == "1"
            return execution

    execution = run(main())
    assert execution.timed_out and not execution.restarted
    assert execution.error is not None and execution.error.name == "TimeoutError"


@pytest.mark.usefixtures("dialect")
def test_a_runtime_without_code_refuses_run_code(legacy_broker: Any) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create(environ=legacy_broker.environ("kubernetes")) as sb:
            with pytest.raises(UnsupportedByRuntimeError) as info:
                await sb.run_code("1")
            assert info.value.options == ("run_code",)
            with pytest.raises(UnsupportedByRuntimeError):
                await sb.create_code_context()

    run(main())
