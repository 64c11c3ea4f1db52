"""The google-cloud provider against a real HTTP server on loopback (the metadata server)."""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import k8s_agent_sandbox_awx_google_cloud as plugin
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
IDENTITY = "/computeMetadata/v1/instance/service-accounts/default/identity"


def metadata_env(endpoint: Any) -> dict[str, str]:
    return {"GCE_METADATA_HOST": f"127.0.0.1:{endpoint.port}"}


def ask_request(environ: Mapping[str, str], timeout: float = 5.0) -> CredentialRequest:
    return CredentialRequest(AUDIENCE, environ, timeout)


def ask(environ: Mapping[str, str], timeout: float = 5.0) -> Credential | None:
    return plugin.agent_sandbox_get_credential(ask_request(environ, timeout))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- discovery -------------------------------------------------------------------------------


def test_entry_point_is_registered_and_imports_without_httpx_or_the_upstream_client() -> None:
    loaded = check_entry_point(
        "google-cloud",
        "k8s_agent_sandbox_awx_google_cloud",
        distribution="k8s-agent-sandbox-awx-google-cloud",
    )
    assert loaded is plugin


def test_hooks_validate_against_the_hookspecs(endpoint: Any) -> None:
    from k8s_agent_sandbox_awx import hookspecs

    pm = pluggy.PluginManager("k8s_agent_sandbox_awx")
    pm.add_hookspecs(hookspecs)
    pm.register(plugin, name="google-cloud")
    [info] = pm.hook.agent_sandbox_provider_info()
    assert info.priority < 0
    assert "GCE_METADATA_HOST" in info.hint and "service account" in info.hint
    request = ask_request({"GCE_METADATA_HOST": f"127.0.0.1:{free_port()}"})
    assert pm.hook.agent_sandbox_get_credential(request=request) == []


# --- the request -----------------------------------------------------------------------------


def test_fetches_the_identity_token_with_the_broker_url_as_audience(
    endpoint: Any, jwt_factory: Callable[..., str]
) -> None:
    jwt = jwt_factory({"aud": AUDIENCE, "email": "agent@p.iam.gserviceaccount.com"})
    endpoint.add(jwt.encode())
    credential = ask(metadata_env(endpoint))
    assert credential is not None
    assert credential.token == jwt
    assert credential.provider == "google-cloud"
    assert credential.file_backed is False
    assert credential.source == f"metadata server 127.0.0.1:{endpoint.port}"
    assert jwt not in repr(credential)
    [seen] = endpoint.requests
    path = urlsplit(seen.path)
    assert path.path == IDENTITY
    assert parse_qsl(path.query) == [("audience", AUDIENCE), ("format", "full")]
    assert seen.headers["Metadata-Flavor"] == "Google"
    assert seen.headers["Host"] == f"127.0.0.1:{endpoint.port}"


