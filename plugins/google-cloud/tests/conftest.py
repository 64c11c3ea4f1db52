"""Fixtures: a scripted HTTP server on 127.0.0.1 standing in for the GCE metadata server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import ScriptedEndpoint, unsigned_jwt


@pytest.fixture
def endpoint() -> Iterator[ScriptedEndpoint]:
    """Every reply carries ``Metadata-Flavor: Google`` unless a test gives its own headers."""
    with ScriptedEndpoint(default_headers={"Metadata-Flavor": "Google"}) as server:
        yield server


@pytest.fixture
def jwt_factory() -> Callable[..., str]:
    """Unsigned JWTs shaped like a Google identity token (1 hour), for unit tests."""

    def make(claims: dict[str, Any] | None = None) -> str:
        return unsigned_jwt({"iss": "https://accounts.google.com", **(claims or {})}, ttl=3600)

    return make
