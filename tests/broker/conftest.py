"""Fixtures for the local broker's own tests: one broker per session (per xdist worker), reset
after every test; ``api(token)`` clients for it (``tests/_support/broker_api.py``), alice's and
bob's, a Ready ``sandbox`` of alice's; a sandbox's WebSocket ``server``
(``tests/_support/ws_peers.py``); and for the ``broker serve`` tests a ``pki`` and the
``started`` servers (``tests/_support/broker_server.py``).

The tests talk to the broker with httpx directly (never through the client package), over real
HTTPS on 127.0.0.1 with the CA the broker generated at start and real signed tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.broker_api import Api, broker_tests_broker
from tests._support.broker_server import Pki, Served
from tests._support.ws_peers import Server, serving


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


@pytest.fixture
def sandbox(alice: Any) -> dict[str, Any]:
    """A Ready sandbox of alice's, as the API returns it (the data-plane tests')."""
    sb: dict[str, Any] = alice.ready()
    return sb


@pytest.fixture
def server() -> Iterator[Server]:
    """A sandbox's WebSocket server on 127.0.0.1 (``tests/_support/ws_peers.py``): the relay's
    flow-control and limits tests'."""
    with serving() as peers:
        yield peers


# -- the `broker serve` tests (test_serve.py, test_observability_serve.py) --------------------
@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A CA and the server certificate it issued, written under ``tmp_path``."""
    pki = Pki(tmp_path)
    pki.write(pki.issue())
    return pki


@pytest.fixture
def started() -> Iterator[list[Served]]:
    """The ``broker serve`` processes a test started (it appends them): stopped after it."""
    servers: list[Served] = []
    yield servers
    for server in servers:
        server.stop()
