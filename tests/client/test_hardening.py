"""Regression tests for the client's network path (issue 10): each failed before its fix.

End to end against local brokers over real HTTPS on loopback, or through the public API with a
scripted broker (httpx.MockTransport) where a broker cannot be made to misbehave."""

from __future__ import annotations

import io
import logging
import threading
from typing import Any

import httpx
import pytest

import k8s_agent_sandbox_awx as sdk
from k8s_agent_sandbox_awx import (
    BrokerAuthenticationError,
    BrokerConnectionConfig,
    BrokerError,
    BrokerSandboxClient,
    BrokerUnavailableError,
    ConfigurationError,
    OIDCTokenAuth,
    Sandbox,
)

pytestmark = pytest.mark.e2e


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_a_401_from_behind_the_broker_never_replays_the_command(runtime_401_broker: Any) -> None:
    broker = runtime_401_broker
    env = broker.environ("gitlab")
    token = env.pop("AGENT_SANDBOX_TOKEN")
    fetches: list[str] = []

    def fetch() -> str:
        fetches.append(token)
        return token

    with Sandbox.create(template="unauthorized", auth=OIDCTokenAuth(fetch), environ=env) as sandbox:
        fetched = len(fetches)
        with pytest.raises(BrokerError) as info:
            sandbox.commands.run("touch ran-once")
        assert broker.execution_count(sandbox.name) == 1  # sent once, never replayed
        error = info.value
        assert not isinstance(error, BrokerAuthenticationError)  # not the broker's verdict
        assert (error.status_code, error.code) == (401, None)
        assert "sandbox runtime answered 401" in str(error)
        assert "wants its own credentials" in str(error)
        assert len(fetches) == fetched  # the (valid) credential was not invalidated


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_a_runtime_that_imitates_a_token_rejection_never_gets_a_replay(
    runtime_401_broker: Any,
) -> None:
    # code in a sandbox can replace its runtime and answer 401 {"code": "token_expired"}
    broker = runtime_401_broker
    with Sandbox.create(template="forging", environ=broker.environ("gitlab")) as sandbox:
        with pytest.raises(BrokerError):
            sandbox.commands.run("touch ran-once")
        assert broker.execution_count(sandbox.name) == 1  # the command ran; never again


# ------------------------------------------------------------------------------ proxies

