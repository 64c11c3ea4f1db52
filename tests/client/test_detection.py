"""Which dialect a broker speaks, and what is checked before the first request (issue 19,
items 8 and 9).

Item 8: everything that can be checked without the network (the configuration, the credential
chain, the token's checks) is checked before the dialect probe, so that a credential problem is
the error a user meets first, not "cannot connect" from the probe. Item 9: only an answer that
identifies a dialect is remembered for the process; a transient answer (a ``404``, ``403``,
``302`` or ``503`` to ``GET /v1/healthz``) never pins the wrong one.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import (
    AsyncSandbox,
    BrokerConnectionConfig,
    BrokerSandboxClient,
    Sandbox,
    clear_credential_cache,
)
from k8s_agent_sandbox_awx.cli._cli import main
from k8s_agent_sandbox_awx.client.wire._dialects import detected
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    BrokerRedirectError,
    BrokerUnavailableError,
    CredentialSourceError,
    EmptyCredentialError,
    NoCredentialsError,
    UnreadableCredentialError,
)

pytestmark = pytest.mark.usefixtures("real_detection")

BROKER = "https://broker.test"
V1_HEALTH = {"status": "ok", "api_version": "v1"}


def _closed_port() -> int:
    """A loopback port nothing listens on (a broker that cannot be reached)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The credential setups of the issue, each with the error it must raise and what that error
# must name (the variable, the path or the permission).
VARIANTS: dict[str, tuple[dict[str, str], type[Exception], str]] = {
    "no token anywhere": ({}, NoCredentialsError, "AGENT_SANDBOX_TOKEN"),
    "empty AGENT_SANDBOX_TOKEN": (
        {"AGENT_SANDBOX_TOKEN": ""},
        EmptyCredentialError,
        "AGENT_SANDBOX_TOKEN",
    ),
    "missing token file": (
        {"AGENT_SANDBOX_TOKEN_FILE": "{tmp}/missing-token"},
        UnreadableCredentialError,
        "{tmp}/missing-token",
    ),
    "token path is a directory": (
        {"AGENT_SANDBOX_TOKEN_FILE": "{tmp}"},
        UnreadableCredentialError,
        "Is a directory",
    ),
    "GitHub Actions without id-token: write": (
        {"GITHUB_ACTIONS": "true", "AGENT_SANDBOX_LOAD_PLUGINS": "github-actions"},
        CredentialSourceError,
        "id-token: write",
    ),
}


