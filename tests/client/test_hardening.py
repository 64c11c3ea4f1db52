"""Regression tests for the client's network path (issue 10): each failed before its fix.

End to end against local brokers over real HTTPS on loopback, or through the public API with a
scripted broker (httpx.MockTransport) where a broker cannot be made to misbehave."""

from __future__ import annotations

from typing import Any

import pytest

from k8s_agent_sandbox_awx import (
    BrokerAuthenticationError,
    BrokerError,
    OIDCTokenAuth,
    Sandbox,
)

pytestmark = pytest.mark.e2e


def test_a_401_from_behind_the_broker_never_replays_the_command(runtime_401_broker: Any) -> None:
    broker = runtime_401_broker
    env = broker.environ("gitlab")
    token = env.pop("AGENT_SANDBOX_TOKEN")
    fetches: list[str] = []

    def fetch() -> str:
        fetches.append(token)
        return token

    with Sandbox.create(template="unauthorized", auth=OIDCTokenAuth(fetch), environ=env) as sandbox:
        fetched = len(fetches)
        with pytest.raises(BrokerError) as info:
            sandbox.commands.run("touch ran-once")
        assert broker.execution_count(sandbox.name) == 1  # sent once, never replayed
        error = info.value
        assert not isinstance(error, BrokerAuthenticationError)  # not the broker's verdict
        assert (error.status_code, error.code) == (401, None)
        assert "sandbox runtime answered 401" in str(error)
        assert "wants its own credentials" in str(error)
        assert len(fetches) == fetched  # the (valid) credential was not invalidated
