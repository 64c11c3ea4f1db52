"""Fixtures of the credential framework tests: test JWTs, a fake clock, isolation
(``tests/_support/tokens.py``, ``tests/_support/plugin_dists.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx import clear_credential_cache
from k8s_agent_sandbox_awx.credentials import _cache, _plugins
from tests._support.plugin_dists import installed_distributions
from tests._support.tokens import FakeClock, Minter, assert_no_secret, make_jwt, write_projected


@pytest.fixture(autouse=True)
def _isolated_cache() -> Iterator[None]:
    clear_credential_cache()
    _plugins.reset_default_registry()
    yield
    clear_credential_cache()
    _plugins.reset_default_registry()


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """Every test runs on a fake wall clock starting at ``T0`` (tokens are minted against it)."""
    fake = FakeClock()
    monkeypatch.setattr(_cache, "_clock", fake)
    return fake


@pytest.fixture
def missing_path(tmp_path: Path) -> str:
    """A default projected token path that does not exist."""
    return str(tmp_path / "no-such-dir" / "agent-sandbox-token")


@pytest.fixture
def base_env() -> dict[str, str]:
    """An environment with entry-point plugins switched off (installed plugins stay out)."""
    return {"AGENT_SANDBOX_LOAD_PLUGINS": ""}


@pytest.fixture
def mint() -> Minter:
    """``mint(aud=BROKER, now=T0, ttl=3600, header=None, **claims) -> str``: a test JWT."""
    return make_jwt


@pytest.fixture
def projected() -> Callable[[Path, str, int], Path]:
    """``projected(directory, token, generation) -> stable path``: kubelet-style layout/rotation."""
    return write_projected


@pytest.fixture
def no_secret() -> Callable[..., None]:
    """``no_secret(token, *texts)``: asserts the token (and its signature) appear in none."""
    return assert_no_secret


@pytest.fixture(scope="session")
def install_distributions() -> Callable[..., contextlib.AbstractContextManager[Path]]:
    """``with install_distributions(base, Distribution(...), ...) as site:`` (see
    :func:`tests._support.plugin_dists.installed_distributions`)."""
    return installed_distributions
