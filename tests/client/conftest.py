"""Fixtures of the client tests: a stand-in credential source and a scripted broker
(``tests/_support/scripted_broker.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

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
