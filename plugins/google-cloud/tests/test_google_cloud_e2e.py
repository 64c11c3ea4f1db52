"""End to end: the google-cloud plugin, the core's discovery chain and cache, the local broker.

The local broker trusts a Google look-alike issuer (Google's identity-token claim shapes, served on
loopback); a loopback HTTP server, reached through ``GCE_METADATA_HOST``, stands in for the
metadata server and answers with tokens that issuer mints for the requested audience.
"""

from __future__ import annotations

import socket
import time
import warnings
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from k8s_agent_sandbox_awx import (
    ENTRY_POINT_GROUP,
    CredentialSourceError,
    DefaultCredentials,
    NoCredentialsError,
    Sandbox,
    clear_credential_cache,
    explain,
)
from k8s_agent_sandbox_awx.testing import SDK_VARIABLES, check_cached_then_refreshed

pytestmark = pytest.mark.e2e

ACCOUNT_ID = "112233445566778899001"
EMAIL = "agent@acme-agents.iam.gserviceaccount.com"
IDENTITY = "/computeMetadata/v1/instance/service-accounts/default/identity"
# The SDK's variables and those of both plugins in this repository (both are installed together).
CLEAN_ENV = (
    *SDK_VARIABLES,
    "GITHUB_ACTIONS",
    "ACTIONS_ID_TOKEN_REQUEST_URL",
    "ACTIONS_ID_TOKEN_REQUEST_TOKEN",
    "GCE_METADATA_HOST",
)


@pytest.fixture(scope="module")
def local_broker() -> Iterator[Any]:
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    from k8s_agent_sandbox_awx.testing import LocalBroker

    with LocalBroker(warn=False) as broker:
        yield broker


@pytest.fixture(scope="module")
def google_issuer(local_broker: Any) -> Any:
    from k8s_agent_sandbox_awx.testing import Policy

    return local_broker.add_issuer(
        "google",
        provider="google",
        claims={"azp": ACCOUNT_ID, "email": EMAIL, "email_verified": True},
        policy=Policy(templates=("python",), namespace="gcp"),
        attributes=("email", "azp"),
    )


@pytest.fixture
def metadata(
    endpoint: Any, google_issuer: Any, local_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, Any]]:
    """A clean process environment as a GKE pod sees it, the metadata server on loopback."""
    ttl = {"seconds": 3600}

    def mint(seen: Any) -> Any:
        url = urlsplit(seen.path)
        if seen.headers.get("Metadata-Flavor") != "Google":
            return endpoint.reply(b"Missing Metadata-Flavor:Google header.", status=403)
        if url.path != IDENTITY:
            return endpoint.reply(b"Not Found", status=404)
        query = parse_qs(url.query)
        [audience] = query["audience"]
        extra: dict[str, Any] = {}
        if query.get("format") == ["full"]:
            extra["google"] = {
                "compute_engine": {
                    "project_id": "acme-agents",
                    "project_number": 123456789012,
                    "zone": "europe-west1-b",
                    "instance_id": "4242424242424242424",
                    "instance_name": "gke-pool-1-abcd",
                    "instance_creation_timestamp": 1764400000,
                }
            }
        token = google_issuer.issue_token(
            ACCOUNT_ID, claims=extra, audience=audience, ttl=ttl["seconds"]
        )
        return endpoint.reply(token.encode())

    endpoint.responder = mint
    for name in CLEAN_ENV:
        monkeypatch.delenv(name, raising=False)
    env = {
        "AGENT_SANDBOX_BROKER_URL": local_broker.url,
        "AGENT_SANDBOX_CA_BUNDLE": local_broker.ca_bundle,
        "GCE_METADATA_HOST": f"127.0.0.1:{endpoint.port}",
    }
    clear_credential_cache()
    yield {"env": env, "ttl": ttl, "endpoint": endpoint}
    clear_credential_cache()


