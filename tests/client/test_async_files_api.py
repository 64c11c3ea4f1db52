"""``AsyncSandbox.files`` and the lifetime methods end to end: the same names, rules, errors
and fallbacks as the sync client (tests/client/test_files_api.py, test_lifetime_client.py)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx import AsyncSandbox, FileInfo, KubernetesAuth, WatchEvent
from k8s_agent_sandbox_awx.client.wire._protocol import rfc3339_seconds
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    FileAPIUnsupportedError,
    LifetimeExceedsPolicyError,
    SandboxFileError,
    SandboxFileExistsError,
    SandboxFileNotFoundError,
    SandboxPathError,
)

# Data-plane behaviour is the same under both dialects: one dialect (v1) for most tests, and
# a small rpc data-plane smoke set (``RPC_SMOKE``: once per dialect) so that the /rpc data path
# stays covered. Tests whose behaviour depends on the dialect request ``dialect`` themselves.
pytestmark = pytest.mark.e2e
RPC_SMOKE = pytest.mark.usefixtures("dialect")  # once per dialect


def _options(broker: Any, **extra: str) -> dict[str, Any]:
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    auth = KubernetesAuth(env.pop("AGENT_SANDBOX_TOKEN_FILE"))
    return {"auth": auth, "environ": {**env, **extra}}


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _every_operation(broker: Any) -> None:
    async with await AsyncSandbox.create(timeout=100, **_options(broker)) as sb:
        files = sb.files
        info = await files.write("d/a.txt", b"hello")
        assert isinstance(info, FileInfo) and info.path == "/app/d/a.txt"
        assert (await files.write("d/b.txt", "héllo")).size == len("héllo".encode())
        assert (await files.write("d/c.bin", io.BytesIO(b"xyz"))).size == 3
        assert (await files.write("d/g.bin", _chunks([b"a" * 10, b"b" * 10]))).size == 20
        assert (await files.write("d/i.bin", iter([b"12", b"34"]))).size == 4
        batch = await files.write([("e/1.txt", b"1"), ("e/2.txt", "2")])
        assert [i.name for i in batch] == ["1.txt", "2.txt"]
        assert await files.read("d/a.txt") == b"hello"
        assert await files.read("d/b.txt", format="text") == "héllo"
        stream = await files.read("d/g.bin", format="stream")
        async with contextlib.aclosing(stream):
            assert b"".join([c async for c in stream]) == b"a" * 10 + b"b" * 10
        names = [e.name for e in await files.list("d")]
        assert names == ["a.txt", "b.txt", "c.bin", "g.bin", "i.bin"]
        assert await files.exists("d/a.txt") and not await files.exists("d/x")
        assert (await files.get_info("d/a.txt")).size == 5
        assert await files.make_dir("m") is True and await files.make_dir("m") is False
        await files.move("d/a.txt", "m/a.txt")
        with pytest.raises(SandboxFileExistsError, match=r"m/a\.txt"):
            await files.move("d/b.txt", "m/a.txt")
        assert (await files.move("d/b.txt", "m/a.txt", overwrite=True)).name == "a.txt"
        with pytest.raises(SandboxFileError, match="not_empty"):
            await files.remove("m")
        assert await files.remove("m", recursive=True) is True
        assert await files.remove("m") is False
        with pytest.raises(SandboxFileNotFoundError):
            await files.read("nope")
        with pytest.raises(SandboxPathError, match="path_outside_root"):
            await files.write("/etc/x", b"1")
        with pytest.raises(ValueError, match="control character"):
            await files.make_dir("a\rb")


@RPC_SMOKE
def test_every_file_operation(files_broker: Any) -> None:
    asyncio.run(_every_operation(files_broker))


async def _legacy(broker: Any) -> None:
    async with await AsyncSandbox.create(template="legacy", timeout=100, **_options(broker)) as sb:
        assert (await sb.files.write("a.txt", _chunks([b"one-", b"shot"]))).size == 8
        assert await sb.files.read("a.txt", format="text") == "one-shot"
        assert [e.name for e in await sb.files.list(".")] == ["a.txt"]
        with pytest.raises(FileAPIUnsupportedError, match=r"v0\.4\.0"):
            await sb.files.make_dir("x")
        with pytest.raises(FileAPIUnsupportedError):
            async for _ in sb.files.watch_dir(".", timeout=1):
                pass


def test_a_runtime_without_the_file_api(files_broker: Any) -> None:
    asyncio.run(_legacy(files_broker))


async def _watch(broker: Any) -> None:
    async with await AsyncSandbox.create(timeout=100, **_options(broker)) as sb:
        await sb.files.make_dir("w")
        events: list[WatchEvent] = []

        async def follow() -> None:
            async with contextlib.aclosing(sb.files.watch_dir("w", timeout=None)) as watch:
                async for event in watch:
                    events.append(event)
                    return

        task = asyncio.create_task(follow())
        await asyncio.sleep(1.0)
        await sb.commands.run("touch w/made-by-a-command.txt")
        await asyncio.wait_for(task, 10)  # delivered live, not when the 20 s request ends
        assert [(e.type, e.path) for e in events] == [("created", "/app/w/made-by-a-command.txt")]


def test_watch_dir_sees_a_file_created_by_a_command(files_broker: Any) -> None:
    asyncio.run(_watch(broker=files_broker))


async def _lifetime(broker: Any, dialect: str) -> None:
    # past the cap: v1 refuses (LifetimeExceedsPolicyError), /rpc's create answers 400 and its
    # extend cuts the deadline at the cap
    with pytest.raises(LifetimeExceedsPolicyError if dialect == "v1" else BrokerError):
        # a chosen 300 s is over the cap (issue 22: the SDK's default 300 s is cut at it)
        await AsyncSandbox.create(**_options(broker, AGENT_SANDBOX_TTL_SECONDS="300"))
    async with await AsyncSandbox.create(**_options(broker)) as zero_config:
        assert await zero_config.is_running()
    sb = await AsyncSandbox.create(timeout=60, **_options(broker))
    try:
        info = await sb.get_info()
        assert await sb.is_running()
        if dialect == "v1":  # /rpc: .info has no times
            assert info.started_at is not None
            with pytest.raises(LifetimeExceedsPolicyError):
                await sb.set_timeout(1000)
        else:
            assert (await sb.client.extend(sb.name, 1000)).capped
        deadline = rfc3339_seconds((await sb.set_timeout(2)).expires_at) or 0
        while await sb.is_running():
            assert time.time() < deadline + 5, "the broker did not delete the sandbox on time"
            await asyncio.sleep(0.2)
        assert time.time() >= deadline - 1
    finally:
        await sb.kill()
    # idle first: busy's first call follows its create at once (a slow second create, a cold
    # pod on a busy machine, must not eat busy's 5 s before its keepalive starts)
    idle = await AsyncSandbox.create(timeout=5, keepalive=5, **_options(broker))
    busy = await AsyncSandbox.create(timeout=5, keepalive=5, **_options(broker))
    try:
        until = time.time() + 9
        while time.time() < until:
            assert await busy.files.exists("x") is False
            await asyncio.sleep(0.4)
        assert await busy.is_running() and not await idle.is_running()
    finally:
        await busy.kill()
        await idle.kill()


@pytest.mark.slow
def test_lifetime_set_timeout_and_keepalive(files_broker: Any, dialect: str) -> None:
    asyncio.run(_lifetime(files_broker, dialect))
