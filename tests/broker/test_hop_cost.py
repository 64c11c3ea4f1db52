"""Per-request waste on the broker's data-plane hop (counted, never timed)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker


class _ImportProbe(importlib.abc.MetaPathFinder):
    """Counts searches for one module name (a module in ``sys.modules`` is never searched)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.searches = 0

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == self.name:
            with self.lock:
                self.searches += 1
        return None  # let the real finders answer


@pytest.fixture
def sniffio_searches() -> Iterator[_ImportProbe]:
    probe = _ImportProbe("sniffio")
    sys.meta_path.insert(0, probe)
    try:
        yield probe
    finally:
        sys.meta_path.remove(probe)


def test_forwarding_searches_no_module_per_request(
    broker: LocalBroker, alice: Any, sniffio_searches: _ImportProbe
) -> None:
    """httpcore asks ``import sniffio`` for every lock and event of an async request; when the
    package is missing (anyio >= 4.11 no longer brings it), each ask is a failed import that
    searches sys.path again (about 4 per forwarded request, 50-200 us each). sniffio is a
    declared dependency, so it is found once and then taken from sys.modules."""
    sandbox = alice.ready()
    assert alice.run(sandbox, "true").status_code == 200  # connections and imports warmed up
    before = sniffio_searches.searches
    for _ in range(10):
        resp = alice.run(sandbox, "true")
        assert resp.status_code == 200, resp.text
    assert sniffio_searches.searches == before


def test_the_router_keeps_no_cookies(broker: LocalBroker, alice: Any) -> None:
    """The hop is stateless like upstream's router: a sandbox's Set-Cookie goes to the caller
    and is not stored by the broker and replayed on later requests (nor parsed per request)."""
    sandbox = alice.ready(template="echo")
    headers = alice.data_headers(sandbox)
    first = alice.http.get("/set-cookie", headers=headers)
    assert first.status_code == 200, first.text
    assert "session=from-the-sandbox" in first.headers.get("set-cookie", "")
    alice.http.cookies.clear()  # the caller chooses not to send it back
    echoed = alice.http.get("/echo", headers=headers).json()
    assert "cookie" not in echoed["headers"]


def test_the_forward_reuses_one_connection(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready()
    for _ in range(5):
        assert alice.run(sandbox, "true").status_code == 200
    record = broker._require_store().sandboxes[sandbox["name"]]
    assert record.router_http is not None  # the broker's own pool (backends._http11)
    assert record.router_http.connections == 1