def test_default_host_is_metadata_google_internal(
    endpoint: Any, jwt_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = socket.getaddrinfo
    asked: list[tuple[Any, Any]] = []

    def fake(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "metadata.google.internal":
            asked.append((host, port))
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", endpoint.port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    jwt = jwt_factory()
    endpoint.add(jwt.encode() + b"\n")
    credential = ask({})
    assert credential is not None and credential.token == jwt
    assert credential.source == "metadata server metadata.google.internal"
    assert asked == [("metadata.google.internal", 80)]
    assert endpoint.requests[0].headers["Host"] == "metadata.google.internal"


def test_requests_ignore_proxy_settings(
    endpoint: Any, jwt_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("ALL_PROXY", f"http://127.0.0.1:{free_port()}")
    endpoint.add(jwt_factory().encode())
    assert ask(metadata_env(endpoint)) is not None


@pytest.mark.parametrize(
    "value",
    [
        "http://127.0.0.1:8080",
        "127.0.0.1:8080/path",
        "user@127.0.0.1",
        "127.0.0.1:notaport",
        "[::1",
    ],
)
def test_bad_gce_metadata_host_is_an_error(value: str) -> None:
    with pytest.raises(
        CredentialSourceError, match=r"GCE_METADATA_HOST=.* is not host\[:port\]"
    ) as e:
        ask({"GCE_METADATA_HOST": value})
    assert e.value.source == "GCE_METADATA_HOST"


# --- not on Google Cloud: fast, no retries ---------------------------------------------------


def test_unresolvable_host_is_not_here() -> None:
    request = ask_request({"GCE_METADATA_HOST": "metadata.invalid"})
    assert plugin.agent_sandbox_get_credential(request) is None
    [reason] = request._reasons
    assert reason.startswith("metadata.invalid ")
    assert "not on Google Cloud" in reason


def test_not_here_by_name_resolution_does_not_import_httpx() -> None:
    code = (
        "import sys, k8s_agent_sandbox_awx_google_cloud as p; "
        "from k8s_agent_sandbox_awx import CredentialRequest; "
        "r = CredentialRequest('https://b.example', {'GCE_METADATA_HOST': 'metadata.invalid'}); "
        "print(p.agent_sandbox_get_credential(r), 'httpx' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None False"


def test_slow_resolution_is_not_here_within_the_connect_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = socket.getaddrinfo

    def slow(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "metadata.google.internal":
            time.sleep(3)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    monkeypatch.setattr(plugin, "CONNECT_TIMEOUT", 0.2)
    request = ask_request({})
    started = time.monotonic()
    assert plugin.agent_sandbox_get_credential(request) is None
    assert time.monotonic() - started < 1.5
    assert request._reasons == [
        "metadata.google.internal did not resolve within 0.2s: not on Google Cloud"
    ]


def test_connection_refused_is_not_here_without_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(plugin, "_pause_before_retry", lambda deadline: pauses.append(deadline))
    port = free_port()
    request = ask_request({"GCE_METADATA_HOST": f"127.0.0.1:{port}"})
    assert plugin.agent_sandbox_get_credential(request) is None
    assert pauses == []  # refused means "not here": no pause, no second attempt
    assert request._reasons == [
        f"cannot connect to 127.0.0.1:{port} (Connection refused): not on Google Cloud"
    ]


@pytest.fixture
def unaccepting_port() -> Iterator[int]:
    """A listener whose backlog is full: new connections are never accepted (Linux)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    held = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(("127.0.0.1", port))
        held.append(c)
    time.sleep(0.05)
    try:
        yield port
    finally:
        for c in held:
            c.close()
        listener.close()


def test_connect_timeout_is_not_here(
    unaccepting_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin, "CONNECT_TIMEOUT", 0.2)
    request = ask_request({"GCE_METADATA_HOST": f"127.0.0.1:{unaccepting_port}"})
    started = time.monotonic()
    assert plugin.agent_sandbox_get_credential(request) is None
    assert time.monotonic() - started < 1.5
    assert request._reasons == [
        f"127.0.0.1:{unaccepting_port} did not accept a connection within 0.2s: not on Google Cloud"
    ]


# --- on Google Cloud but failing: errors, never a silent skip --------------------------------


def test_read_timeout_after_connecting_is_an_error(endpoint: Any) -> None:
    endpoint.add(b"x.y.z", delay=2.0)
    started = time.monotonic()
    with pytest.raises(CredentialSourceError, match=r"connected .* did not answer within 0\.3s"):
        ask(metadata_env(endpoint), timeout=0.3)
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize(
    ("status", "expect"),
    [
        (400, "valid audience"),
        (403, "roles/iam.workloadIdentityUser"),
        (404, "no service account is attached"),
    ],
)
def test_error_status_is_an_error_without_retry(endpoint: Any, status: int, expect: str) -> None:
    endpoint.add(b"Not Found\n", status=status)
    with pytest.raises(CredentialSourceError, match=f"answered HTTP {status}") as info:
        ask(metadata_env(endpoint))
    assert expect in str(info.value)
    assert f"127.0.0.1:{endpoint.port}" in str(info.value)
    assert len(endpoint.requests) == 1


def test_transient_5xx_is_retried_once(endpoint: Any, jwt_factory: Callable[..., str]) -> None:
    jwt = jwt_factory()
    endpoint.add(b"try later", status=503)
    endpoint.add(jwt.encode())
    credential = ask(metadata_env(endpoint))
    assert credential is not None and credential.token == jwt
    assert len(endpoint.requests) == 2


def test_persistent_5xx_is_an_error(endpoint: Any) -> None:
    endpoint.add(b"", status=500)
    endpoint.add(b"", status=503)
    with pytest.raises(CredentialSourceError, match="answered HTTP 503"):
        ask(metadata_env(endpoint))
    assert len(endpoint.requests) == 2


def test_dropped_connection_is_retried_once_then_an_error(endpoint: Any) -> None:
    endpoint.add(drop=True)
    endpoint.add(drop=True)
    with pytest.raises(CredentialSourceError, match=r"connected to the metadata server .* failed"):
        ask(metadata_env(endpoint))
    assert len(endpoint.requests) == 2


def test_reply_without_metadata_flavor_is_an_error(
    endpoint: Any, jwt_factory: Callable[..., str]
) -> None:
    jwt = jwt_factory()
    endpoint.add(jwt.encode(), headers={})
    with pytest.raises(CredentialSourceError, match="without the `Metadata-Flavor: Google`") as e:
        ask(metadata_env(endpoint))
    assert jwt not in str(e.value)


def test_redirect_is_not_followed(endpoint: Any) -> None:
    endpoint.add(status=302, headers={"Metadata-Flavor": "Google", "Location": "/elsewhere"})
    with pytest.raises(CredentialSourceError, match=r"HTTP 302 \(a redirect\)"):
        ask(metadata_env(endpoint))
    assert len(endpoint.requests) == 1


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"", EmptyCredentialError),
        (b"  \n", EmptyCredentialError),
        (b"<html>secret-looking page</html>", MalformedTokenError),
        (b'{"token": "a.b.c"}', MalformedTokenError),
        (b"a.b", MalformedTokenError),
        (b"a b.c.d", MalformedTokenError),
    ],
)
def test_malformed_token_is_an_error(endpoint: Any, body: bytes, error: type[Exception]) -> None:
    endpoint.add(body)
    with pytest.raises(error) as info:
        ask(metadata_env(endpoint))
    assert isinstance(info.value, CredentialSourceError)
    assert "secret-looking" not in str(info.value)
    assert f"127.0.0.1:{endpoint.port}" in str(info.value)


def test_nothing_secret_is_logged(
    endpoint: Any, jwt_factory: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    jwt = jwt_factory()
    endpoint.add(jwt.encode())
    assert ask(metadata_env(endpoint)) is not None
    assert caplog.records
    assert jwt not in caplog.text