@pytest.mark.parametrize("load_plugins", [None, "google-cloud"])
def test_sandbox_create_zero_arg_on_google_cloud(
    metadata: dict[str, Any],
    local_broker: Any,
    google_issuer: Any,
    monkeypatch: pytest.MonkeyPatch,
    load_plugins: str | None,
) -> None:
    for name, value in metadata["env"].items():
        monkeypatch.setenv(name, value)
    if load_plugins is not None:  # as if only this plugin were installed
        monkeypatch.setenv("AGENT_SANDBOX_LOAD_PLUGINS", load_plugins)

    with Sandbox.create() as sandbox:
        result = sandbox.commands.run("echo hello from gke")
        assert result.stdout.strip() == "hello from gke"
        [claim] = [c for c in local_broker.claims() if c["metadata"]["name"] == sandbox.name]

    annotations = claim["metadata"]["annotations"]
    assert annotations["broker.agent-sandbox-awx.io/provider"] == "google"
    assert annotations["broker.agent-sandbox-awx.io/issuer"] == google_issuer.url
    assert annotations["broker.agent-sandbox-awx.io/subject"] == ACCOUNT_ID
    assert annotations["broker.agent-sandbox-awx.io/attr.email"] == EMAIL
    assert claim["metadata"]["namespace"] == "gcp"
    [seen] = metadata["endpoint"].requests
    assert parse_qs(urlsplit(seen.path).query) == {
        "audience": [local_broker.url],
        "format": ["full"],
    }

    report = explain(local_broker.url)
    assert report.selected == "google-cloud"
    assert report.claims is not None
    assert report.claims["payload"]["email"] == EMAIL
    assert report.claims["payload"]["google"]["compute_engine"]["zone"] == "europe-west1-b"
    decisions = {d.name: d for d in report.decisions}
    if load_plugins is None and "github-actions" in decisions:
        assert decisions["github-actions"].status == "not here"
        assert decisions["github-actions"].detail.startswith("GITHUB_ACTIONS is not set")


def test_one_fetch_under_concurrency_and_refresh_before_exp(
    metadata: dict[str, Any], local_broker: Any
) -> None:
    """16 threads, one fetch; served from the cache until shortly before exp, then refetched."""
    metadata["ttl"]["seconds"] = 2  # real identity tokens live 1 h; 2 s keeps the test short
    source = DefaultCredentials(environ=metadata["env"])
    check_cached_then_refreshed(
        lambda: source.get_credential(local_broker.url).token, metadata["endpoint"], callers=16
    )


def test_failing_metadata_server_stops_discovery_with_an_error(
    metadata: dict[str, Any], local_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in metadata["env"].items():
        monkeypatch.setenv(name, value)
    endpoint = metadata["endpoint"]
    endpoint.add(b"backend unavailable", status=503)
    endpoint.add(b"backend unavailable", status=503)
    with pytest.raises(CredentialSourceError) as info:
        Sandbox.create()
    assert "HTTP 503" in str(info.value)
    assert f"127.0.0.1:{endpoint.port}" in str(info.value)
    assert len(endpoint.requests) == 2  # retried once
    endpoint.add(b"backend unavailable", status=503)
    endpoint.add(b"backend unavailable", status=503)
    report = explain(local_broker.url)
    assert {d.name: d.status for d in report.decisions}["google-cloud"] == "error"


def test_not_on_google_cloud_is_reported_when_nothing_applies(
    metadata: dict[str, Any], local_broker: Any
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(metadata["env"], GCE_METADATA_HOST=f"127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(NoCredentialsError) as info:
        DefaultCredentials(environ=env).get_credential(local_broker.url)
    assert time.monotonic() - started < 2
    assert "not on Google Cloud" in str(info.value)


def test_autoload_off_means_the_metadata_server_is_never_asked(
    metadata: dict[str, Any], local_broker: Any
) -> None:
    env = dict(metadata["env"], AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD="1")
    assert "google-cloud" in {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NoCredentialsError):
            DefaultCredentials(environ=env).get_credential(local_broker.url)
        report = explain(local_broker.url, environ=env)
    assert metadata["endpoint"].requests == []
    decision = {d.name: d for d in report.decisions}["google-cloud"]
    assert decision.status == "not here"
    assert decision.detail.startswith("not loaded")
