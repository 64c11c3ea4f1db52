"""The github-actions provider against a real HTTP server on loopback."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import k8s_agent_sandbox_awx_github_actions as plugin
import pluggy
import pytest

from k8s_agent_sandbox_awx import (
    Credential,
    CredentialRequest,
    CredentialSourceError,
    EmptyCredentialError,
    MalformedTokenError,
)
from k8s_agent_sandbox_awx.testing import check_entry_point

AUDIENCE = "https://sandbox-broker.example"
REQUEST_TOKEN = "ghs_request-token-SECRET-0123456789"


def actions_env(url: str, token: str = REQUEST_TOKEN) -> dict[str, str]:
    return {
        "GITHUB_ACTIONS": "true",
        "ACTIONS_ID_TOKEN_REQUEST_URL": url,
        "ACTIONS_ID_TOKEN_REQUEST_TOKEN": token,
    }


def ask(environ: Mapping[str, str], timeout: float = 5.0) -> Credential | None:
    return plugin.agent_sandbox_get_credential(CredentialRequest(AUDIENCE, environ, timeout))


def token_url(endpoint: Any, query: str = "api-version=2.0") -> str:
    return f"{endpoint.origin}/_apis/distributedtask/hubs/build/plans/p1/jobs/j1/idtoken?{query}"


def assert_no_secret(exc: BaseException, *secrets: str) -> None:
    text = f"{exc!s} {exc!r}"
    for secret in (REQUEST_TOKEN, *secrets):
        assert secret not in text


# --- discovery -------------------------------------------------------------------------------


def test_entry_point_is_registered_and_imports_without_httpx_or_the_upstream_client() -> None:
    loaded = check_entry_point(
        "github-actions",
        "k8s_agent_sandbox_awx_github_actions",
        distribution="k8s-agent-sandbox-awx-github-actions",
    )
    assert loaded is plugin


def test_hooks_validate_against_the_hookspecs() -> None:
    from k8s_agent_sandbox_awx import hookspecs

    pm = pluggy.PluginManager("k8s_agent_sandbox_awx")
    pm.add_hookspecs(hookspecs)
    pm.register(plugin, name="github-actions")
    infos = pm.hook.agent_sandbox_provider_info()
    assert infos[0].priority == 100
    assert "id-token: write" in infos[0].hint
    request = CredentialRequest(AUDIENCE, {}, 1.0)
    assert pm.hook.agent_sandbox_get_credential(request=request) == []


def test_not_here_outside_github_actions() -> None:
    request = CredentialRequest(AUDIENCE, {"ACTIONS_ID_TOKEN_REQUEST_URL": "https://x"}, 1.0)
    assert plugin.agent_sandbox_get_credential(request) is None
    assert request._reasons == ["GITHUB_ACTIONS is not set"]


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        (("ACTIONS_ID_TOKEN_REQUEST_URL", "ACTIONS_ID_TOKEN_REQUEST_TOKEN"), "and"),
        (("ACTIONS_ID_TOKEN_REQUEST_URL",), "ACTIONS_ID_TOKEN_REQUEST_URL is not set"),
        (("ACTIONS_ID_TOKEN_REQUEST_TOKEN",), "ACTIONS_ID_TOKEN_REQUEST_TOKEN is not set"),
    ],
)
def test_missing_request_variables_say_the_workflow_needs_id_token_write(
    drop: tuple[str, ...], named: str
) -> None:
    env = {k: v for k, v in actions_env("https://x.example/t?api-version=2.0").items()}
    for name in drop:
        env[name] = ""
    with pytest.raises(CredentialSourceError) as info:
        ask(env)
    message = str(info.value)
    assert "permissions: id-token: write" in message
    assert named in message
    assert info.value.provider == "github-actions"
    assert_no_secret(info.value)


# --- the request -----------------------------------------------------------------------------


def test_build_token_url_merges_audience_into_the_existing_query() -> None:
    url = plugin.build_token_url("https://h.example/idtoken?api-version=2.0&x=a%26b", AUDIENCE)
    parts = urlsplit(url)
    assert "?" not in parts.query
    assert parse_qsl(parts.query) == [("api-version", "2.0"), ("x", "a&b"), ("audience", AUDIENCE)]
    replaced = plugin.build_token_url("https://h.example/t?audience=old&api-version=2.0", "new")
    assert parse_qsl(urlsplit(replaced).query) == [("api-version", "2.0"), ("audience", "new")]
    bare = plugin.build_token_url("https://h.example/t", "https://b.example:8443")
    assert bare == "https://h.example/t?audience=https%3A%2F%2Fb.example%3A8443"


def test_fetches_the_token_with_the_broker_url_as_audience(
    endpoint: Any, jwt_factory: Callable[..., str]
) -> None:
    jwt = jwt_factory({"aud": AUDIENCE})
    endpoint.add(json.dumps({"count": 1, "value": jwt}).encode())
    credential = ask(actions_env(token_url(endpoint)))
    assert credential is not None
    assert credential.token == jwt
    assert credential.provider == "github-actions"
    assert credential.file_backed is False
    assert credential.source == f"ACTIONS_ID_TOKEN_REQUEST_URL (127.0.0.1:{endpoint.port})"
    assert jwt not in repr(credential)
    [seen] = endpoint.requests
    path = urlsplit(seen.path)
    assert path.path.endswith("/idtoken")
    assert parse_qsl(path.query) == [("api-version", "2.0"), ("audience", AUDIENCE)]
    assert seen.headers["Authorization"] == f"bearer {REQUEST_TOKEN}"


# --- failures --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expect"),
    [
        (400, "HTTP 400 (Can't issue ID_TOKEN for audience)"),
        (401, "valid only inside the job"),
        (403, "permissions: id-token: write"),
        (404, "HTTP 404"),
    ],
)
def test_error_status_is_an_error_naming_the_host(endpoint: Any, status: int, expect: str) -> None:
    body = json.dumps({"message": "Can't issue ID_TOKEN for audience", "echo": REQUEST_TOKEN})
    endpoint.add(body.encode(), status=status)
    with pytest.raises(CredentialSourceError) as info:
        ask(actions_env(token_url(endpoint)))
    assert expect in str(info.value)
    assert f"127.0.0.1:{endpoint.port}" in str(info.value)
    assert len(endpoint.requests) == 1  # a 4xx is not retried
    assert_no_secret(info.value)


def test_error_body_echoing_the_request_token_is_redacted(endpoint: Any) -> None:
    endpoint.add(f"bad token {REQUEST_TOKEN}".encode(), status=400)
    with pytest.raises(CredentialSourceError) as info:
        ask(actions_env(token_url(endpoint)))
    assert "bad token <redacted>" in str(info.value)
    assert_no_secret(info.value)


def test_transient_5xx_is_retried_once(endpoint: Any, jwt_factory: Callable[..., str]) -> None:
    jwt = jwt_factory()
    endpoint.add(b"busy", status=503)
    endpoint.add(
        json.dumps({"value": jwt}).encode(),
    )
    credential = ask(actions_env(token_url(endpoint)))
    assert credential is not None and credential.token == jwt
    assert len(endpoint.requests) == 2


def test_persistent_5xx_is_an_error_after_one_retry(endpoint: Any) -> None:
    endpoint.add(b"", status=500)
    endpoint.add(b"", status=502)
    with pytest.raises(CredentialSourceError, match="answered HTTP 502"):
        ask(actions_env(token_url(endpoint)))
    assert len(endpoint.requests) == 2


def test_redirect_is_not_followed(endpoint: Any) -> None:
    elsewhere = f"http://127.0.0.1:{endpoint.port}/elsewhere"
    endpoint.add(b"", status=302, headers={"Location": elsewhere})
    with pytest.raises(CredentialSourceError, match=r"HTTP 302 \(a redirect\).*not followed"):
        ask(actions_env(token_url(endpoint)))
    assert [urlsplit(s.path).path for s in endpoint.requests] == [
        "/_apis/distributedtask/hubs/build/plans/p1/jobs/j1/idtoken"
    ]


def test_slow_reply_times_out_with_request_timeout(endpoint: Any) -> None:
    endpoint.add(b"{}", delay=2.0)
    started = time.monotonic()
    with pytest.raises(CredentialSourceError, match=r"did not answer within 0\.3s"):
        ask(actions_env(token_url(endpoint)), timeout=0.3)
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize(
    ("body", "error", "expect"),
    [
        (b"<html>sign in</html>", CredentialSourceError, "is not JSON"),
        (b'{"value": "abc', CredentialSourceError, "is not JSON"),
        (b'["value"]', CredentialSourceError, "has no `value` field"),
        (b'{"count": 1}', CredentialSourceError, "has no `value` field"),
        (b'{"value": ""}', EmptyCredentialError, "empty or non-string `value`"),
        (b'{"value": 42}', EmptyCredentialError, "empty or non-string `value`"),
        (b'{"value": "not-a-jwt"}', MalformedTokenError, "is not a JWT"),
    ],
)
def test_malformed_replies_are_errors(
    endpoint: Any, body: bytes, error: type[Exception], expect: str
) -> None:
    endpoint.add(body)
    with pytest.raises(error, match=expect) as info:
        ask(actions_env(token_url(endpoint)))
    assert f"127.0.0.1:{endpoint.port}" in str(info.value)
    assert "not-a-jwt" not in str(info.value)
    assert_no_secret(info.value)


def test_dropped_connection_is_retried_once_then_an_error(endpoint: Any) -> None:
    endpoint.add(b"", drop=True)
    endpoint.add(b"", drop=True)
    with pytest.raises(CredentialSourceError, match=r"could not reach .* at 127\.0\.0\.1"):
        ask(actions_env(token_url(endpoint)))
    assert len(endpoint.requests) == 2


def test_connection_refused_is_an_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/idtoken?api-version=2.0"
    with pytest.raises(CredentialSourceError, match=f"could not reach .* 127.0.0.1:{port}") as e:
        ask(actions_env(url))
    assert_no_secret(e.value)


@pytest.mark.parametrize(
    ("url", "expect"),
    [
        ("http://token.example/idtoken?api-version=2.0", "over plain http"),
        ("ftp://token.example/idtoken", r"not an http\(s\) URL"),
        ("token.example/idtoken", r"not an http\(s\) URL"),
        ("https://[::1/idtoken", r"not an http\(s\) URL"),
        ("https://user:pw@token.example/idtoken", "user information"),
    ],
)
def test_suspicious_request_urls_are_refused_before_sending_anything(url: str, expect: str) -> None:
    with pytest.raises(CredentialSourceError, match=expect) as info:
        ask(actions_env(url))
    assert "pw" not in str(info.value)
    assert_no_secret(info.value)


def test_loopback_endpoint_is_never_proxied(
    endpoint: Any, jwt_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead}")
    monkeypatch.setenv("ALL_PROXY", f"http://127.0.0.1:{dead}")
    endpoint.add(json.dumps({"value": jwt_factory()}).encode())
    assert ask(actions_env(token_url(endpoint))) is not None


def test_nothing_secret_is_logged(
    endpoint: Any, jwt_factory: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    jwt = jwt_factory()
    endpoint.add(json.dumps({"value": jwt}).encode())
    assert ask(actions_env(token_url(endpoint))) is not None
    endpoint.add(b"", status=401)
    with pytest.raises(CredentialSourceError):
        ask(actions_env(token_url(endpoint)))
    assert caplog.records
    assert REQUEST_TOKEN not in caplog.text
    assert jwt not in caplog.text
