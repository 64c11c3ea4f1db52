"""No redirect is followed and no Authorization reaches another origin (own loopback servers)."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import (
    BrokerConnectionConfig,
    BrokerRedirectError,
    BrokerSandboxClient,
    Sandbox,
)
from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget, SandboxInfo

pytestmark = pytest.mark.e2e


def test_no_redirect_is_followed(redirect_servers: Any, kit: Any) -> None:
    redirector, recorder, ca = redirect_servers
    config = BrokerConnectionConfig(broker_url=redirector.url, ca_cert=ca, max_attempts=1)
    with BrokerSandboxClient(config, auth=kit.StubCredentials()) as client:
        for call in (client.whoami, client.list_sandboxes, lambda: client.create_sandbox("py")):
            with pytest.raises(BrokerRedirectError) as info:
                call()
            assert info.value.location and info.value.location.startswith(recorder.url)
            assert "never followed" in str(info.value)
        sandbox = Sandbox(
            client, SandboxInfo("s", "default", None, "Ready", True, RouterTarget("s"))
        )
        with pytest.raises(BrokerRedirectError):
            sandbox.commands.run("echo hi")
        with pytest.raises(BrokerRedirectError):
            sandbox.files.write("a.txt", b"data")
        with pytest.raises(BrokerRedirectError):
            sandbox.files.read_to("a.txt", Path(ca).parent / "out")
        sandbox._killed = True  # nothing to delete on exit
    assert len(redirector.seen) == 6
    assert all(s["Authorization"] == f"Bearer {kit.TOKEN}" for s in redirector.seen)
    assert recorder.seen == []  # the token never reached the other origin


def test_recorder_sanity(redirect_servers: Any) -> None:
    """The recorder does record (so an empty record above means nothing arrived)."""
    import httpx

    _, recorder, ca = redirect_servers
    httpx.get(recorder.url + "/probe", verify=ssl.create_default_context(cafile=ca))
    assert [s["path"] for s in recorder.seen] == ["/probe"]


def test_ca_cert_and_client_cert_are_used(tmp_path: Path, https_server: Any) -> None:
    """mTLS: the configured CA verifies the server; the client certificate is presented."""
    from k8s_agent_sandbox_awx import BrokerUnavailableError

    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    context.verify_mode = ssl.CERT_REQUIRED
    ca.configure_trust(context)
    ca_path, cert_path, key_path = tmp_path / "ca.pem", tmp_path / "c.pem", tmp_path / "k.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    leaf = ca.issue_cert("agent.client.example")
    leaf.cert_chain_pems[0].write_to_path(str(cert_path))
    leaf.private_key_pem.write_to_path(str(key_path))
    server = https_server(context)
    config = BrokerConnectionConfig(
        broker_url=server.url, ca_cert=str(ca_path), client_cert=(str(cert_path), str(key_path))
    )
    with BrokerSandboxClient(config, auth=_NoToken()) as client:
        assert client.healthz().status_code == 200
    without = BrokerConnectionConfig(broker_url=server.url, ca_cert=str(ca_path), max_attempts=1)
    with (
        BrokerSandboxClient(without, auth=_NoToken()) as client,
        pytest.raises(BrokerUnavailableError),
    ):
        client.healthz()
    assert len(server.seen) == 1


class _NoToken:
    def get_credential(self, audience: str) -> Any:
        raise AssertionError("healthz must not ask for a token")

    def invalidate(self, audience: str) -> None:
        pass