EVERY_PROXY_VARIABLE = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy")


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_a_loopback_broker_never_goes_through_a_proxy(
    broker: Any, proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = broker.environ("kubernetes")
    for name in EVERY_PROXY_VARIABLE:
        monkeypatch.setenv(name, proxy.url)
    with Sandbox.create(environ=env) as sandbox:
        assert sandbox.commands.run("echo direct").stdout == "direct\n"
    assert proxy.seen == []


def test_an_http_broker_never_sends_its_token_to_a_proxy(
    broker: Any, proxy: Any, https_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = https_server(None, body=b'{"items": []}')  # http://127.0.0.1:PORT
    token = broker.issue_gitlab_token("group/project", audience=plain.url)
    for name in EVERY_PROXY_VARIABLE:
        monkeypatch.setenv(name, proxy.url)
    auth = OIDCTokenAuth(token)
    with BrokerSandboxClient(broker_url=plain.url, allow_insecure_http=True, auth=auth) as client:
        assert client.list_sandboxes() == []
    assert proxy.seen == [] and not proxy.saw_authorization
    assert [seen["Authorization"] for seen in plain.seen] == [f"Bearer {token}"]


@pytest.mark.parametrize(
    ("env", "settings", "proxied"),
    [
        ({"HTTPS_PROXY": "{proxy}"}, {}, True),
        ({"https_proxy": "{proxy}"}, {}, True),
        ({"ALL_PROXY": "{proxy}"}, {}, True),
        ({"HTTP_PROXY": "{proxy}"}, {}, False),  # for http:// URLs only
        ({"HTTPS_PROXY": "{proxy}", "NO_PROXY": "broker.example"}, {}, False),
        ({"HTTPS_PROXY": "{proxy}", "NO_PROXY": "*"}, {}, False),
        ({"HTTPS_PROXY": "{proxy}"}, {"trust_env_proxies": False}, False),
        ({"HTTPS_PROXY": "{proxy}", "AGENT_SANDBOX_TRUST_ENV_PROXIES": "0"}, {}, False),
        ({"HTTPS_PROXY": "{proxy}", "AGENT_SANDBOX_TRUST_ENV_PROXIES": "true"}, {}, True),
    ],
)
def test_other_brokers_follow_the_proxy_conventions(
    broker: Any,
    proxy: Any,
    remote_broker: Any,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    settings: dict[str, Any],
    proxied: bool,
) -> None:
    url, ca, server = remote_broker
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(proxy=proxy.url))
    auth = OIDCTokenAuth(broker.issue_gitlab_token("group/project", audience=url))
    with BrokerSandboxClient(broker_url=url, ca_cert=ca, auth=auth, **settings) as client:
        assert client.list_sandboxes() == []
    assert len(server.seen) == 1
    if proxied:  # a CONNECT tunnel: the token travels inside TLS, the proxy never sees it
        assert proxy.seen == [f"CONNECT broker.example:{server.port} HTTP/1.1"]
        assert not proxy.saw_authorization
    else:
        assert proxy.seen == []


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("ALL_PROXY", "socks5://alice:pw-s3cr3t@127.0.0.1:9", "socksio"),
        ("all_proxy", "socks5h://127.0.0.1:9", "socksio"),
        ("HTTPS_PROXY", "ftp://127.0.0.1:9", "ftp:// is not a proxy scheme"),
    ],
)
def test_a_proxy_the_client_cannot_use_is_a_typed_error(
    name: str, value: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # httpx built every environment proxy when the client was made: a raw ImportError (SOCKS
    # without socksio) or ValueError (another scheme) from BrokerSandboxClient(...)
    if "socks" in value:
        try:
            import socksio  # noqa: F401
        except ImportError:
            pass
        else:
            pytest.skip("socksio is installed: a SOCKS proxy can be used")
    for variable in (*EVERY_PROXY_VARIABLE, "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv(name, value)
    auth = OIDCTokenAuth("opaque-caller-token-0123456789")
    with pytest.raises(ConfigurationError, match=problem) as info:
        BrokerSandboxClient(broker_url="https://broker.example", auth=auth)
    assert name in str(info.value) and "AGENT_SANDBOX_TRUST_ENV_PROXIES=0" in str(info.value)
    assert "pw-s3cr3t" not in str(info.value)
    with pytest.raises(ConfigurationError, match=problem):
        sdk.AsyncBrokerSandboxClient(broker_url="https://broker.example", auth=auth)
    # the documented ways out: no proxies from the environment, or a loopback broker
    BrokerSandboxClient(
        broker_url="https://broker.example", auth=auth, trust_env_proxies=False
    ).close()
    BrokerSandboxClient(broker_url="https://127.0.0.1:9", auth=auth).close()


def test_the_proxy_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_SANDBOX_TRUST_ENV_PROXIES", "maybe")
    with pytest.raises(ConfigurationError, match=r"AGENT_SANDBOX_TRUST_ENV_PROXIES.*'maybe'"):
        BrokerConnectionConfig.from_env(broker_url="https://broker.example")
    config = BrokerConnectionConfig(broker_url="https://broker.example", trust_env_proxies=False)
    assert config.trust_env_proxies is False


# ------------------------------------------------------------------------------ echoed tokens


OPAQUE = "opaque-caller-token-0123456789"
SUCCESS_ECHOES = {
    "a 200 answer that is not JSON": lambda: httpx.Response(200, text=f"you sent {OPAQUE}"),
    "a bad field": lambda: httpx.Response(
        200,
        json={"items": [{"name": "s", "phase": "Ready", "router": {"port": OPAQUE}}]},
    ),
}


FAILED_SANDBOX = {
    "name": "sbx-1",
    "namespace": "default",
    "phase": "Failed",
    "reason": f"saw {OPAQUE}",
    "message": f"pull failed for {OPAQUE}",
    "router": {"sandbox_id": "sbx-1", "namespace": "default", "port": 8888},
}


def test_the_callers_opaque_token_in_a_failed_sandboxs_reason_never_shows() -> None:
    import traceback

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(201 if request.method == "POST" else 200, json=FAILED_SANDBOX)

    client = BrokerSandboxClient(
        broker_url="https://broker.test",
        auth=OIDCTokenAuth(OPAQUE),
        http_transport=httpx.MockTransport(answer),
    )
    with pytest.raises(sdk.SandboxFailedError) as info:
        client.create_sandbox(sandbox_ready_timeout=5)
    client.close()
    error = info.value
    shown = "".join(traceback.format_exception(error)) + repr(error) + repr(vars(error))
    assert OPAQUE not in shown and "<redacted>" in str(error)


@pytest.mark.parametrize("answer", SUCCESS_ECHOES.values(), ids=SUCCESS_ECHOES.keys())
def test_the_callers_opaque_token_echoed_in_a_success_never_shows(answer: Any) -> None:
    # a 2xx answer that does not parse was redacted by shape only (JWTs, 'Bearer ...'): an
    # opaque token echoed bare showed in the BrokerProtocolError and its __cause__
    import traceback

    client = BrokerSandboxClient(
        broker_url="https://broker.test",
        auth=OIDCTokenAuth(OPAQUE),
        http_transport=httpx.MockTransport(lambda request: answer()),
    )
    with pytest.raises(sdk.BrokerProtocolError) as info:
        client.list_sandboxes()
    client.close()
    shown = "".join(traceback.format_exception(info.value)) + repr(info.value)
    assert OPAQUE not in shown and "<redacted>" in str(info.value)


def test_a_token_echoed_by_the_server_never_shows_in_an_error(
    token_echoes: Any, find_leaks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    leaks: dict[str, Any] = {}
    for echo in token_echoes:
        config = BrokerConnectionConfig(
            broker_url="https://broker.test", max_attempts=2, backoff_base=0, backoff_max=0
        )
        client = BrokerSandboxClient(
            config,
            auth=OIDCTokenAuth(echo.CALLER_TOKEN),
            http_transport=httpx.MockTransport(echo.handler),
        )
        operation = {
            "whoami": client.whoami,
            "list": client.list_sandboxes,
            "create": client.create_sandbox,
        }[echo.op]
        with pytest.raises(getattr(sdk, echo.error)) as info:
            operation()
        client.close()
        leaks[echo.name] = find_leaks(info.value, echo)
    assert leaks == {echo.name: [] for echo in token_echoes}
    assert [s for s in token_echoes[0].secrets() if s in caplog.text] == []


# ------------------------------------------------------------------------------ TLS and connect


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_a_certificate_failure_is_typed_never_retried_nor_replayed(
    broker: Any, wrong_ca_environ: Any, caplog: pytest.LogCaptureFixture
) -> None:
    env, wrong = wrong_ca_environ
    caplog.set_level(logging.DEBUG, logger="k8s_agent_sandbox_awx")
    before = len(broker.claims(include_deleted=True))
    with pytest.raises(sdk.BrokerTLSError) as info:
        Sandbox.create(environ=env)
    error = info.value
    assert error.request_sent is False
    for hint in ("certificate", "AGENT_SANDBOX_CA_BUNDLE", wrong, "clock"):
        assert hint in str(error)
    assert getattr(error, "__notes__", []) == []  # no "could not check ... interrupted create"
    assert "retrying" not in caplog.text and "interrupted create" not in caplog.text
    assert len(broker.claims(include_deleted=True)) == before


def test_a_create_that_cannot_connect_is_retried_but_never_replayed(
    closed_port_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config, auth = closed_port_broker
    caplog.set_level(logging.DEBUG, logger="k8s_agent_sandbox_awx")
    with pytest.raises(BrokerUnavailableError) as info:
        Sandbox.create(config=config, auth=auth)
    assert info.value.request_sent is False
    assert getattr(info.value, "__notes__", []) == []
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == config.max_attempts - 1  # not sent: retried, the create only
    assert "interrupted create" not in caplog.text


class RefusingProxy:
    """A loopback proxy that answers every CONNECT with 407: nothing reaches the broker."""

    def __init__(self) -> None:
        import socketserver

        outer = self
        self.seen: list[bytes] = []

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = self.request.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                outer.seen.append(head.split(b"\r\n")[0])
                self.request.sendall(
                    b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                    b'Proxy-Authenticate: Basic realm="corp"\r\nContent-Length: 0\r\n\r\n'
                )

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_create_refused_by_the_proxy_is_never_replayed(
    broker: Any, proxy: Any, remote_broker: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # a proxy that refuses the tunnel (407) counted as "the request may have reached the
    # broker": the create was replayed through it and the user saw "could not check whether an
    # interrupted create left a sandbox" although nothing reached the broker
    url, ca, server = remote_broker
    refusing = RefusingProxy()
    monkeypatch.setenv("HTTPS_PROXY", refusing.url)
    caplog.set_level(logging.DEBUG, logger="k8s_agent_sandbox_awx")
    auth = OIDCTokenAuth(broker.issue_gitlab_token("group/project", audience=url))
    config = BrokerConnectionConfig(broker_url=url, ca_cert=ca, backoff_base=0.01)
    try:
        with pytest.raises(BrokerUnavailableError) as info:
            Sandbox.create(config=config, auth=auth)
    finally:
        refusing.close()
    assert info.value.request_sent is False
    assert getattr(info.value, "__notes__", []) == []
    assert "interrupted create" not in caplog.text
    assert "HTTPS_PROXY" in str(info.value) and "NO_PROXY" in str(info.value)
    assert server.seen == [] and refusing.seen


# ------------------------------------------------------------------------------ URL passwords

PASSWORD = "s3cr3t-pw"
URLS_WITH_A_PASSWORD = [
    f"https://alice:{PASSWORD}@broker.example:99999",  # bad port
    f"ftp://alice:{PASSWORD}@broker.example",  # bad scheme
    f"alice:{PASSWORD}@broker.example",  # no scheme
    f"http://alice:{PASSWORD}@broker.example",  # http:// off loopback
    f"https://alice:{PASSWORD}@broker.example/?q=1",
    f"https://alice:{PASSWORD}@broker.example/base",
    f"https://alice:p@ss/{PASSWORD}@broker.example",  # unencoded characters in the password
    f"https://alice:{PASSWORD}@",
    # unencoded '#', '?' or '/' in the password: urlsplit takes part of it for the port (and
    # says so in its error) or for the fragment/query
    f"https://alice:{PASSWORD}#x@broker.example:8443",
    f"https://alice:{PASSWORD}?x@broker.example:8443",
    f"https://alice:{PASSWORD}/x@broker.example:8443",
    f"https://alice:x#{PASSWORD}@broker.example",
]


@pytest.mark.parametrize("url", URLS_WITH_A_PASSWORD)
def test_a_password_in_the_broker_url_is_never_shown(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from k8s_agent_sandbox_awx.cli._cli import main

    with pytest.raises(ConfigurationError) as info:
        BrokerConnectionConfig(broker_url=url)
    assert PASSWORD not in str(info.value)
    with pytest.raises(ConfigurationError) as info:
        BrokerConnectionConfig(broker_url="https://broker.example", api_url=url)
    assert PASSWORD not in str(info.value)
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", url)
    with pytest.raises(ConfigurationError) as info:
        Sandbox.list()
    assert PASSWORD not in str(info.value)
    monkeypatch.delenv("AGENT_SANDBOX_BROKER_URL")
    for argv in (["--broker-url", url, "ls"], ["--broker-url", url, "doctor"]):
        assert main(argv) != 0
        out, err = capsys.readouterr()
        assert PASSWORD not in out + err and "alice" in url


def test_a_password_in_a_redirect_location_is_never_shown() -> None:
    location = f"https://alice:{PASSWORD}@elsewhere.example/v1/whoami"
    client = BrokerSandboxClient(
        broker_url="https://broker.test",
        auth=OIDCTokenAuth("opaque-caller-token-0123456789"),
        http_transport=httpx.MockTransport(
            lambda request: httpx.Response(307, headers={"Location": location})
        ),
    )
    with pytest.raises(sdk.BrokerRedirectError) as info:
        client.whoami()
    client.close()
    assert PASSWORD not in str(info.value) and PASSWORD not in str(info.value.location)
    assert "elsewhere.example/v1/whoami" in str(info.value)


# ------------------------------------------------------------------------------ paths

CONTROL_PATHS = [
    "evil\r\nContent-Type: text/html\r\n\r\nx.txt",
    "a\nb",
    "tab\tname",
    "nul\0x",
    "del\x7f",
]


def _use(files: Any, operation: str, path: str, unsafe: bool) -> None:
    if operation == "write":
        files.write(path, b"data", allow_unsafe_paths=unsafe)
    elif operation == "read":
        files.read(path, allow_unsafe_paths=unsafe)
    elif operation == "read_to":
        files.read_to(path, io.BytesIO(), allow_unsafe_paths=unsafe)
    elif operation == "iter_bytes":
        list(files.iter_bytes(path, allow_unsafe_paths=unsafe))
    else:
        getattr(files, operation)(path)


FILE_OPERATIONS = [
    (operation, unsafe)
    for operation in ("write", "read", "read_to", "iter_bytes")
    for unsafe in (False, True)
] + [("exists", False), ("list", False)]


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_control_characters_in_a_path_are_always_refused(broker: Any) -> None:
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        for path in CONTROL_PATHS:
            for operation, unsafe in FILE_OPERATIONS:
                with pytest.raises(ValueError, match="control character") as info:
                    _use(sandbox.files, operation, path, unsafe)
                assert repr(path) in str(info.value), operation
                assert "allow_unsafe_paths" in str(info.value), operation
        assert sandbox.files.list(".") == []  # nothing was written under any name


QUOTED_NAMES = ['say "hi".txt', "back\\slash.txt", 'both\\".txt']


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_a_path_with_a_quote_or_backslash_is_written_under_its_own_name(broker: Any) -> None:
    # the filename of the upload's Content-Disposition is a quoted-string: '"' was sent as
    # %22, which a multipart parser keeps, so the file was written as 'say %22hi%22.txt' (over
    # a file of that name) and write() reported success
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        sandbox.files.write("say %22hi%22.txt", b"other file")
        for index, name in enumerate(QUOTED_NAMES):
            sandbox.files.write(name, f"content {index}".encode())
        for index, name in enumerate(QUOTED_NAMES):
            assert sandbox.files.read(name) == f"content {index}".encode()
        assert sandbox.files.read("say %22hi%22.txt") == b"other file"
        names = sorted(entry.name for entry in sandbox.files.list("."))
        assert names == sorted([*QUOTED_NAMES, "say %22hi%22.txt"])


# ------------------------------------------------------------------------------ limits


@pytest.mark.parametrize("value", [b"\xb2", "²".encode(), b"\xb9\xb3", b"1\xbd"])
def test_a_retry_after_that_is_not_ascii_digits_is_ignored(value: bytes) -> None:
    answers = iter(
        [
            httpx.Response(503, headers=[(b"Retry-After", value)], json={"code": "unavailable"}),
            httpx.Response(200, json={"subject": "me"}),
        ]
    )
    config = BrokerConnectionConfig(
        broker_url="https://broker.test", backoff_base=0.001, backoff_max=0.001
    )
    client = BrokerSandboxClient(
        config,
        auth=OIDCTokenAuth("opaque-caller-token-0123456789"),
        http_transport=httpx.MockTransport(lambda request: next(answers)),
    )
    with client:
        assert client.whoami() == {"subject": "me"}  # retried after the usual backoff
    quota = httpx.Response(429, headers=[(b"Retry-After", value)], json={"code": "rate_limited"})
    client = BrokerSandboxClient(
        config,
        auth=OIDCTokenAuth("opaque-caller-token-0123456789"),
        http_transport=httpx.MockTransport(lambda request: quota),
    )
    with client, pytest.raises(sdk.BrokerQuotaError):
        client.whoami()  # no usable Retry-After: a 429 is not retried


@pytest.mark.upstream  # upstream's command_timeout
def test_a_command_timeout_over_the_brokers_limit_is_refused_before_sending(
    broker: Any,
) -> None:
    # the runtime's own cap (SANDBOX_EXEC_TIMEOUT_SECONDS, 300 s by default) raised to the limit
    env = {"SANDBOX_EXEC_TIMEOUT_SECONDS": "86400"}
    with Sandbox.create(environ=broker.environ("kubernetes"), env=env) as sandbox:
        for options in ({"timeout": 86396}, {"timeout": 86395.5}, {"timeout": 1e9}):
            with pytest.raises(ValueError) as info:
                sandbox.commands.run("true", **options)
            message = str(info.value)
            for part in ("timeout", "86395", "X-Sandbox-Timeout", "background"):
                assert part in message, (options, part)
        assert broker.execution_count(sandbox.name) == 0  # nothing was sent
        assert sandbox.commands.run("true", timeout=86395).exit_code == 0  # the limit itself
    with BrokerSandboxClient(environ=broker.environ("kubernetes")) as client:
        upstream = client.create_sandbox()  # upstream's spelling: command_timeout= wins
        with pytest.raises(ValueError, match="86395"):
            upstream.commands.run("true", timeout=5, command_timeout=86395.5)
