"""Real installed distributions: built from source and pip-installed by the test into a target
directory (offline, no build isolation, hatchling from this environment), then discovered
through importlib.metadata exactly as in production."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import (
    ENTRY_POINT_GROUP,
    CredentialPluginWarning,
    DefaultCredentials,
    NoCredentialsError,
    explain,
)

BROKER = "https://sandbox-broker.example"

PROVIDER_MODULE = """
from __future__ import annotations

from k8s_agent_sandbox_awx import Credential, CredentialRequest, ProviderInfo, hookimpl

NAME = {name!r}
VARIABLE = {variable!r}


@hookimpl
def agent_sandbox_provider_info() -> ProviderInfo:
    return ProviderInfo(priority={priority}, hint=f"set {{VARIABLE}}", description=NAME)


@hookimpl
def agent_sandbox_get_credential(request: CredentialRequest) -> Credential | None:
    value = request.environ.get(VARIABLE)
    if value is None:
        return request.not_here(f"{{VARIABLE}} is not set")
    return Credential(value, NAME, file_backed=False, source=VARIABLE)
"""


ASYNC_PROVIDER_MODULE = """
from __future__ import annotations

import asyncio

from k8s_agent_sandbox_awx import Credential, CredentialRequest, hookimpl

CALLS: list[str] = []


@hookimpl
async def agent_sandbox_get_credential_async(request: CredentialRequest) -> Credential | None:
    CALLS.append(request.audience)
    await asyncio.sleep(0)
    value = request.environ.get("SBX_TEST_DELTA")
    if value is None:
        return request.not_here("SBX_TEST_DELTA is not set")
    return Credential(value, "delta", source="SBX_TEST_DELTA")
