"""Deleted sandboxes' records are pruned after a retention (``LocalBroker(keep_deleted=...,
keep_deleted_seconds=...)``), so a long-running broker (``dev``) does not grow without bound.

Within the retention a deleted sandbox is still in ``claims(include_deleted=True)`` and
``execution_count``; a GET of it is ``404 not_found`` before and after pruning (records leave
the live set at deletion), and a live sandbox is never pruned. A create replayed with its
Idempotency-Key after its sandbox was pruned is ``404 not_found`` and allocates nothing.
"""

from __future__ import annotations

import math
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker


@contextmanager
def _broker(**kwargs: Any) -> Iterator[tuple[LocalBroker, httpx.Client]]:
    with LocalBroker(warn=False, **kwargs) as broker:
        token = broker.issue_kubernetes_token("team-a", "keeper")
        with httpx.Client(
            base_url=broker.url,
            verify=ssl.create_default_context(cafile=broker.ca_bundle),
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        ) as http:
            yield broker, http


def _crashed(broker: LocalBroker, http: httpx.Client, **headers: str) -> str:
    """A sandbox whose runtime never starts (cheap: phase Failed at once)."""
    broker.crash_next_start(1)
    created = http.post("/v1/sandboxes", json={}, headers=headers)
    assert created.status_code == 201, created.text
    return str(created.json()["name"])


def _delete(broker: LocalBroker, http: httpx.Client, name: str) -> None:
    assert http.delete(f"/v1/sandboxes/{name}").status_code in (202, 204)
    deadline = time.monotonic() + 10
    while any(s["name"] == name for s in broker.sandboxes()):
        assert time.monotonic() < deadline, f"{name} was not deleted"
        time.sleep(0.02)


def _deleted_names(broker: LocalBroker) -> list[str]:
    return [c["status"]["sandbox"]["name"] for c in broker.claims(include_deleted=True)]


def test_deleted_records_beyond_the_count_are_pruned_oldest_first() -> None:
    with _broker(keep_deleted=3) as (broker, http):
        live = http.post("/v1/sandboxes", json={}).json()["name"]  # kept, however old
        names = [_crashed(broker, http) for _ in range(6)]
        for name in names[:3]:
            _delete(broker, http, name)
        assert _deleted_names(broker) == [live, *names]  # within the retention: all kept
        assert broker.execution_count(names[0]) == 0
        for name in names[3:]:
            _delete(broker, http, name)
        assert _deleted_names(broker) == [live, *names[3:]]
        assert len(broker._require_store().history) == 4
        with pytest.raises(KeyError, match=names[0]):
            broker.execution_count(names[0])
        assert broker.execution_count(names[-1]) == 0
        for name in names:
            gone = http.get(f"/v1/sandboxes/{name}")
            assert (gone.status_code, gone.json()["code"]) == (404, "not_found")
        assert http.get(f"/v1/sandboxes/{live}").status_code == 200


def test_deleted_records_older_than_the_age_are_pruned() -> None:
    with _broker(keep_deleted_seconds=2.0) as (broker, http):
        name = _crashed(broker, http)
        _delete(broker, http, name)
        assert name in _deleted_names(broker)
        assert broker.execution_count(name) == 0
        time.sleep(2.3)
        assert _deleted_names(broker) == []
        assert broker._require_store().history == []
        with pytest.raises(KeyError, match=name):
            broker.execution_count(name)


def test_replaying_a_create_whose_sandbox_was_pruned_allocates_nothing() -> None:
    with _broker(keep_deleted=0) as (broker, http):
        key = {"Idempotency-Key": "create-once"}
        name = _crashed(broker, http, **key)
        _delete(broker, http, name)
        assert broker._require_store().history == []
        replay = http.post("/v1/sandboxes", json={}, headers=key)
        assert replay.status_code == 404, replay.text
        assert replay.json()["code"] == "not_found"
        assert name in replay.json()["detail"]
        assert "Idempotency-Key" in replay.json()["detail"]
        assert broker.sandboxes() == []
        assert broker._require_store().history == []


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("keep_deleted", -1),
        ("keep_deleted", True),
        ("keep_deleted", 1.5),
        ("keep_deleted_seconds", -0.1),
        ("keep_deleted_seconds", math.nan),
        ("keep_deleted_seconds", "3600"),
    ],
)
def test_the_retention_is_checked(argument: str, value: Any) -> None:
    with pytest.raises(ValueError, match=argument):
        LocalBroker(warn=False, **{argument: value})


def test_the_default_retention_is_documented() -> None:
    import inspect
    from pathlib import Path

    parameters = inspect.signature(LocalBroker).parameters
    assert parameters["keep_deleted"].default == 1000
    assert parameters["keep_deleted_seconds"].default == 3600.0
    docs = (Path(__file__).resolve().parents[2] / "docs" / "local-broker.md").read_text()
    assert "keep_deleted=1000, keep_deleted_seconds=3600.0" in docs
