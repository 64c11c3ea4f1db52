"""Issue 30, the platform engineer's surface: ``broker serve --help`` lists no client option,
operate.md quotes the start-up line ``broker serve`` prints, and an issuer whose keys sit under
an in-cluster host name gets ``/readyz`` guidance in the configuration's own words."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from k8s_agent_sandbox_awx.broker.identity._configured import configured_verifier
from k8s_agent_sandbox_awx.broker.identity._settings import IssuerSettings
from k8s_agent_sandbox_awx.cli._broker import serving_line
from k8s_agent_sandbox_awx.cli._cli import main

ROOT = Path(__file__).resolve().parents[2]
CLIENT_OPTIONS = ("--broker-url", "--ca-bundle", "--allow-insecure-http")


@pytest.mark.parametrize("argv", [["broker", "serve"], ["broker", "check"], ["broker"]])
def test_broker_help_lists_no_client_option(argv: list[str], capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert "--config" in out or "ACTION" in out, out
    assert [o for o in CLIENT_OPTIONS if o in out] == [], out
    with pytest.raises(SystemExit):  # a client command keeps them after its name
        main(["ls", "--help"])
    help_text = capsys.readouterr().out
    assert all(o in help_text for o in CLIENT_OPTIONS), help_text


def test_operate_md_quotes_the_line_broker_serve_prints() -> None:
    config: Any = SimpleNamespace(
        server=SimpleNamespace(public_url="https://sandbox-broker.example.com"),
        issuers=[1, 2],
        policies=[1, 2, 3],
        backend=SimpleNamespace(kind="kubernetes"),
    )
    printed = serving_line("https://0.0.0.0:8443", config)
    text = (ROOT / "docs/broker/operate.md").read_text()
    assert printed in text.splitlines(), printed
    assert "serving at" not in text


@pytest.mark.asyncio
async def test_an_in_cluster_issuer_says_to_set_jwks_url_in_readyz(
    resolve_to_loopback: Any,
) -> None:
    """Item 18: an API server whose issuer is ``https://kubernetes.default.svc`` never
    resolves off the cluster; the broker never became ready and ``/readyz`` only said the
    fetch failed. Now it says to set ``jwks_url`` to the discovery document's ``jwks_uri``."""
    resolve_to_loopback("unused.example")  # no name leaves this machine: the in-cluster one fails
    settings = IssuerSettings(
        name="cluster",
        url="https://kubernetes.default.svc",
        provider="kubernetes",
        audiences=("https://sandbox-broker.example.com",),
        discovery=True,
    )
    verifier = configured_verifier([settings], audience="https://sandbox-broker.example.com")
    try:
        assert await verifier.load() == {"cluster": False}
        said = verifier.readiness()["cluster"]["last_error"]
        assert "'kubernetes.default.svc' is a name inside the cluster" in said, said
        assert "set jwks_url to the jwks_uri of the API server's discovery document" in said
        assert "discovery = false" in said and "kubectl get --raw" in said
    finally:
        await verifier.aclose()
    outside = IssuerSettings(name="gitlab", url="https://gitlab.example", provider="gitlab")
    from k8s_agent_sandbox_awx.broker.identity._in_cluster import jwks_hint

    assert jwks_hint(outside.url, None) is None
    assert jwks_hint(settings.url, "https://10.0.0.1:6443/openid/v1/jwks") is None
