"""pytest plugin (``pytest11`` entry point): the ``sandbox_broker`` fixture.

This module is imported by every pytest run in an environment where the package is installed,
so it must stay cheap and must not import the ``[local]`` extra's dependencies at import time.
The fixture imports the local broker lazily and fails with a message naming the extra when it
is missing; a run that does not use the fixture is never affected.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from . import LocalBroker

_ENV_CLEARED = ("AGENT_SANDBOX_TOKEN", "AGENT_SANDBOX_TEMPLATE")


@pytest.fixture(scope="session")
def sandbox_broker_session() -> Iterator[LocalBroker]:
    """One local broker stack for the whole session (use ``sandbox_broker`` in tests)."""
    try:
        from . import LocalBroker
    except ImportError as exc:
        pytest.fail(
            "the sandbox_broker fixture needs the local broker stack: install the [local] extra "
            '(python3 -m pip install -e ".[local]" in a clone of the k8s-agent-sandbox-awx '
            f"repository); import failed: {exc}",
            pytrace=False,
        )
    with LocalBroker() as broker:
        yield broker


@pytest.fixture
def sandbox_broker(
    sandbox_broker_session: LocalBroker, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[LocalBroker]:
    """A running local broker, with the environment set so ``Sandbox.create()`` works zero-arg.

    Sets ``AGENT_SANDBOX_BROKER_URL``, ``AGENT_SANDBOX_CA_BUNDLE`` and ``AGENT_SANDBOX_TOKEN_FILE``
    (a projected token for ``system:serviceaccount:default:default`` written kubelet-style under
    ``tmp_path``), removes ``AGENT_SANDBOX_TOKEN`` and ``AGENT_SANDBOX_TEMPLATE``, and clears the
    credential cache. After the test every sandbox is deleted and injected faults are cleared.
    """
    broker = sandbox_broker_session
    token_file = tmp_path / "agent-sandbox-token" / "token"
    env: dict[str, Any] = broker.environ("kubernetes", token_file=token_file)
    for name in _ENV_CLEARED:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from ..credentials._cache import clear_credential_cache  # here: the plugin stays cheap

    clear_credential_cache()
    try:
        yield broker
    finally:
        broker.reset()
        clear_credential_cache()
