"""Issue 14's 'done when' flow against a broker that serves only /rpc (zero-argument create)."""

from __future__ import annotations

import asyncio
from typing import Any

from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox


def test_the_whole_flow_sync(rpc_broker: Any, use_env: Any) -> None:
    use_env(rpc_broker.environ("kubernetes"))
    seen: list[str] = []
    with Sandbox.create() as sandbox:
        assert sandbox.commands.run("echo a | tr a b").stdout == "b\n"
        sandbox.commands.run("echo live", on_stdout=seen.append)
        handle = sandbox.commands.run("sleep 0.2; echo bg", background=True)
        assert handle.wait().stdout == "bg\n"
        sandbox.files.write("x.txt", b"data")
        assert sandbox.files.read("x.txt") == b"data"
        sandbox.set_timeout(60)
    assert "".join(seen) == "live\n"


def test_the_whole_flow_async(rpc_broker: Any, use_env: Any) -> None:
    use_env(rpc_broker.environ("kubernetes"))

    async def main() -> None:
        async with await AsyncSandbox.create() as sandbox:
            assert (await sandbox.commands.run("echo a | tr a b")).stdout == "b\n"
            handle = await sandbox.commands.run("sleep 0.2; echo bg", background=True)
            assert (await handle.wait()).stdout == "bg\n"
            await sandbox.files.write("x.txt", b"data")
            assert await sandbox.files.read("x.txt") == b"data"
            await sandbox.set_timeout(60)

    asyncio.run(main())
