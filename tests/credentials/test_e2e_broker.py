"""End-to-end: credentials found by the framework, sent by the client to the local broker over
real HTTPS on loopback, verified there with real signatures."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import (
    AudienceMismatchError,
    BrokerAuthenticationError,
    DefaultCredentials,
    MalformedTokenError,
    OIDCTokenAuth,
    Sandbox,
    explain,
)

pytestmark = pytest.mark.e2e

STAMP = "broker.agent-sandbox-awx.io/"


@pytest.fixture
def clock() -> None:
    """Real time here: the broker mints and verifies tokens against the real clock."""
    return None


def _create(broker: Any, auth: Any) -> Sandbox:
    return Sandbox.create(auth=auth, broker_url=broker.url, ca_cert=broker.ca_bundle)


def test_projected_token_rotation_between_two_requests(sandbox_broker: Any, tmp_path: Path):
    path = tmp_path / "tokens" / "agent-sandbox-token"
    path.parent.mkdir()
    first = sandbox_broker.write_projected_token(path, "team-a", "agent")
    creds = DefaultCredentials({"AGENT_SANDBOX_LOAD_PLUGINS": ""}, _token_path=str(path))
    report = explain(sandbox_broker.url, auth=creds)
    assert report.selected == "kubernetes-projected"
    assert report.claims is not None
    assert report.claims["payload"]["sub"] == "system:serviceaccount:team-a:agent"

    sandbox = _create(sandbox_broker, creds)
    try:
        assert sandbox.commands.run("echo one").stdout == "one\n"
        second = sandbox_broker.write_projected_token(path, "team-a", "agent")  # kubelet swap
        assert second != first
        sandbox_broker.revoke_token(first)  # only the rotated token is accepted from now on
        assert sandbox.commands.run("echo two").stdout == "two\n"
        sandbox_broker.revoke_token(second)  # not rotated: the re-read token is rejected
        with pytest.raises(BrokerAuthenticationError) as info:
            sandbox.commands.run("echo three")
        assert second not in str(info.value) and first not in str(info.value)
    finally:
        sandbox_broker.write_projected_token(path, "team-a", "agent")
        sandbox.kill()
    [claim] = [
        c
        for c in sandbox_broker.claims(include_deleted=True)
        if c["metadata"]["name"] == sandbox.name
    ]
    assert claim["metadata"]["annotations"][STAMP + "subject"] == (
        "system:serviceaccount:team-a:agent"
    )


def test_cached_environment_token(sandbox_broker: Any) -> None:
    token = sandbox_broker.issue_gitlab_token("group/project")
    creds = DefaultCredentials({"AGENT_SANDBOX_LOAD_PLUGINS": "", "AGENT_SANDBOX_TOKEN": token})
    sandbox = _create(sandbox_broker, creds)
    try:
        assert sandbox.commands.run("echo ok").exit_code == 0
        assert creds.get_credential(sandbox_broker.url) is creds.get_credential(
            sandbox_broker.url
        )  # served from the cache
    finally:
        sandbox.kill()


def test_a_token_for_another_audience_is_never_sent(sandbox_broker: Any) -> None:
    token = sandbox_broker.issue_kubernetes_token(
        "team-a", "agent", audience="https://other-service.example"
    )
    with pytest.raises(AudienceMismatchError) as info:
        _create(sandbox_broker, OIDCTokenAuth(token))
    assert token not in str(info.value)
    assert sandbox_broker.claims() == []  # nothing was created


def test_a_deeply_nested_jwt_is_malformed_and_never_sent(sandbox_broker: Any) -> None:
    depth = 13_000
    payload = f'{{"aud":"{sandbox_broker.url}","n":{"[" * depth}{"]" * depth}}}'.encode()
    segment = base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
    token = f"eyJhbGciOiJSUzI1NiJ9.{segment}.c2lnbmF0dXJl"
    for auth in (OIDCTokenAuth(token), DefaultCredentials({"AGENT_SANDBOX_TOKEN": token})):
        with pytest.raises(MalformedTokenError, match="nested") as info:
            _create(sandbox_broker, auth)
        assert token not in str(info.value)
    assert sandbox_broker.claims() == []  # nothing was created
