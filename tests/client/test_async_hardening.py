"""Regression tests for the client's network path (issue 10), through the async API: each
failed before its fix. End to end against local brokers over real HTTPS on loopback, or through
the public API with a scripted broker (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx
import pytest

import k8s_agent_sandbox_awx as sdk
from k8s_agent_sandbox_awx import (
    AsyncBrokerSandboxClient,
    AsyncSandbox,
    BrokerAuthenticationError,
    BrokerConnectionConfig,
    BrokerError,
    BrokerUnavailableError,
    OIDCTokenAuth,
)

pytestmark = pytest.mark.e2e
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_a_401_from_behind_the_broker_never_replays_the_command(runtime_401_broker: Any) -> None:
    broker = runtime_401_broker
    env = broker.environ("gitlab")
    token = env.pop("AGENT_SANDBOX_TOKEN")
    fetches: list[str] = []

    async def fetch() -> str:
        fetches.append(token)
        return token

    async def main() -> None:
        auth = OIDCTokenAuth(fetch)
        async with await AsyncSandbox.create(
            template="unauthorized", auth=auth, environ=env
        ) as sandbox:
            fetched = len(fetches)
            with pytest.raises(BrokerError) as info:
                await sandbox.commands.run("touch ran-once")
            assert broker.execution_count(sandbox.name) == 1  # sent once, never replayed
            error = info.value
            assert not isinstance(error, BrokerAuthenticationError)
            assert (error.status_code, error.code) == (401, None)
            assert "sandbox runtime answered 401" in str(error)
            assert len(fetches) == fetched  # the (valid) credential was not invalidated

    run(main())


# ------------------------------------------------------------------------------ proxies

EVERY_PROXY_VARIABLE = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy")


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_a_loopback_broker_never_goes_through_a_proxy(
    broker: Any, proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = broker.environ("kubernetes")
    for name in EVERY_PROXY_VARIABLE:
        monkeypatch.setenv(name, proxy.url)

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env) as sandbox:
            assert (await sandbox.commands.run("echo direct")).stdout == "direct\n"

    run(main())
    assert proxy.seen == []


def test_an_http_broker_never_sends_its_token_to_a_proxy(
    broker: Any, proxy: Any, https_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = https_server(None, body=b'{"items": []}')  # http://127.0.0.1:PORT
    token = broker.issue_gitlab_token("group/project", audience=plain.url)
    for name in EVERY_PROXY_VARIABLE:
        monkeypatch.setenv(name, proxy.url)

    async def main() -> None:
        async with AsyncBrokerSandboxClient(
            broker_url=plain.url, allow_insecure_http=True, auth=OIDCTokenAuth(token)
        ) as client:
            assert await client.list_sandboxes() == []

    run(main())
    assert proxy.seen == [] and not proxy.saw_authorization
    assert [seen["Authorization"] for seen in plain.seen] == [f"Bearer {token}"]


@pytest.mark.parametrize(
    ("env", "settings", "proxied"),
    [
        ({"HTTPS_PROXY": "{proxy}"}, {}, True),
        ({"ALL_PROXY": "{proxy}"}, {}, True),
        ({"HTTP_PROXY": "{proxy}"}, {}, False),  # for http:// URLs only
        ({"HTTPS_PROXY": "{proxy}", "NO_PROXY": "broker.example"}, {}, False),
        ({"HTTPS_PROXY": "{proxy}"}, {"trust_env_proxies": False}, False),
        ({"HTTPS_PROXY": "{proxy}", "AGENT_SANDBOX_TRUST_ENV_PROXIES": "0"}, {}, False),
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

    async def main() -> None:
        async with AsyncBrokerSandboxClient(
            broker_url=url, ca_cert=ca, auth=auth, **settings
        ) as client:
            assert await client.list_sandboxes() == []

    run(main())
    assert len(server.seen) == 1
    if proxied:  # a CONNECT tunnel: the token travels inside TLS, the proxy never sees it
        assert proxy.seen == [f"CONNECT broker.example:{server.port} HTTP/1.1"]
        assert not proxy.saw_authorization
    else:
        assert proxy.seen == []


# ------------------------------------------------------------------------------ echoed tokens


def test_a_token_echoed_by_the_server_never_shows_in_an_error(
    token_echoes: Any, find_leaks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)

    async def leaks_of(echo: Any) -> list[str]:
        config = BrokerConnectionConfig(
            broker_url="https://broker.test", max_attempts=2, backoff_base=0, backoff_max=0
        )
        async with AsyncBrokerSandboxClient(
            config,
            auth=OIDCTokenAuth(echo.CALLER_TOKEN),
            http_transport=httpx.MockTransport(echo.handler),
        ) as client:
            operation = {
                "whoami": client.whoami,
                "list": client.list_sandboxes,
                "create": client.create_sandbox,
            }[echo.op]
            with pytest.raises(getattr(sdk, echo.error)) as info:
                await operation()
        leaks: list[str] = find_leaks(info.value, echo)
        return leaks

    leaks = {echo.name: run(leaks_of(echo)) for echo in token_echoes}
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
        run(AsyncSandbox.create(environ=env))
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
        run(AsyncSandbox.create(config=config, auth=auth))
    assert info.value.request_sent is False
    assert getattr(info.value, "__notes__", []) == []
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == config.max_attempts - 1  # not sent: retried, the create only
    assert "interrupted create" not in caplog.text


# ------------------------------------------------------------------------------ URL passwords


@pytest.mark.parametrize(
    "url",
    ["https://alice:s3cr3t-pw@broker.example:99999", "ftp://alice:s3cr3t-pw@broker.example"],
)
def test_a_password_in_the_broker_url_is_never_shown(url: str) -> None:
    with pytest.raises(sdk.ConfigurationError) as info:
        run(AsyncSandbox.list(broker_url=url))
    assert "s3cr3t-pw" not in str(info.value)
    with pytest.raises(sdk.ConfigurationError) as info:
        AsyncBrokerSandboxClient(broker_url=url)
    assert "s3cr3t-pw" not in str(info.value)


# ------------------------------------------------------------------------------ paths

CONTROL_PATHS = ["evil\r\nContent-Type: text/html\r\n\r\nx.txt", "nul\0x", "del\x7f"]


async def _use(files: Any, operation: str, path: str, unsafe: bool) -> None:
    if operation == "write":
        await files.write(path, b"data", allow_unsafe_paths=unsafe)
    elif operation == "read":
        await files.read(path, allow_unsafe_paths=unsafe)
    elif operation == "read_to":
        await files.read_to(path, io.BytesIO(), allow_unsafe_paths=unsafe)
    elif operation == "iter_bytes":
        async for _ in files.iter_bytes(path, allow_unsafe_paths=unsafe):
            pass
    else:
        await getattr(files, operation)(path)


FILE_OPERATIONS = [
    (operation, unsafe)
    for operation in ("write", "read", "read_to", "iter_bytes")
    for unsafe in (False, True)
] + [("exists", False), ("list", False)]


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_control_characters_in_a_path_are_always_refused(broker: Any) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create(environ=broker.environ("kubernetes")) as sandbox:
            for path in CONTROL_PATHS:
                for operation, unsafe in FILE_OPERATIONS:
                    with pytest.raises(ValueError, match="control character") as info:
                        await _use(sandbox.files, operation, path, unsafe)
                    assert repr(path) in str(info.value), operation
                    assert "allow_unsafe_paths" in str(info.value), operation
            assert await sandbox.files.list(".") == []  # nothing was written under any name

    run(main())


# ------------------------------------------------------------------------------ limits


def test_a_retry_after_that_is_not_ascii_digits_is_ignored() -> None:
    answers = iter(
        [
            httpx.Response(503, headers=[(b"Retry-After", b"\xb2")], json={"code": "unavailable"}),
            httpx.Response(200, json={"subject": "me"}),
        ]
    )
    config = BrokerConnectionConfig(
        broker_url="https://broker.test", backoff_base=0.001, backoff_max=0.001
    )

    async def main() -> None:
        async with AsyncBrokerSandboxClient(
            config,
            auth=OIDCTokenAuth("opaque-caller-token-0123456789"),
            http_transport=httpx.MockTransport(lambda request: next(answers)),
        ) as client:
            assert await client.whoami() == {"subject": "me"}

    run(main())


def test_a_command_timeout_over_the_brokers_limit_is_refused_before_sending(
    broker: Any,
) -> None:
    async def main() -> None:
        env = {"SANDBOX_EXEC_TIMEOUT_SECONDS": "86400"}  # the runtime's cap raised
        async with await AsyncSandbox.create(
            environ=broker.environ("kubernetes"), env=env
        ) as sandbox:
            for limit in (86396, 86395.5):
                with pytest.raises(ValueError, match=r"timeout.*86395.*X-Sandbox-Timeout"):
                    await sandbox.commands.run("true", timeout=limit)
            assert broker.execution_count(sandbox.name) == 0
            assert (await sandbox.commands.run("true", timeout=86395)).exit_code == 0

    run(main())


OPAQUE = "opaque-caller-token-0123456789"


@pytest.mark.parametrize(
    "answer",
    [
        lambda: httpx.Response(200, text=f"you sent {OPAQUE}"),
        lambda: httpx.Response(
            200, json={"items": [{"name": "s", "phase": "Ready", "router": {"port": OPAQUE}}]}
        ),
    ],
    ids=["not JSON", "a bad field"],
)
def test_the_callers_opaque_token_echoed_in_a_success_never_shows(answer: Any) -> None:
    import traceback

    from k8s_agent_sandbox_awx import AsyncBrokerSandboxClient, BrokerProtocolError

    async def main() -> BaseException:
        async with AsyncBrokerSandboxClient(
            broker_url="https://broker.test",
            auth=OIDCTokenAuth(OPAQUE),
            http_transport=httpx.MockTransport(lambda request: answer()),
        ) as client:
            with pytest.raises(BrokerProtocolError) as info:
                await client.list_sandboxes()
        return info.value

    error = run(main())
    shown = "".join(traceback.format_exception(error)) + repr(error)
    assert OPAQUE not in shown and "<redacted>" in str(error)
