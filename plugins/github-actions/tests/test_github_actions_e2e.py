"""End to end: the github-actions plugin, the core's discovery chain and cache, the local broker.

The local broker trusts a GitHub look-alike issuer (GitHub's claim shapes, served on loopback);
a loopback HTTP server stands in for the Actions token service and answers with tokens that
issuer mints for the requested audience.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from k8s_agent_sandbox_awx import (
    ENTRY_POINT_GROUP,
    DefaultCredentials,
    NoCredentialsError,
    Sandbox,
    clear_credential_cache,
    explain,
)
from k8s_agent_sandbox_awx.testing import SDK_VARIABLES, check_cached_then_refreshed

pytestmark = pytest.mark.e2e

REQUEST_TOKEN = "ghs_e2e-request-token-0123456789abcdef"
REPOSITORY = "acme/agents"
# The SDK's variables and those of both plugins in this repository (both are installed together).
CLEAN_ENV = (
    *SDK_VARIABLES,
    "GITHUB_ACTIONS",
    "ACTIONS_ID_TOKEN_REQUEST_URL",
    "ACTIONS_ID_TOKEN_REQUEST_TOKEN",
    "GCE_METADATA_HOST",
)


def github_claims(subject: str) -> dict[str, Any]:
    """The claims GitHub puts in a job's OIDC token, for a push to ``main`` of REPOSITORY."""
    return {
        "repository": REPOSITORY,
        "repository_owner": "acme",
        "repository_id": "123456789",
        "repository_owner_id": "987654",
        "ref": "refs/heads/main",
        "ref_type": "branch",
        "sha": "0123456789abcdef0123456789abcdef01234567",
        "workflow": "agents",
        "workflow_ref": f"{REPOSITORY}/.github/workflows/agents.yml@refs/heads/main",
        "job_workflow_ref": f"{REPOSITORY}/.github/workflows/agents.yml@refs/heads/main",
        "event_name": "push",
        "actor": "octocat",
        "run_id": "4242424242",
        "run_number": "17",
        "run_attempt": "1",
        "runner_environment": "github-hosted",
    }


@pytest.fixture(scope="module")
def local_broker() -> Iterator[Any]:
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    from k8s_agent_sandbox_awx.testing import LocalBroker

    with LocalBroker(warn=False) as broker:
        yield broker


@pytest.fixture(scope="module")
def github_issuer(local_broker: Any) -> Any:
    from k8s_agent_sandbox_awx.testing import Policy

    return local_broker.add_issuer(
        "github",
        provider="github",
        claims=github_claims,
        policy=Policy(templates=("python",), namespace="ci"),
        attributes=("repository", "ref", "ref_type", "sha", "workflow_ref", "run_id"),
    )


@pytest.fixture
def actions(
    endpoint: Any, github_issuer: Any, local_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, Any]]:
    """A clean process environment as a GitHub job with `id-token: write` has it."""
    ttl = {"seconds": 300}

    def mint(seen: Any) -> Any:
        query = parse_qs(urlsplit(seen.path).query)
        if seen.headers.get("Authorization") != f"bearer {REQUEST_TOKEN}":
            return endpoint.reply(b'{"message": "Bad credentials"}', status=401)
        [audience] = query["audience"]
        token = github_issuer.issue_token(
            f"repo:{REPOSITORY}:ref:refs/heads/main", audience=audience, ttl=ttl["seconds"]
        )
        return endpoint.reply(json.dumps({"count": 1, "value": token}).encode())

    endpoint.responder = mint
    for name in CLEAN_ENV:
        monkeypatch.delenv(name, raising=False)
    env = {
        "AGENT_SANDBOX_BROKER_URL": local_broker.url,
        "AGENT_SANDBOX_CA_BUNDLE": local_broker.ca_bundle,
        "GITHUB_ACTIONS": "true",
        "ACTIONS_ID_TOKEN_REQUEST_URL": (
            f"{endpoint.origin}/_apis/distributedtask/hubs/build/plans/p/jobs/j/idtoken"
            "?api-version=2.0"
        ),
        "ACTIONS_ID_TOKEN_REQUEST_TOKEN": REQUEST_TOKEN,
    }
    clear_credential_cache()
    yield {"env": env, "ttl": ttl, "endpoint": endpoint}
    clear_credential_cache()


@pytest.mark.parametrize("load_plugins", [None, "github-actions"])
def test_sandbox_create_zero_arg_in_a_github_job(
    actions: dict[str, Any],
    local_broker: Any,
    github_issuer: Any,
    monkeypatch: pytest.MonkeyPatch,
    load_plugins: str | None,
) -> None:
    for name, value in actions["env"].items():
        monkeypatch.setenv(name, value)
    if load_plugins is not None:  # as if only this plugin were installed
        monkeypatch.setenv("AGENT_SANDBOX_LOAD_PLUGINS", load_plugins)

    with Sandbox.create() as sandbox:
        result = sandbox.commands.run("echo hello from actions")
        assert result.stdout.strip() == "hello from actions"
        [claim] = [c for c in local_broker.claims() if c["metadata"]["name"] == sandbox.name]

    annotations = claim["metadata"]["annotations"]
    assert annotations["broker.agent-sandbox-awx.io/provider"] == "github"
    assert annotations["broker.agent-sandbox-awx.io/issuer"] == github_issuer.url
    assert annotations["broker.agent-sandbox-awx.io/subject"] == (
        f"repo:{REPOSITORY}:ref:refs/heads/main"
    )
    assert annotations["broker.agent-sandbox-awx.io/attr.repository"] == REPOSITORY
    assert claim["metadata"]["namespace"] == "ci"
    # One token request for the whole session (create, run, delete), audience = the broker URL,
    # merged into the runner's query string.
    [seen] = actions["endpoint"].requests
    query = parse_qs(urlsplit(seen.path).query)
    assert query == {"api-version": ["2.0"], "audience": [local_broker.url]}

    report = explain(local_broker.url)
    assert report.selected == "github-actions"
    assert report.claims is not None
    assert report.claims["payload"]["repository"] == REPOSITORY
    assert REQUEST_TOKEN not in str(report)


