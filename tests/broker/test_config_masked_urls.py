"""Secrets echoed by ``broker check`` (issue 26, item 15): a URL carrying credentials in its
query or fragment (``?private_token=...``, ``#tok=...``) or its user info was printed in the
configuration's error messages; none of them reaches a message or the effective-configuration
dump now, whatever key holds it, and the messages of the issuer settings, the kubeconfig and
the router address mask them the same way."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx._urls import masked_url
from tests._support.broker_server import CLI, Pki

SECRETS = [f"SECRET{i}x" for i in range(12)]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://h.example/p?private_token=abc#tok=def", "https://h.example/p?***#***"),
        ("https://user:pw@h.example:8443/x", "https://***@h.example:8443/x"),
        ("https://h.example#access_token=abc", "https://h.example#***"),
        ("h.example/?t=1", "h.example/?***"),
        ("user:pw@h.example", "***@h.example"),
        ("https://h.example/jwks", "https://h.example/jwks"),
        ("https://[::1]:8443/a?b", "https://[::1]:8443/a?***"),
        ("https://a@b@h.example/?x@y", "https://***@h.example/?***"),
    ],
)
def test_masked_url(url: str, shown: str) -> None:
    assert masked_url(url) == shown


def check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "broker", "check", "--config", str(path)], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_broker_check_masks_every_url_in_its_messages(tmp_path: Path) -> None:
    s = SECRETS
    path = tmp_path / "broker.toml"
    path.write_text(f"""\
[server]
listen = "127.0.0.1:8443"
public_url = "https://broker.example?private_token={s[0]}#tok={s[1]}"
tls_cert_file = "/etc/hosts"
tls_key_file = "/etc/hosts"

[[issuers]]
name = "gitlab"
url = "https://user:{s[2]}@gitlab.example.com/?private_token={s[3]}"
jwks_url = "https://gitlab.example.com/jwks#{s[4]}"
provider = "https://provider.example/?k={s[5]}"

[[issuers]]
name = "other"
url = "https://other.example"
provider = "gitlab"
audiences = ["https://b.example/?{s[6]}", "https://b.example/?{s[6]}"]

[[policies]]
name = "all"
issuer = "gitlab"
warm_pools = ["python"]
namespace = "https://ns.example/?{s[7]}"

[backend]
kind = "kubernetes"
[backend.kubernetes]
router_url = "http://router.example/#tok={s[8]}"
""")
    done = check(path)
    assert done.returncode == 2, done.stderr
    for key in ("public_url", "url", "jwks_url", "provider", "audiences", "namespace", "router"):
        assert key in done.stderr, (key, done.stderr)  # each problem is reported ...
    leaked = [secret for secret in s if secret in done.stdout + done.stderr]
    assert not leaked, done.stderr  # ... and none quotes a secret
    assert "https://***@gitlab.example.com/?***" in done.stderr


def test_the_effective_configuration_masks_urls(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    pki.write(pki.issue())
    path = tmp_path / "broker.toml"
    path.write_text(f"""\
[server]
listen = "127.0.0.1:8443"
public_url = "https://broker.example"
tls_cert_file = "{pki.cert_file}"
tls_key_file = "{pki.key_file}"

[[issuers]]
name = "gitlab"
url = "https://gitlab.example.com"
provider = "gitlab"
audiences = ["https://broker.example/?aud_token={SECRETS[9]}", "sandbox-broker#{SECRETS[10]}"]

[[policies]]
name = "all"
issuer = "gitlab"
claims = {{ project_path = "group/*?" }}
warm_pools = ["python"]
namespace = "team"

[backend]
kind = "kubernetes"
[backend.kubernetes]
router_url = "http://router.example:8080"
""")
    done = check(path)
    assert done.returncode == 0, done.stderr
    assert not [secret for secret in SECRETS if secret in done.stdout + done.stderr], done.stdout
    assert '"https://broker.example/?***"' in done.stdout and '"sandbox-broker#***"' in done.stdout
    assert 'project_path = ["group/*?"]' in done.stdout  # a glob is no URL: shown as written
    assert 'url = "https://gitlab.example.com"' in done.stdout


def test_the_other_messages_that_quote_a_url_mask_it() -> None:
    from k8s_agent_sandbox_awx.broker.backends.kubernetes._api_config import (
        KubeConfigError,
        connection,
    )
    from k8s_agent_sandbox_awx.broker.backends.kubernetes._routes import _router_address
    from k8s_agent_sandbox_awx.broker.identity._settings import IssuerSettings, SettingsError

    texts = []
    bad_urls = [
        {"url": f"http://i.example/?t={SECRETS[0]}"},
        {"url": "https://i.example", "jwks_url": f"http://i.example/k#{SECRETS[1]}"},
    ]
    for bad in bad_urls:
        with pytest.raises(SettingsError) as settings:
            IssuerSettings(name="i", provider="gitlab", **bad)  # type: ignore[arg-type]
        texts.append(str(settings.value))
    for server in (f"ftp://u:{SECRETS[2]}@k.example", f"http://k.example/?t={SECRETS[3]}"):
        with pytest.raises(KubeConfigError) as kube:
            connection(server)
        texts.append(str(kube.value))
    for router in (f"ftp://r.example/?{SECRETS[4]}", f"http://r.example/p?t={SECRETS[5]}"):
        with pytest.raises(ValueError) as routed:
            _router_address(router)
        texts.append(str(routed.value))
    assert len(texts) == 6 and not [s for s in SECRETS if any(s in t for t in texts)], texts