"""


@pytest.fixture(scope="module")
def installed(
    tmp_path_factory: pytest.TempPathFactory, install_distributions: Any
) -> Iterator[Path]:
    """Two distributions installed into a fresh target directory put on ``sys.path``."""
    modules = {
        "alpha": PROVIDER_MODULE.format(name="alpha", variable="SBX_TEST_ALPHA", priority=10),
        "beta": PROVIDER_MODULE.format(name="beta", variable="SBX_TEST_BETA", priority=10),
        "gamma": PROVIDER_MODULE.format(name="gamma", variable="SBX_TEST_GAMMA", priority=50),
        "squatter": PROVIDER_MODULE.format(
            name="kubernetes-projected", variable="SBX_TEST_SQUAT", priority=99
        ),
        "broken": 'raise ImportError("sbx_test_providers.broken needs the [extra] extra")\n',
        "delta": ASYNC_PROVIDER_MODULE,
    }
    providers = (
        "sbx-test-providers",
        "sbx_test_providers",
        modules,
        {
            "alpha": "alpha",
            "beta": "beta",
            "gamma": "gamma",
            "broken": "broken",
            "kubernetes-projected": "squatter",
            "epsilon": "alpha",
            "delta": "delta",
        },
    )
    duplicate = (
        "sbx-test-duplicate",
        "sbx_test_duplicate",
        {"epsilon": PROVIDER_MODULE.format(name="eps", variable="SBX_TEST_DUP", priority=0)},
        {"epsilon": "epsilon"},
    )
    with install_distributions(
        tmp_path_factory.mktemp("plugin-dists"), providers, duplicate
    ) as site:
        yield site


def _names(creds: DefaultCredentials) -> list[str]:
    return [p.name for p in creds.registry().providers]


def _env(**extra: str) -> dict[str, str]:
    return {"AGENT_SANDBOX_LOAD_PLUGINS": "alpha,beta,gamma", **extra}


def test_the_distribution_is_really_installed(installed: Path) -> None:
    dist = importlib.metadata.distribution("sbx-test-providers")
    assert Path(str(dist.locate_file(""))).resolve() == installed.resolve()
    eps = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert {"alpha", "beta", "gamma", "broken", "kubernetes-projected", "delta"} <= eps


def test_discovered_and_ordered_by_priority_then_name(installed, missing_path) -> None:
    names = _names(DefaultCredentials(_env(), _token_path=missing_path))
    assert names == [
        "agent-sandbox-token",
        "agent-sandbox-token-file",
        "gamma",  # priority 50
        "alpha",  # priority 10, name before beta
        "beta",
        "kubernetes-projected",
    ]


def test_the_highest_ranked_present_plugin_wins(installed, missing_path, mint) -> None:
    tokens = {n: mint(sub=n) for n in ("alpha", "beta", "gamma")}
    env = _env(SBX_TEST_ALPHA=tokens["alpha"], SBX_TEST_BETA=tokens["beta"])
    cred = DefaultCredentials(env, _token_path=missing_path).get_credential(BROKER)
    assert (cred.provider, cred.token) == ("alpha", tokens["alpha"])
    env["SBX_TEST_GAMMA"] = tokens["gamma"]
    result = explain(BROKER, auth=DefaultCredentials(env, _token_path=missing_path))
    assert result.selected == "gamma"
    statuses = {d.name: d.status for d in result.decisions}
    assert statuses["alpha"] == statuses["beta"] == "shadowed"
    assert "entry point 'gamma'" not in str(result)  # origin shown only for problems


def test_load_plugins_limits_to_named_entry_points(installed, missing_path, mint) -> None:
    token = mint()
    env = {
        "AGENT_SANDBOX_LOAD_PLUGINS": " beta ",
        "SBX_TEST_ALPHA": mint(),
        "SBX_TEST_BETA": token,
    }
    creds = DefaultCredentials(env, _token_path=missing_path)
    assert "alpha" not in _names(creds) and "beta" in _names(creds)
    assert creds.get_credential(BROKER).token == token
    decisions = {d.name: d for d in explain(BROKER, auth=creds).decisions}
    assert decisions["alpha"].status == "not here"
    assert "AGENT_SANDBOX_LOAD_PLUGINS does not name it" in decisions["alpha"].detail
    assert "sbx-test-providers 1.0" in decisions["alpha"].detail


def test_load_plugins_empty_loads_none(installed, missing_path, mint) -> None:
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": "", "SBX_TEST_ALPHA": mint()}
    creds = DefaultCredentials(env, _token_path=missing_path)
    assert _names(creds) == [
        "agent-sandbox-token",
        "agent-sandbox-token-file",
        "kubernetes-projected",
    ]
    with pytest.raises(NoCredentialsError):
        creds.get_credential(BROKER)


def test_disable_autoload_blocks_every_entry_point(installed, missing_path, mint) -> None:
    env = {
        "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
        "AGENT_SANDBOX_LOAD_PLUGINS": "alpha",  # the kill switch wins
        "SBX_TEST_ALPHA": mint(),
    }
    creds = DefaultCredentials(env, _token_path=missing_path)
    assert "alpha" not in _names(creds)
    with pytest.raises(NoCredentialsError):
        creds.get_credential(BROKER)
    detail = {d.name: d.detail for d in explain(BROKER, auth=creds).decisions}["alpha"]
    assert "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD is set" in detail


def test_load_plugins_naming_a_missing_entry_point_warns(installed, missing_path) -> None:
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": "alpha,sbx-test-providers"}
    with pytest.warns(CredentialPluginWarning, match="entry-point names, not distribution"):
        creds = DefaultCredentials(env, _token_path=missing_path)
        creds.registry()
    assert {d.name: d.status for d in explain(BROKER, auth=creds).decisions}[
        "sbx-test-providers"
    ] == "failed to load"


@pytest.mark.parametrize(
    "given", ["sbx-test-duplicate", "SBX_Test.Duplicate", "sbx_test_duplicate"]
)
def test_a_distribution_or_module_in_load_plugins_is_told_its_entry_point_names(
    installed, missing_path, given: str
) -> None:
    """The warning for a name no entry point has says what to write instead: a distribution's
    name (in any spelling pip accepts) or a module's is answered with its entry points."""
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": given}
    with pytest.warns(CredentialPluginWarning) as record:
        creds = DefaultCredentials(env, _token_path=missing_path)
        creds.registry()
    [message] = [str(w.message) for w in record if f"names {given!r}" in str(w.message)]
    assert "entry-point names, not distribution or module names" in message
    assert f"{given!r} provides the entry point 'epsilon'" in message
    assert "AGENT_SANDBOX_LOAD_PLUGINS=epsilon" in message
    detail = {d.name: d.detail for d in explain(BROKER, auth=creds).decisions}[given]
    assert "AGENT_SANDBOX_LOAD_PLUGINS=epsilon" in detail


