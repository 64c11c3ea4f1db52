"""Fixtures of the client tests: a stand-in credential source and a scripted broker
(``tests/_support/scripted_broker.py``); a sandbox of the local broker and the user's server in
it, for the ports and port-forward tests (``tests/_support/port_server.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests._support.port_server import served_in_sandbox
from tests._support.scripted_broker import FakeBroker, Kit, StubCredentials, scripted_client


@pytest.fixture
def fake() -> FakeBroker:
    return FakeBroker()


@pytest.fixture
def creds() -> StubCredentials:
    return StubCredentials()


@pytest.fixture
def make_client(fake: FakeBroker, creds: StubCredentials) -> Iterator[Callable[..., Any]]:
    """``make_client(**settings)``: a client on ``fake`` (``scripted_client``), closed after
    the test."""
    clients: list[Any] = []

    def make(**settings: Any) -> Any:
        clients.append(scripted_client(fake, creds, **settings))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def kit() -> type[Kit]:
    return Kit


# -- the ports and port-forward tests (tests/client/test_ports*.py, test_port_forward*.py) ----
@pytest.fixture
def sandbox(broker: Any) -> Iterator[Any]:
    """A sandbox of the local broker (in a test that runs per dialect, that dialect's)."""
    from k8s_agent_sandbox_awx import Sandbox

    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        yield sandbox


@pytest.fixture
def app_port(sandbox: Any) -> Iterator[int]:
    """The user's server (``port_app.py``) serving in ``sandbox``: its port."""
    with served_in_sandbox(sandbox) as port:
        yield port
