"""docs/broker/issuers.md cannot drift: each issuer's configuration loads with the broker's
loader, each caller's set-up parses, asks for the broker's audience, and names exactly the
variables and paths the SDK's credential providers read."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.broker.config import load_config
from k8s_agent_sandbox_awx.credentials._providers import (
    DEFAULT_TOKEN_PATH,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
)

yaml = pytest.importorskip("yaml", reason="needs PyYAML (the [broker] extra)")

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "docs" / "broker" / "issuers.md").read_text()
BROKER_URL = "https://sandbox-broker.example.com"
TOML = re.findall(r"```toml\n(.*?)```", TEXT, flags=re.S)
YAML = re.findall(r"```yaml\n(.*?)```", TEXT, flags=re.S)
FILE_KEY = re.compile(r'^(\w+_file) = "([^"]+)"', flags=re.M)

HEAD = f"""[server]
listen = "127.0.0.1:0"
public_url = "{BROKER_URL}"
tls_cert_file = "{{dir}}/tls.crt"
tls_key_file = "{{dir}}/tls.key"
"""
TAIL = """
[backend]
kind = "kubernetes"

[backend.kubernetes]
router_url = "http://sandbox-router-svc.agent-sandbox-system.svc.cluster.local:8080"
"""


def _section(title: str) -> str:
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", TEXT, flags=re.S | re.M)
    assert found is not None, title
    return found.group(1)


def _load(example: str, directory: Path) -> Any:
    for name in ("tls.crt", "tls.key"):
        (directory / name).write_text("made by the test\n")

    def local(match: re.Match[str]) -> str:
        path = directory / match.group(2).strip("/").replace("/", "_")
        path.write_text("made by the test\n")
        return f'{match.group(1)} = "{path}"'

    path = directory / "broker.toml"
    path.write_text(HEAD.format(dir=directory) + FILE_KEY.sub(local, example) + TAIL)
    return load_config(path)


def test_the_doc_has_the_three_issuers() -> None:
    assert len(TOML) == 3 and len(YAML) == 3


@pytest.mark.parametrize(
    ("index", "provider", "policy"),
    [(0, "kubernetes", "team-a"), (1, "gitlab", "ci-platform"), (2, "github-actions", None)],
)
def test_each_issuers_configuration_loads(
    index: int, provider: str, policy: str | None, tmp_path: Path
) -> None:
    config = _load(TOML[index], tmp_path)
    [issuer] = config.issuers
    assert issuer.provider == provider
    [rule] = config.policies
    assert rule.issuer == issuer.name
    if policy is not None:
        assert rule.name == policy


def test_the_pod_asks_for_the_broker_audience_where_the_sdk_reads_it() -> None:
    [pod] = re.findall(r"```yaml\n(.*?)```", _section("The cluster's own ServiceAccounts"), re.S)
    spec = yaml.safe_load(pod)["spec"]
    [container] = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["AGENT_SANDBOX_BROKER_URL"] == BROKER_URL
    volumes = {v["name"]: v for v in spec["volumes"]}
    [source] = volumes["agent-sandbox-token"]["projected"]["sources"]
    token = source["serviceAccountToken"]
    assert token["audience"] == BROKER_URL
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert f"{mounts['agent-sandbox-token']}/{token['path']}" == DEFAULT_TOKEN_PATH
    assert spec["automountServiceAccountToken"] is False
    assert TOKEN_FILE_ENV in _section("The cluster's own ServiceAccounts")


def test_the_gitlab_job_puts_its_id_token_in_the_sdks_variable() -> None:
    [job] = re.findall(r"```yaml\n(.*?)```", _section("GitLab CI"), re.S)
    agent = yaml.safe_load(job)["agent"]
    assert agent["id_tokens"] == {TOKEN_ENV: {"aud": BROKER_URL}}
    assert agent["variables"]["AGENT_SANDBOX_BROKER_URL"] == BROKER_URL


def test_the_github_workflow_grants_the_permission_the_plugin_needs() -> None:
    plugin = pytest.importorskip("k8s_agent_sandbox_awx_github_actions")
    [workflow] = re.findall(r"```yaml\n(.*?)```", _section("GitHub Actions"), re.S)
    parsed = yaml.safe_load(workflow)
    assert parsed["permissions"]["id-token"] == "write"
    assert parsed["jobs"]["agent"]["env"]["AGENT_SANDBOX_BROKER_URL"] == BROKER_URL
    text = _section("GitHub Actions")
    for name in (plugin.ACTIONS_VAR, plugin.REQUEST_URL_VAR, plugin.REQUEST_TOKEN_VAR):
        assert f"`{name}`" in text
    assert "plugins/github-actions" in workflow