def _variant(name: str, tmp: Path) -> tuple[dict[str, str], type[Exception], str]:
    variables, error, named = VARIANTS[name]
    env = {k: v.replace("{tmp}", str(tmp)) for k, v in variables.items()}
    if "AGENT_SANDBOX_LOAD_PLUGINS" not in env:
        env["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # nothing beyond this machine
    return env, error, named.replace("{tmp}", str(tmp))


def _unreachable(env: dict[str, str]) -> dict[str, str]:
    return {"AGENT_SANDBOX_BROKER_URL": f"http://127.0.0.1:{_closed_port()}", **env}


@pytest.fixture(autouse=True)
def _fresh_credentials() -> Any:
    clear_credential_cache()
    yield
    clear_credential_cache()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_credential_error_comes_before_the_probe_of_an_unreachable_broker(
    variant: str, tmp_path: Path
) -> None:
    """Sandbox.create, AsyncSandbox.create and BrokerSandboxClient (create_sandbox, list,
    connect) raise the credential error naming the variable, path or permission, not the
    probe's "Could not find out which protocol the broker speaks: cannot connect"."""
    env, error, named = _variant(variant, tmp_path)
    environ = _unreachable(env)
    config = BrokerConnectionConfig.from_env(environ, allow_insecure_http=True)
    attempts: list[Callable[[], Any]] = [
        lambda: Sandbox.create(environ=environ, allow_insecure_http=True),
        lambda: Sandbox.connect("sbx-1", environ=environ, config=config),
        lambda: Sandbox.list(environ=environ, config=config),
        lambda: asyncio.run(AsyncSandbox.create(environ=environ, allow_insecure_http=True)),
    ]
    for attempt in attempts:
        with pytest.raises(error) as info:
            attempt()
        assert named in str(info.value), str(info.value)
        assert "which protocol" not in str(info.value)
    with BrokerSandboxClient(environ=environ, allow_insecure_http=True) as client:
        for operation in (client.create_sandbox, client.list_all_sandboxes, client.whoami):
            with pytest.raises(error, match=named.replace("(", r"\(")):
                operation()
    assert detected(environ["AGENT_SANDBOX_BROKER_URL"]) is None


@pytest.mark.parametrize("command", [["run", "--", "true"], ["ls"]])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_cli_reports_the_credential_error_not_the_probe(
    variant: str,
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    env, error, named = _variant(variant, tmp_path)
    for name in [n for n in os.environ if n.startswith(("AGENT_SANDBOX_", "ACTIONS_ID_"))]:
        monkeypatch.delenv(name)
    for name, value in _unreachable(env).items():
        monkeypatch.setenv(name, value)
    assert main(["--allow-insecure-http", *command]) == 1
    err = capsys.readouterr().err
    assert err.startswith("agent-sandbox-awx: error: ") and named in err, err
    assert error.__name__ not in err  # no Python class in front (issue 30)
    assert "which protocol" not in err and "Traceback" not in err


def test_the_credential_found_first_is_the_one_sent(creds: Any, fake: Any) -> None:
    """Fetching the credential before the probe costs no extra fetch: the first request
    sends it (each authenticated request fetches once, the probe never)."""
    config = BrokerConnectionConfig(broker_url=BROKER)
    with BrokerSandboxClient(config, auth=creds, http_transport=httpx.MockTransport(fake)) as c:
        c.create_sandbox()
    sent = [r for r in fake.requests if "authorization" in r.headers]
    assert fake.requests[0].url.path == "/v1/healthz" and len(sent) == len(fake.requests) - 1
    assert len(creds.calls) == len(sent)


def test_healthz_alone_needs_no_credential() -> None:
    class Refuses:
        def get_credential(self, audience: str) -> Any:
            raise NoCredentialsError("no credential")

        def invalidate(self, audience: str) -> None:
            pass

    def broker(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=V1_HEALTH)

    config = BrokerConnectionConfig(broker_url=BROKER)
    transport = httpx.MockTransport(broker)
    with BrokerSandboxClient(config, auth=Refuses(), http_transport=transport) as client:
        assert client.healthz().status_code == 200
        with pytest.raises(NoCredentialsError):
            client.list_sandboxes()


# ------------------------------------------------------------------- item 9: the probe's memo


class V1Broker:
    """A scripted v1 broker whose first answers to ``GET /v1/healthz`` are ``transient``."""

    def __init__(self, *transient: httpx.Response) -> None:
        self.transient = list(transient)
        self.seen: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(f"{request.method} {request.url.path}")
        if request.url.path == "/v1/healthz":
            if self.transient:
                return self.transient.pop(0)
            return httpx.Response(200, json=V1_HEALTH)
        if request.url.path.startswith("/v1/sandboxes/") and request.method == "DELETE":
            return httpx.Response(204)
        body = {"detail": f"no route for {request.method} {request.url.path}", "code": "not_found"}
        return httpx.Response(404, json=body, headers={"Agent-Sandbox-Broker-Error": "not_found"})


def _client(broker: V1Broker, creds: Any, **settings: Any) -> BrokerSandboxClient:
    config = BrokerConnectionConfig(broker_url=BROKER, backoff_base=0.0, **settings)
    return BrokerSandboxClient(config, auth=creds, http_transport=httpx.MockTransport(broker))


TRANSIENT = {
    "404": httpx.Response(404, text="Not Found"),
    "403": httpx.Response(403, text="Forbidden by the ingress"),
    "302": httpx.Response(302, headers={"Location": "https://login.example/"}),
    "503": httpx.Response(503, text="upstream not ready"),
}


@pytest.mark.parametrize("answer", list(TRANSIENT))
def test_one_transient_answer_to_the_probe_is_not_remembered(answer: str, creds: Any) -> None:
    """A single 404, 403, 302 or 503 to the probe does not pin a dialect: the next client
    probes again, gets the v1 broker's answer and speaks v1 (and that is remembered)."""
    broker = V1Broker(TRANSIENT[answer])
    with _client(broker, creds, max_attempts=1) as first, pytest.raises(BrokerError) as info:
        first.delete("sbx-1")
    assert detected(BROKER) is None
    if answer == "302":
        assert isinstance(info.value, BrokerRedirectError)
        assert "never followed" in str(info.value) and "login.example" in str(info.value)
        assert broker.seen == ["GET /v1/healthz"]  # not followed
    elif answer == "503":
        assert isinstance(info.value, BrokerUnavailableError)
    else:  # the guess (/rpc) was wrong: the error says how to pin the dialect
        assert broker.seen == ["GET /v1/healthz", "POST /rpc"]
        assert any("AGENT_SANDBOX_BROKER_PROTOCOL" in n for n in info.value.__notes__)
    before = len(broker.seen)
    with _client(broker, creds) as second:
        assert second.delete("sbx-1") is True
        assert second.dialect.name == "v1"
    assert broker.seen[before:] == ["GET /v1/healthz", "DELETE /v1/sandboxes/sbx-1"]
    assert detected(BROKER) is not None and detected(BROKER).name == "v1"  # type: ignore[union-attr]
    with _client(broker, creds) as third:
        third.delete("sbx-1")
    assert broker.seen.count("GET /v1/healthz") == 2  # the third client sent no probe


def test_a_redirect_to_the_probe_is_an_error_in_every_client(creds: Any) -> None:
    """A 3xx is never followed and never a dialect, however often it is answered."""
    redirect = TRANSIENT["302"]
    broker = V1Broker(redirect, redirect)
    for _ in range(2):
        with _client(broker, creds) as client, pytest.raises(BrokerRedirectError):
            client.list_sandboxes()
    assert broker.seen == ["GET /v1/healthz"] * 2 and detected(BROKER) is None


def test_only_the_v1_health_answer_is_remembered_at_once(creds: Any) -> None:
    """``{"api_version": "v1"}`` identifies the v1 broker: remembered even if the request it
    was sent for fails; another 2xx (a catch-all page) is a guess for that client only."""
    page = httpx.Response(200, text="<html>welcome</html>")
    broker = V1Broker(page)
    with _client(broker, creds) as first, pytest.raises(BrokerError):
        first.get_info("sbx-1")  # the guess (v1) is not confirmed by a 404
    assert detected(BROKER) is None
    with _client(broker, creds) as second, pytest.raises(BrokerError):
        second.get_info("sbx-1")
    assert detected(BROKER) is not None  # the v1 health answer, whatever came after
    assert broker.seen.count("GET /v1/healthz") == 2


def test_a_guess_is_remembered_once_an_answer_confirms_it(creds: Any) -> None:
    """A 2xx that is not the v1 health answer: v1 for this client; its first control-plane
    answer that parses (the delete's 204) confirms it for the process."""
    broker = V1Broker(httpx.Response(204))
    with _client(broker, creds) as first:
        assert first.delete("sbx-1") is True
    assert detected(BROKER) is not None
    with _client(broker, creds) as second:
        second.delete("sbx-1")
    assert broker.seen.count("GET /v1/healthz") == 1


@pytest.mark.parametrize("name", ["v1", "rpc"])
def test_the_environment_variable_still_pins_without_a_probe(name: str, creds: Any) -> None:
    seen: list[str] = []

    def answers(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return httpx.Response(204)

    env = {"AGENT_SANDBOX_BROKER_URL": BROKER, "AGENT_SANDBOX_BROKER_PROTOCOL": name}
    config = BrokerConnectionConfig.from_env(env)
    transport = httpx.MockTransport(answers)
    with BrokerSandboxClient(config, auth=creds, http_transport=transport) as client:
        client.delete("sbx-1")
        assert client.dialect.name == name
    assert seen == [f"{'DELETE /v1/sandboxes/sbx-1' if name == 'v1' else 'POST /rpc'}"]
    assert detected(BROKER) is None  # a pin is the caller's, not a finding about the broker


def test_concurrent_callers_share_a_guess_without_remembering_it(creds: Any) -> None:
    """Callers that wait for a probe take its answer, a guess too (one probe for all of them);
    a caller that comes later probes again, since nothing confirmed the guess."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    broker = V1Broker(httpx.Response(404, text="Not Found"))
    lock = threading.Lock()

    def slow(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/healthz":
            time.sleep(0.2)  # every caller arrives while the first one probes
        with lock:
            return broker(request)

    config = BrokerConnectionConfig(broker_url=BROKER, max_attempts=1)
    clients = [
        BrokerSandboxClient(config, auth=creds, http_transport=httpx.MockTransport(slow))
        for _ in range(4)
    ]
    with ThreadPoolExecutor(4) as pool:
        errors = list(pool.map(lambda c: _error_of(lambda: c.get_info("sbx-1")), clients))
    assert all(isinstance(e, BrokerError) for e in errors), errors
    assert [c.dialect.name for c in clients] == ["rpc"] * 4
    assert broker.seen.count("GET /v1/healthz") == 1
    for client in clients:
        client.close()
    assert detected(BROKER) is None
    with _client(broker, creds) as later:
        assert later.delete("sbx-1") is True and later.dialect.name == "v1"
    assert broker.seen.count("GET /v1/healthz") == 2


def _error_of(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except BaseException as exc:
        return exc
    return None


def test_the_probe_answer_shapes() -> None:
    """The verdicts, without I/O: what identifies a dialect and what is only a guess."""
    from k8s_agent_sandbox_awx.client.wire._dialects import _verdict

    def reply(status: int, body: Any = None) -> httpx.Response:
        return httpx.Response(status, content=json.dumps(body).encode() if body else b"")

    assert (_verdict(reply(200, V1_HEALTH)).name, _verdict(reply(200, V1_HEALTH)).certain) == (
        "v1",
        True,
    )
    for guess, name in ((reply(200, {"status": "ok"}), "v1"), (reply(204), "v1")):
        assert (_verdict(guess).name, _verdict(guess).certain) == (name, False)
    for status in (401, 403, 404, 405, 410):
        assert (_verdict(reply(status)).name, _verdict(reply(status)).certain) == ("rpc", False)
