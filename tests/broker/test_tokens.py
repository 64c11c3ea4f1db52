"""Issuers: real token shapes, discovery and JWKS, projected token files, key rotation."""

from __future__ import annotations

import os
import ssl
import time
from pathlib import Path
from typing import Any

import httpx
import jwt

from k8s_agent_sandbox_awx.testing import LocalBroker


def _claims(token: str) -> dict[str, Any]:
    claims: dict[str, Any] = jwt.decode(token, options={"verify_signature": False})
    return claims


def test_kubernetes_token_claims(broker: LocalBroker) -> None:
    token = broker.issue_kubernetes_token("team-a", "agent", ttl=900)
    header = jwt.get_unverified_header(token)
    assert header["alg"] == "RS256"
    assert header["kid"] == broker.kubernetes.current_kid
    claims = _claims(token)
    assert claims["iss"] == f"{broker.url}/issuers/kubernetes"
    assert claims["sub"] == "system:serviceaccount:team-a:agent"
    assert claims["aud"] == [broker.url]
    assert claims["nbf"] == claims["iat"]
    assert claims["exp"] - claims["iat"] == 900
    assert claims["jti"]
    info = claims["kubernetes.io"]
    assert info["namespace"] == "team-a"
    assert info["serviceaccount"]["name"] == "agent"
    assert info["serviceaccount"]["uid"]
    assert info["pod"]["name"]
    assert info["pod"]["uid"]
    again = _claims(broker.issue_kubernetes_token("team-a", "agent"))
    assert again["kubernetes.io"]["serviceaccount"]["uid"] == info["serviceaccount"]["uid"]


def test_gitlab_token_claims(broker: LocalBroker) -> None:
    claims = _claims(broker.issue_gitlab_token("group/sub/project", ref="v1.2", ref_type="tag"))
    assert claims["iss"] == f"{broker.url}/issuers/gitlab"
    assert claims["sub"] == "project_path:group/sub/project:ref_type:tag:ref:v1.2"
    assert claims["aud"] == broker.url
    assert claims["project_path"] == "group/sub/project"
    assert claims["namespace_path"] == "group/sub"
    assert claims["ref"] == "v1.2"
    assert claims["ref_type"] == "tag"
    assert claims["ref_protected"] in ("true", "false")
    for name in ("project_id", "pipeline_id", "job_id", "user_login", "jti", "exp", "iat", "nbf"):
        assert name in claims, name
    assert isinstance(claims["project_id"], str)


def test_discovery_and_jwks_over_https(broker: LocalBroker) -> None:
    ctx = ssl.create_default_context(cafile=broker.ca_bundle)
    with httpx.Client(verify=ctx) as http:
        for issuer in (broker.kubernetes, broker.gitlab):
            disco = http.get(f"{issuer.url}/.well-known/openid-configuration").json()
            assert disco["issuer"] == issuer.url
            jwks = http.get(disco["jwks_uri"]).json()
            assert {k["kid"] for k in jwks["keys"]} >= {issuer.current_kid}
            assert all("d" not in k for k in jwks["keys"])  # public keys only


def test_projected_token_file_is_kubelet_style_and_rotates(
    broker: LocalBroker, tmp_path: Path
) -> None:
    path = tmp_path / "tokens" / "agent-sandbox-token"
    first = broker.write_projected_token(path, "team-a", "agent", ttl=600)
    assert path.is_symlink()
    assert os.readlink(path) == os.path.join("..data", "agent-sandbox-token")
    data = tmp_path / "tokens" / "..data"
    assert data.is_symlink()
    old_dir = os.readlink(data)
    assert path.read_text() == first
    second = broker.write_projected_token(path, "team-a", "agent", ttl=600)
    assert second != first
    assert path.read_text() == second
    assert os.readlink(data) != old_dir
    assert not (tmp_path / "tokens" / old_dir).exists()
    assert _claims(second)["sub"] == "system:serviceaccount:team-a:agent"


def test_environ(broker: LocalBroker, tmp_path: Path) -> None:
    env = broker.environ("kubernetes", namespace="team-a", service_account="x")
    assert env["AGENT_SANDBOX_BROKER_URL"] == broker.url
    assert env["AGENT_SANDBOX_CA_BUNDLE"] == broker.ca_bundle
    token = Path(env["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
    assert _claims(token)["sub"] == "system:serviceaccount:team-a:x"
    gitlab = broker.environ("gitlab", project_path="g/p")
    assert _claims(gitlab["AGENT_SANDBOX_TOKEN"])["project_path"] == "g/p"


def test_key_rotation_refetches_jwks_once(broker: LocalBroker, api: Any) -> None:
    old = broker.issue_kubernetes_token("team-a", "alice")
    assert api(old).http.get("/v1/whoami").status_code == 200
    verifier = broker._app.verifier  # type: ignore[union-attr]
    before = verifier.jwks_fetches
    broker.rotate_keys("kubernetes")
    new = broker.issue_kubernetes_token("team-a", "alice")
    assert jwt.get_unverified_header(new)["kid"] != jwt.get_unverified_header(old)["kid"]
    assert api(new).http.get("/v1/whoami").status_code == 200
    assert api(new).http.get("/v1/whoami").status_code == 200
    assert verifier.jwks_fetches == before + 1  # refetched once for the unknown kid
    assert api(old).http.get("/v1/whoami").status_code == 200  # old key still published

    broker.rotate_keys("kubernetes", retire_old=True)
    time.sleep(0.05)  # the cache is dropped on the broker's loop
    resp = api(new).http.get("/v1/whoami")
    assert resp.status_code == 401
    assert resp.json()["code"] == "bad_signature"
    assert (
        api(broker.issue_kubernetes_token("team-a", "alice")).http.get("/v1/whoami").status_code
        == 200
    )


def test_keep_projected_token_rotated(tmp_path: Path) -> None:
    path = tmp_path / "token"
    with LocalBroker(warn=False) as b:
        first = b.keep_projected_token_rotated(path, "team-a", "agent", ttl=1)
        deadline = time.monotonic() + 10
        while path.read_text() == first:
            assert time.monotonic() < deadline, "the token file was not rotated"
            time.sleep(0.05)
        assert _claims(path.read_text())["sub"] == "system:serviceaccount:team-a:agent"
