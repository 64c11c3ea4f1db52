"""Fixtures: a scripted HTTP server on 127.0.0.1 standing in for the Actions token service."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import ScriptedEndpoint, unsigned_jwt

ISSUER = "https://token.actions.githubusercontent.com"


@pytest.fixture
def endpoint() -> Iterator[ScriptedEndpoint]:
    with ScriptedEndpoint() as server:
        yield server


@pytest.fixture
def jwt_factory() -> Callable[..., str]:
    """Unsigned JWTs shaped like an Actions token (GitHub's issuer, 5 minutes), for unit tests."""

    def make(claims: dict[str, Any] | None = None) -> str:
        return unsigned_jwt({"iss": ISSUER, **(claims or {})})

    return make
