"""Fixtures for the async client tests: the shared local broker, reset per test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

_CLEAN_ENV = (
    "AGENT_SANDBOX_BROKER_URL",
    "AGENT_SANDBOX_CA_BUNDLE",
    "AGENT_SANDBOX_TEMPLATE",
    "AGENT_SANDBOX_TOKEN",
    "AGENT_SANDBOX_TOKEN_FILE",
    "GITHUB_ACTIONS",
    "ACTIONS_ID_TOKEN_REQUEST_URL",
    "ACTIONS_ID_TOKEN_REQUEST_TOKEN",
)


@pytest.fixture
def broker(sandbox_broker_session: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The session's local broker (the pytest plugin's), reset, with a clean credential
    environment and cache."""
    from k8s_agent_sandbox_awx import clear_credential_cache

    for name in _CLEAN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    sandbox_broker_session.reset()
    clear_credential_cache()
    yield sandbox_broker_session
    clear_credential_cache()
    sandbox_broker_session.reset()


@pytest.fixture
def live() -> Callable[..., list[dict[str, Any]]]:
    return live_claims


def live_claims(broker: Any, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The broker's live claims once deletions have settled (a DELETE is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        claims = [c for c in broker.claims() if not c["metadata"].get("deletionTimestamp")]
        if not claims or time.monotonic() > deadline:
            return claims
        time.sleep(0.05)
