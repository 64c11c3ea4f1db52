"""Regression tests for the client's network path (issue 10), through the async API: each
failed before its fix. End to end against local brokers over real HTTPS on loopback, or through
the public API with a scripted broker (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from k8s_agent_sandbox_awx import (
    AsyncSandbox,
    BrokerAuthenticationError,
    BrokerError,
    OIDCTokenAuth,
)

pytestmark = pytest.mark.e2e
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_a_401_from_behind_the_broker_never_replays_the_command(runtime_401_broker: Any) -> None:
    broker = runtime_401_broker
    env = broker.environ("gitlab")
    token = env.pop("AGENT_SANDBOX_TOKEN")
    fetches: list[str] = []

    async def fetch() -> str:
        fetches.append(token)
        return token

    async def main() -> None:
        auth = OIDCTokenAuth(fetch)
        async with await AsyncSandbox.create(
            template="unauthorized", auth=auth, environ=env
        ) as sandbox:
            fetched = len(fetches)
            with pytest.raises(BrokerError) as info:
                await sandbox.commands.run("touch ran-once")
            assert broker.execution_count(sandbox.name) == 1  # sent once, never replayed
            error = info.value
            assert not isinstance(error, BrokerAuthenticationError)
            assert (error.status_code, error.code) == (401, None)
            assert "sandbox runtime answered 401" in str(error)
            assert len(fetches) == fetched  # the (valid) credential was not invalidated

    run(main())
