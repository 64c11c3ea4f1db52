"""The local brokers of the client, CLI and credential tests, and the dialect they run under.

``tests/conftest.py`` turns these into fixtures: ``broker`` (the pytest plugin's session broker,
reset, with a clean credential environment), ``rpc_broker``, ``dialect`` and the brokers with
their own templates (``files_broker``, ``legacy_broker``, ``runtime_401_broker``), each started
once per session (per xdist worker) on first use.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import SDK_VARIABLES

TESTS = Path(__file__).resolve().parents[1]
LEGACY_RUNTIME = TESTS / "legacy_runtime.py"
UNAUTHORIZED_RUNTIME = TESTS / "unauthorized_runtime.py"
FILES_POLICY_CAP = 120

DIALECTS = ("v1", "rpc")

DETECTING = frozenset({"dialect", "dialect_broker", "rpc_broker", "real_detection"})
"""The fixtures after which a test lets the client find out a broker's dialect itself."""

CLEAN_ENV = (
    *SDK_VARIABLES,  # every variable the SDK reads, the original package's aliases included
    "GITHUB_ACTIONS",
    "ACTIONS_ID_TOKEN_REQUEST_URL",
    "ACTIONS_ID_TOKEN_REQUEST_TOKEN",
)


def forget_detected_dialects(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Each test finds out afresh which dialect a broker speaks (the SDK remembers it per
    broker URL for the life of the process). Scripted brokers speak v1 and serve no
    ``/v1/healthz``: unless the test uses one of ``DETECTING``, a broker whose dialect is not
    pinned is taken to speak v1 (no probe)."""
    from k8s_agent_sandbox_awx.client.wire import _dialects

    _dialects.forget_detected()
    if DETECTING.isdisjoint(request.fixturenames):
        v1 = _dialects.get_dialect("v1")
        monkeypatch.setattr(_dialects, "detected", lambda _url: v1)
    yield
    _dialects.forget_detected()


def clean_use(session_broker: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``session_broker``, reset, with a clean credential environment and cache (and reset
    again afterwards)."""
    from k8s_agent_sandbox_awx import clear_credential_cache

    for name in CLEAN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    session_broker.reset()
    clear_credential_cache()
    yield session_broker
    clear_credential_cache()
    session_broker.reset()


def dialect_of(request: pytest.FixtureRequest) -> str:
    """The dialect the requesting test runs under: its ``dialect`` parameter, else ``v1``."""
    if "dialect" not in request.fixturenames:
        return "v1"
    name: str = request.getfixturevalue("dialect")
    return name


def skip_without_features(name: str, node: pytest.Item) -> None:
    """Skip the test ``node`` when the dialect ``name`` lacks a feature its
    ``dialect_feature`` marker names (the reason names them)."""
    from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect

    marker = node.get_closest_marker("dialect_feature")
    if marker is None:
        return
    missing = [f for f in marker.args if f not in get_dialect(name).features]
    if missing:
        pytest.skip(
            f"the {name!r} dialect lacks the {' and '.join(missing)} feature "
            "(Dialect.features): "
            + marker.kwargs.get("reason", "this test is about that operation")
        )


@contextlib.contextmanager
def rpc_only_local_broker() -> Iterator[Any]:
    """A local broker that serves only the ``/rpc`` dialect (as deployed brokers do); warm pool
    ``orphan`` names a template that does not exist."""
    from k8s_agent_sandbox_awx.testing import LocalBroker

    pools = {"orphan": "no-such-template"}
    with LocalBroker(protocols=("rpc",), warm_pools=pools, warn=False) as made:
        yield made


@contextlib.contextmanager
def session_brokers() -> Iterator[Callable[[Callable[..., Any], str], Any]]:
    """``get(start, dialect)``: the broker that ``start(**options)`` (a context manager making
    a ``LocalBroker``) makes for ``dialect`` — under ``v1`` one that serves both dialects,
    under ``rpc`` one that serves only ``/rpc`` — started on first use, stopped on exit."""
    started: dict[tuple[Callable[..., Any], str], Any] = {}
    with contextlib.ExitStack() as stack:

        def get(start: Callable[..., Any], dialect: str) -> Any:
            if (start, dialect) not in started:
                options = {} if dialect == "v1" else {"protocols": (dialect,)}
                started[start, dialect] = stack.enter_context(start(**options))
            return started[start, dialect]

        yield get


def local_broker(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, start: Callable[..., Any]
) -> Iterator[Any]:
    """The session's broker made by ``start`` for the test's dialect, used as ``broker`` is."""
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    get = request.getfixturevalue("_session_brokers")
    yield from clean_use(get(start, dialect_of(request)), monkeypatch)


@contextlib.contextmanager
def runtime_401_local_broker(**options: Any) -> Iterator[Any]:
    """GitLab callers may use ``python``, ``unauthorized`` (a runtime that answers every
    request but ``GET /`` with ``401``) and ``forging`` (the same, imitating ``token_expired``)."""
    from k8s_agent_sandbox_awx.testing import LocalBroker, Policy

    templates: dict[str, str | list[str] | None] = {
        "python": None,
        "unauthorized": [sys.executable, str(UNAUTHORIZED_RUNTIME), "--port", "{port}"],
        "forging": [
            *(sys.executable, str(UNAUTHORIZED_RUNTIME), "--port", "{port}"),
            *("--code", "token_expired"),
        ],
    }
    policy = Policy(
        templates=("python", "unauthorized", "forging"),
        namespace="gitlab-ci",
        max_sandboxes=5,
        max_lifetime_seconds=600,
    )
    with LocalBroker(templates=templates, gitlab_policy=policy, warn=False, **options) as made:
        yield made


@contextlib.contextmanager
def legacy_local_broker(**options: Any) -> Iterator[Any]:
    """Kubernetes callers' sandboxes run an old runtime (``legacy``: no managed commands)."""
    from k8s_agent_sandbox_awx.testing import LocalBroker, Policy

    templates: dict[str, str | list[str] | None] = {
        "legacy": [sys.executable, str(LEGACY_RUNTIME), "--port", "{port}"],
    }
    policy = Policy(templates=("legacy",), namespace="default", max_sandboxes=3)
    with LocalBroker(templates=templates, kubernetes_policy=policy, warn=False, **options) as made:
        yield made


@contextlib.contextmanager
def files_local_broker(**options: Any) -> Iterator[Any]:
    """Kubernetes callers may use ``python`` and ``legacy`` (no ``/fs/*``); lifetimes are
    capped at ``FILES_POLICY_CAP`` seconds."""
    from k8s_agent_sandbox_awx.testing import LocalBroker, Policy

    templates: dict[str, str | list[str] | None] = {
        "python": None,
        "legacy": [sys.executable, str(LEGACY_RUNTIME), "--port", "{port}"],
    }
    policy = Policy(
        templates=("python", "legacy"),
        namespace="team-a",
        max_sandboxes=10,
        max_lifetime_seconds=FILES_POLICY_CAP,
    )
    with LocalBroker(templates=templates, kubernetes_policy=policy, warn=False, **options) as made:
        yield made


def live_claims(broker: Any, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The broker's live claims once deletions have settled (a DELETE is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        claims = [c for c in broker.claims() if not c["metadata"].get("deletionTimestamp")]
        if not claims or time.monotonic() > deadline:
            return claims
        time.sleep(0.05)
