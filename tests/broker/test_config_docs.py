"""The configuration examples of docs/broker/configuration.md load (so the docs cannot drift),
with their file paths pointed at files made here; its example error is what the loader says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx.broker.config import BrokerConfig, BrokerConfigError, load_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "broker" / "configuration.md"
TEXT = DOC.read_text()
EXAMPLES = [b for b in re.findall(r"```toml\n(.*?)```", TEXT, flags=re.S) if "[server]" in b]
FILE_KEY = re.compile(r'^(\w+_file) = "([^"]+)"', flags=re.M)


def _with_local_files(example: str, directory: Path) -> tuple[str, dict[str, Path]]:
    """The example with every ``*_file`` path replaced by a file made in ``directory``."""
    made: dict[str, Path] = {}

    def local(match: re.Match[str]) -> str:
        path = directory / match.group(2).strip("/").replace("/", "_")
        path.write_text("made by the test\n")
        made[match.group(2)] = path
        return f'{match.group(1)} = "{path}"'

    return FILE_KEY.sub(local, example), made


def _load(example: str, directory: Path) -> tuple[BrokerConfig, dict[str, Path]]:
    text, made = _with_local_files(example, directory)
    path = directory / "broker.toml"
    path.write_text(text)
    return load_config(path), made


def test_the_doc_has_both_examples() -> None:
    assert len(EXAMPLES) == 2


def test_the_complete_cluster_example_loads(tmp_path: Path) -> None:
    config, made = _load(EXAMPLES[0], tmp_path)
    assert [i.provider for i in config.issuers] == [
        "kubernetes",
        "gitlab",
        "github-actions",
        "google",
    ]
    cluster = config.issuer("cluster")
    assert cluster.ca_file == made["/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"]
    assert cluster.token_file == made["/var/run/secrets/agent-sandbox-broker/token"]
    assert [p.issuer for p in config.policies] == ["cluster", "gitlab", "github", "google"]
    assert config.policies[0].namespace == "{caller.namespace}"
    kube = config.backend.kubernetes
    assert kube is not None and kube.data_plane == "router" and kube.router_url
    assert kube.router_token_file == made["/var/run/secrets/router/token"]
    assert config.server.public_url == "https://sandbox-broker.example.com"


def test_the_local_example_loads(tmp_path: Path) -> None:
    config, _ = _load(EXAMPLES[1], tmp_path)
    assert config.backend.kind == "local" and config.backend.local is not None
    assert config.issuers[0].jwks_url and not config.issuers[0].discovery


def test_the_docs_example_error_is_what_the_loader_says(tmp_path: Path) -> None:
    text, _ = _with_local_files(EXAMPLES[0], tmp_path)
    text = text.replace('provider = "gitlab"\n', 'provider = "gitlab"\nverificaton = "jwks"\n', 1)
    text = text.replace('issuer = "cluster"', 'issuer = "clustr"', 1)
    path = tmp_path / "broker.toml"
    path.write_text(text)
    with pytest.raises(BrokerConfigError) as info:
        load_config(path)
    block = re.search(r"```text\n(agent-sandbox-awx: error: .*?)```", TEXT, flags=re.S)
    assert block is not None
    documented = block.group(1).replace("/etc/agent-sandbox-broker/broker.toml", str(path))
    assert f"agent-sandbox-awx: error: {info.value}\n" == documented