def test_one_fetch_under_concurrency_and_refresh_before_exp(
    actions: dict[str, Any], local_broker: Any
) -> None:
    """16 threads, one fetch; served from the cache until shortly before exp, then refetched."""
    actions["ttl"]["seconds"] = 2  # GitHub's tokens live ~5 min; 2 s keeps the test short
    source = DefaultCredentials(environ=actions["env"])
    check_cached_then_refreshed(
        lambda: source.get_credential(local_broker.url).token, actions["endpoint"], callers=16
    )


def test_each_sandbox_create_shares_one_fetch(
    actions: dict[str, Any], local_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Separate zero-arg clients in one process share the process-wide cache."""
    for name, value in actions["env"].items():
        monkeypatch.setenv(name, value)
    for _ in range(3):
        with Sandbox.create() as sandbox:
            sandbox.commands.run("true")
    assert len(actions["endpoint"].requests) == 1


def test_rejected_request_token_is_an_actionable_error(
    actions: dict[str, Any], local_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k8s_agent_sandbox_awx import CredentialSourceError

    env = dict(actions["env"], ACTIONS_ID_TOKEN_REQUEST_TOKEN="ghs_wrong-token-0123456789")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(CredentialSourceError) as info:
        Sandbox.create()
    message = str(info.value)
    assert "HTTP 401" in message and "permissions: id-token: write" in message
    assert "ghs_wrong-token" not in message
    assert local_broker.claims() == [] or all(
        c["metadata"]["annotations"].get("broker.agent-sandbox-awx.io/provider") != "github"
        or c["metadata"].get("deletionTimestamp")
        for c in local_broker.claims()
    )


@pytest.mark.parametrize(
    "controls",
    [
        {"AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1"},
        {"AGENT_SANDBOX_LOAD_PLUGINS": ""},
        {"AGENT_SANDBOX_LOAD_PLUGINS": "some-other-plugin"},
    ],
)
def test_plugins_off_means_neither_plugin_is_consulted(
    endpoint: Any, controls: dict[str, str]
) -> None:
    """With autoloading off, neither this plugin nor google-cloud is asked, though both apply."""
    endpoint.responder = lambda seen: endpoint.reply(b"{}", status=500)
    env = {
        "GITHUB_ACTIONS": "true",
        "ACTIONS_ID_TOKEN_REQUEST_URL": f"{endpoint.origin}/idtoken?api-version=2.0",
        "ACTIONS_ID_TOKEN_REQUEST_TOKEN": REQUEST_TOKEN,
        "GCE_METADATA_HOST": f"127.0.0.1:{endpoint.port}",
        **controls,
    }
    installed = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    ours = {"github-actions", "google-cloud"} & installed
    assert "github-actions" in ours
    broker_url = "https://sandbox-broker.example"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "some-other-plugin" is not installed: a warning
        with pytest.raises(NoCredentialsError) as info:
            DefaultCredentials(environ=env).get_credential(broker_url)
        report = explain(broker_url, environ=env)
    assert endpoint.requests == []  # neither plugin sent anything
    assert REQUEST_TOKEN not in str(info.value)
    decisions = {d.name: d for d in report.decisions}
    for name in ours:
        assert decisions[name].status == "not here"
        assert decisions[name].detail.startswith("not loaded")
    # and with the controls removed, both are consulted again (the test is not vacuous)
    on = {k: v for k, v in env.items() if k not in controls}
    report = explain(broker_url, environ=on)
    assert {d.name for d in report.decisions if not d.detail.startswith("not loaded")} >= ours
    assert endpoint.requests != []


def test_concurrent_zero_arg_clients_fetch_once(
    actions: dict[str, Any], local_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many zero-arg clients created at once (one DefaultCredentials each) share one fetch."""
    for name, value in actions["env"].items():
        monkeypatch.setenv(name, value)
    endpoint = actions["endpoint"]
    minted = endpoint.responder
    endpoint.responder = lambda seen: _slowed(minted(seen))
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            DefaultCredentials().get_credential(local_broker.url)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert len(endpoint.requests) == 1, f"{len(endpoint.requests)} fetches for 8 clients"


def _slowed(reply: Any) -> Any:
    reply.delay = 0.2
    return reply


def test_an_explicit_token_variable_beats_the_plugin_in_a_job_without_id_token(
    github_issuer: Any, local_broker: Any
) -> None:
    """The documented way out for a job that should use another identity."""
    token = local_broker.issue_kubernetes_token("runners", "arc-runner")
    env = {"GITHUB_ACTIONS": "true", "AGENT_SANDBOX_TOKEN": token}
    credential = DefaultCredentials(environ=env).get_credential(local_broker.url)
    assert credential.provider == "agent-sandbox-token"
    report = explain(local_broker.url, environ=env)
    assert report.selected == "agent-sandbox-token"
    decisions = {d.name: d.status for d in report.decisions}
    assert decisions["github-actions"] == "shadowed"  # present but broken, never reached
