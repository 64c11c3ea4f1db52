"""Fixtures for the local broker's own tests: one broker per session (per xdist worker), reset
after every test; ``api(token)`` clients for it (``tests/_support/broker_api.py``).

The tests talk to the broker with httpx directly (never through the client package), over real
HTTPS on 127.0.0.1 with the CA the broker generated at start and real signed tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.broker_api import Api, broker_tests_broker


@pytest.fixture(scope="session")
def broker() -> Iterator[LocalBroker]:
    with broker_tests_broker() as b:
        yield b


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "broker" in request.fixturenames:
        request.getfixturevalue("broker").reset()


@pytest.fixture
def api(broker: LocalBroker) -> Iterator[Callable[..., Api]]:
    """``api(token, broker=None)``: an Api client (for another broker when given)."""
    clients: list[Api] = []

    def make(token: str | None, other: LocalBroker | None = None) -> Api:
        client = Api(other or broker, token)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.http.close()


@pytest.fixture
def alice(broker: LocalBroker, api: Callable[..., Api]) -> Api:
    return api(broker.issue_kubernetes_token("team-a", "alice"))


@pytest.fixture
def bob(broker: LocalBroker, api: Callable[..., Api]) -> Api:
    """Same provider and namespace as alice, another identity."""
    return api(broker.issue_kubernetes_token("team-a", "bob"))