def test_an_unknown_name_in_load_plugins_is_told_the_installed_entry_points(
    installed, missing_path
) -> None:
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": "no-such-plugin"}
    with pytest.warns(CredentialPluginWarning) as record:
        DefaultCredentials(env, _token_path=missing_path).registry()
    [message] = [str(w.message) for w in record]
    assert "the installed entry points are" in message
    assert "'alpha'" in message and "'gamma'" in message


def test_broken_plugin_is_skipped_with_a_warning(installed, missing_path, mint, caplog) -> None:
    token = mint()
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": "broken,alpha", "SBX_TEST_ALPHA": token}
    with pytest.warns(CredentialPluginWarning, match="'broken'.*could not be loaded"):
        creds = DefaultCredentials(env, _token_path=missing_path)
        assert creds.get_credential(BROKER).token == token  # the SDK still works
    # reported once, as a warning: not also as a log record (a user would see it twice)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    decision = {d.name: d for d in explain(BROKER, auth=creds).decisions}["broken"]
    assert decision.status == "failed to load"
    assert "ImportError: sbx_test_providers.broken needs the [extra] extra" in decision.detail


def test_reserved_name_squatter_and_duplicate_are_refused(installed, missing_path, mint):
    env = {
        "AGENT_SANDBOX_LOAD_PLUGINS": "alpha,kubernetes-projected,epsilon",
        "SBX_TEST_SQUAT": mint(sub="squatter"),
        "SBX_TEST_DUP": mint(sub="duplicate"),
    }
    with pytest.warns(CredentialPluginWarning) as record:
        creds = DefaultCredentials(env, _token_path=missing_path)
        names = _names(creds)
    messages = [str(w.message) for w in record]
    assert any("reserved name" in m and "sbx-test-providers" in m for m in messages)
    # two distributions provide 'epsilon': ambiguous, so neither is loaded
    assert any("2 installed entry points" in m and "sbx-test-duplicate" in m for m in messages)
    assert any("2 installed entry points" in m and "sbx-test-providers" in m for m in messages)
    assert names.count("kubernetes-projected") == 1 and "epsilon" not in names
    assert "alpha" in names
    with pytest.raises(NoCredentialsError):
        creds.get_credential(BROKER)  # neither the squatter nor the duplicate answered
    failed = [d for d in explain(BROKER, auth=creds).decisions if d.status == "failed to load"]
    assert {d.name for d in failed} == {"kubernetes-projected", "epsilon"}


def test_default_registry_loads_once_per_process(installed, monkeypatch, mint) -> None:
    monkeypatch.setenv("AGENT_SANDBOX_LOAD_PLUGINS", "gamma")
    monkeypatch.setenv("SBX_TEST_GAMMA", mint())
    for name in ("AGENT_SANDBOX_TOKEN", "AGENT_SANDBOX_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    a, b = DefaultCredentials(), DefaultCredentials()
    assert a.registry() is b.registry()
    assert a.get_credential(BROKER).provider == "gamma"


@pytest.mark.asyncio
async def test_an_installed_async_only_plugin_on_both_paths(installed, missing_path, mint):
    token = mint()
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": "delta", "SBX_TEST_DELTA": token}
    creds = DefaultCredentials(env, _token_path=missing_path)
    cred = await creds.aget_credential(BROKER)
    assert (cred.token, cred.provider, cred.source) == (token, "delta", "SBX_TEST_DELTA")
    calls = importlib.import_module("sbx_test_providers.delta").CALLS
    assert calls == [BROKER]
    # the sync path runs the async hook on a helper thread's loop
    sync_creds = DefaultCredentials(env, _token_path=missing_path)
    assert sync_creds.get_credential(BROKER).token == token
    assert explain(BROKER, auth=sync_creds).selected == "delta"
    with pytest.raises(NoCredentialsError, match="delta: SBX_TEST_DELTA is not set"):
        await DefaultCredentials(
            {"AGENT_SANDBOX_LOAD_PLUGINS": "delta"}, _token_path=missing_path
        ).aget_credential(BROKER)
