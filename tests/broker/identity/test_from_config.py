"""The configuration file's issuers and policies become the identity layer's objects
(broker/_identity_config.py): the documented examples and the deployment's broker.toml build,
every key maps, and a configuration file verifies a real token and admits it by its rules."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]

from k8s_agent_sandbox_awx.broker._identity_config import identity_from_config, issuer_settings
from k8s_agent_sandbox_awx.broker.config import load_config
from k8s_agent_sandbox_awx.broker.identity._rules import PolicyDenied
from k8s_agent_sandbox_awx.broker.identity._settings import IssuerSettings
from tests._support.oidc_issuer import ScriptedIssuer

ROOT = Path(__file__).resolve().parents[3]


def _examples() -> list[str]:
    text = (ROOT / "docs" / "broker" / "configuration.md").read_text()
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", text, flags=re.S) if "[server]" in b]
    configmap = yaml.safe_load((ROOT / "deploy" / "broker" / "configmap.yaml").read_text())
    return [*blocks, configmap["data"]["broker.toml"]]


@pytest.mark.parametrize("index", range(3))
def test_the_documented_configurations_build(index: int, tmp_path: Path) -> None:
    path = tmp_path / "broker.toml"
    path.write_text(_examples()[index])
    config = load_config(path, check_files=False)
    verifier, policies = identity_from_config(config, reviewer=object())  # type: ignore[arg-type]
    names = [i.name for i in config.issuers]
    assert sorted(verifier.readiness()) == sorted(names)
    assert [r.name for r in policies.rules] == [p.name for p in config.policies]
    for issuer in config.issuers:  # every key of the table is a field of the settings
        settings = issuer_settings(issuer)
        fields = {f.name for f in dataclasses.fields(IssuerSettings)}
        for field in dataclasses.fields(issuer):
            assert field.name in fields, field.name
            value = getattr(issuer, field.name)
            expected = str(value) if isinstance(value, Path) else value
            assert getattr(settings, field.name) == expected, field.name


@pytest.mark.asyncio
async def test_a_configuration_file_verifies_and_admits(
    issuer: ScriptedIssuer, tmp_path: Path
) -> None:
    path = tmp_path / "broker.toml"
    path.write_text(f"""
[server]
public_url = "https://broker.test"
tls_cert_file = "tls.crt"
tls_key_file = "tls.key"

[[issuers]]
name = "ci"
url = "{issuer.url}"
provider = "gitlab"
ca_file = "{issuer.ca_file}"
attributes = ["project_path", "namespace"]

[[policies]]
name = "deploys"
issuer = "ci"
claims = {{ project_path = "platform/*", ref_protected = "true" }}
warm_pools = ["python"]
namespace = "{{caller.namespace}}"
max_sandboxes = 2

[backend]
kind = "local"

[backend.local]
templates = {{ python = "" }}
""")
    verifier, policies = identity_from_config(load_config(path, check_files=False))
    token = issuer.token(
        "project_path:platform/app", project_path="platform/app", ref_protected="true",
        namespace="ci-runs", user_email="dev@example.com",
    )  # fmt: skip
    caller, configured = await verifier.verify(f"Bearer {token}")
    assert configured.name == "ci" and caller.provider == "gitlab"
    assert caller.attributes == {"project_path": "platform/app", "namespace": "ci-runs"}
    policy = policies.policy_for(caller)
    assert policy.max_sandboxes == 2 and policy.namespace_for(caller) == "ci-runs"
    unprotected = issuer.token("x", project_path="platform/app", ref_protected="false")
    caller, _ = await verifier.verify(f"Bearer {unprotected}")
    with pytest.raises(PolicyDenied, match="no policy admits issuer 'ci'"):
        policies.policy_for(caller)
    await verifier.aclose()
