"""The ``/rpc`` dialect (the deployed brokers' control plane): end to end against a local
broker that serves only ``/rpc`` (sync and async), and its edge cases against scripted answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import (
    AsyncSandbox,
    BrokerConnectionConfig,
    BrokerSandboxClient,
    Sandbox,
)
from k8s_agent_sandbox_awx._upstream import SandboxWarmPoolNotFoundError
from k8s_agent_sandbox_awx.client.wire._dialects import detected, forget_detected
from k8s_agent_sandbox_awx.errors import (
    AudienceMismatchError,
    BrokerError,
    BrokerPermissionError,
    BrokerWarmPoolNotFoundError,
    RequestTimeoutError,
    SandboxFailedError,
    SandboxTemplateNotFoundError,
    UnsupportedOperationError,
)

STAMP = "broker.agent-sandbox-awx.io/"


def _settled(broker: Any) -> list[dict[str, Any]]:
    return [c for c in broker.claims() if not c["metadata"].get("deletionTimestamp")]


@pytest.mark.e2e
def test_zero_config_create_commands_files_extend_kill(
    rpc_broker: Any, use_env: Callable[[dict[str, str]], None], live: Any
) -> None:
    use_env(rpc_broker.environ("kubernetes", namespace="team-a", service_account="agent"))
    sandbox = Sandbox.create()
    assert sandbox.client.dialect.name == "rpc"
    assert sandbox.name.startswith("broker-") and sandbox.sandbox_id.startswith("sbx-")
    assert sandbox.namespace == "team-a"  # the namespace the broker pinned, adopted
    assert detected(sandbox.client.broker_url) is sandbox.client.dialect  # remembered
    assert sandbox.commands.run("echo hi").stdout == "hi\n"
    sandbox.files.write("notes/a.txt", b"data")
    assert sandbox.files.read("notes/a.txt") == b"data"
    assert [e.name for e in sandbox.files.list("notes")] == ["a.txt"]
    again = Sandbox.connect(sandbox.name)  # by the claim name create returned
    assert again.sandbox_id == sandbox.sandbox_id and again.status()[0] == "SandboxReady"
    assert again.files.read("notes/a.txt") == b"data"
    again.close_connection()
    lifetime = sandbox.client.extend(sandbox.name, 120)
    assert lifetime.expires_at and not lifetime.capped
    assert sandbox.client.extend(sandbox.name, 10**7).capped  # clamped at the policy's cap
    [claim] = rpc_broker.claims()
    assert claim["metadata"]["labels"]["agents.x-k8s.io/created-by"] == "python-client"
    sandbox.kill()
    sandbox.kill()  # idempotent
    assert live(rpc_broker) == []


@pytest.mark.e2e
def test_async_zero_config(rpc_broker: Any, use_env: Callable[[dict[str, str]], None]) -> None:
    use_env(rpc_broker.environ("kubernetes"))

    async def main() -> None:
        async with await AsyncSandbox.create(lifetime_seconds=300) as sandbox:
            assert sandbox.client.dialect.name == "rpc"
            assert (await sandbox.commands.run("echo hi")).stdout == "hi\n"
            await sandbox.files.write("b.txt", "x")
            assert await sandbox.files.read("b.txt") == b"x"
            assert not (await sandbox.client.extend(sandbox.name, 60)).capped
            with pytest.raises(UnsupportedOperationError, match="'rpc'"):
                await AsyncSandbox.list()

    asyncio.run(main())
    assert _settled(rpc_broker) == []


@pytest.mark.e2e
def test_create_sends_what_the_original_package_sent(rpc_broker: Any) -> None:
    env = rpc_broker.environ("kubernetes")
    with Sandbox.create(
        warmpool="python",
        labels={"team": "ml"},
        annotations={"note": "x"},
        pod_labels={"pod": "l"},
        pod_annotations={"pod": "a"},
        scopes=["commands"],
        shutdown_after_seconds=600,
        namespace="agent-sandbox",  # the original's default: the broker's pinned one is used
        environ=env,
    ) as sandbox:
        assert sandbox.namespace == "default"
        [claim] = rpc_broker.claims()
        meta, spec = claim["metadata"], claim["spec"]
        assert meta["labels"]["team"] == "ml" and meta["annotations"]["note"] == "x"
        assert spec["warmPoolRef"] == {"name": "python"}
        assert spec["additionalPodMetadata"] == {
            "labels": {"pod": "l"},
            "annotations": {"pod": "a"},
        }
        assert spec["lifecycle"]["shutdownPolicy"] == "Delete"
        assert meta["annotations"][STAMP + "scopes"] == "commands"
        assert sandbox.commands.run("echo ok").stdout == "ok\n"
        with pytest.raises(BrokerPermissionError):  # the files scope was not requested
            sandbox.files.write("x.txt", b"x")


@pytest.mark.e2e
@pytest.mark.upstream  # upstream's exception classes
def test_terminal_conditions_are_typed_and_the_claim_is_deleted(
    rpc_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    env = rpc_broker.environ("kubernetes")
    with pytest.raises(BrokerWarmPoolNotFoundError) as pool:
        Sandbox.create(template="no-such-pool", environ=env)
    assert isinstance(pool.value, SandboxWarmPoolNotFoundError)  # upstream's class too
    with pytest.raises(SandboxTemplateNotFoundError, match="template"):
        Sandbox.create(template="orphan", environ=env)
    rpc_broker.crash_next_start()
    with pytest.raises(SandboxFailedError) as crashed:
        Sandbox.create(environ=env)
    assert crashed.value.reason == "crashed"
    assert _settled(rpc_broker) == []
    assert caplog.text.count("for create_cleanup") == 3  # the broker logs the purpose


@pytest.mark.e2e
def test_what_rpc_lacks_is_a_typed_error(rpc_broker: Any) -> None:
    env = rpc_broker.environ("kubernetes")
    with BrokerSandboxClient(environ=env) as client:
        for call in (client.list_sandboxes, client.whoami):
            with pytest.raises(UnsupportedOperationError, match="'rpc' dialect"):
                call()
        with pytest.raises(UnsupportedOperationError, match="env="):
            client.create_sandbox(env={"A": "1"})
    assert rpc_broker.claims() == []


# --------------------------------------------------------------------------------------------
# Scripted answers


class RpcScript:
    """A scripted ``/rpc`` broker for MockTransport; ``create`` may be replaced."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        self.polls_until_ready = 3
        self.create: Callable[[], httpx.Response] = lambda: httpx.Response(
            200, json={"claim_name": "broker-abc", "namespace": "ns"}
        )

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.requests.append((request.method, request.url.path, body))
        if request.url.path == "/v1/healthz":
            return httpx.Response(404, text="Not Found")
        op = body.get("op")
        if op == "create":
            return self.create()
        if op == "status":
            self.polls_until_ready -= 1
            ready = self.polls_until_ready <= 0
            return httpx.Response(
                200,
                json={
                    "sandbox_name": "sbx-1" if ready else None,
                    "namespace": "ns",
                    "ready": ready,
                    "conditions": [],
                },
            )
        if op == "delete":
            return httpx.Response(204)
        return httpx.Response(400, text="bad op")

    def ops(self) -> list[str]:
        return [body.get("op", path) for _, path, body in self.requests]


def _client(script: RpcScript, creds: Any, **settings: Any) -> BrokerSandboxClient:
    config = BrokerConnectionConfig(broker_url="https://broker.test", **settings)
    client = BrokerSandboxClient(config, auth=creds, http_transport=httpx.MockTransport(script))
    client._transport.retry = client._transport.retry.__class__(backoff_base=0.0)
    return client


def test_detection_is_one_probe_per_broker_and_process(creds: Any, real_detection: None) -> None:
    script = RpcScript()
    sleeps: list[float] = []
    first = _client(script, creds, poll_interval=0.25)
    first._transport._sleep = sleeps.append
    sandbox = first.create_sandbox()
    assert sandbox.sandbox_id == "sbx-1" and sandbox.namespace == "ns"
    assert script.ops() == ["/v1/healthz", "create", "status", "status", "status"]
    assert sleeps == [0.1, 0.2]  # status polls: at once, then pauses doubling up to 0.25
    second = _client(script, creds)
    assert second.dialect.name == "rpc"
    second.delete("broker-abc")
    assert script.ops().count("/v1/healthz") == 1
    first.close()
    second.close()


def test_the_probe_carries_no_token_and_needs_none(real_detection: None) -> None:
    """Detection is one unauthenticated request: it is sent (and the broker's health and TLS
    checked, e.g. by ``doctor``) even when no usable token is found; a token never rides on it."""
    from k8s_agent_sandbox_awx import AsyncBrokerSandboxClient

    class NoToken:
        calls = 0

        def get_credential(self, audience: str) -> Any:
            NoToken.calls += 1
            raise AudienceMismatchError("the token is for another service")

        def invalidate(self, audience: str) -> None:
            pass

    seen: list[httpx.Request] = []

    def script(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return RpcScript()(request)

    config = BrokerConnectionConfig(broker_url="https://broker.test")
    with BrokerSandboxClient(
        config, auth=NoToken(), http_transport=httpx.MockTransport(script)
    ) as client:
        client.healthz()
        assert client.dialect.name == "rpc"
    forget_detected()

    async def main() -> None:
        async with AsyncBrokerSandboxClient(
            config, auth=NoToken(), http_transport=httpx.MockTransport(script)
        ) as client:
            await client.healthz()
            assert client.dialect.name == "rpc"

    asyncio.run(main())
    assert [r.url.path for r in seen] == ["/v1/healthz", "/rpc"] * 2
    assert NoToken.calls == 0 and not any("authorization" in r.headers for r in seen)


def test_a_pinned_dialect_sends_no_probe(creds: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    script = RpcScript()
    env = {
        "AGENT_SANDBOX_BROKER_URL": "https://broker.test",
        "AGENT_SANDBOX_BROKER_PROTOCOL": "rpc",
    }
    config = BrokerConnectionConfig.from_env(env)
    assert config.broker_protocol == "rpc"
    with BrokerSandboxClient(
        config, auth=creds, http_transport=httpx.MockTransport(script)
    ) as client:
        client.delete("broker-abc")
    assert script.ops() == ["delete"]


def test_plain_text_errors_are_cut_and_redacted(creds: Any, kit: Any) -> None:
    script = RpcScript()
    text = f"quota exhausted for Bearer {kit.TOKEN} " + "x" * 400
    script.create = lambda: httpx.Response(429, text=text)
    client = _client(script, creds, broker_protocol="rpc")
    with pytest.raises(Exception) as info:
        client.create_sandbox()
    message = str(info.value)
    assert kit.TOKEN not in message and "<redacted>" in message
    assert "op create" in message and "x" * 201 not in message
    assert script.ops() == ["create"]  # a create without an idempotency key is never retried
    client.close()


def test_an_interrupted_create_is_not_replayed(creds: Any) -> None:
    script = RpcScript()

    def timeout() -> httpx.Response:
        raise httpx.ReadTimeout("no answer")

    script.create = timeout
    client = _client(script, creds, broker_protocol="rpc")
    with pytest.raises(RequestTimeoutError) as info:
        client.create_sandbox()
    assert script.ops() == ["create"]  # sent once: a replay would make a second sandbox
    assert any("cannot replay" in note for note in info.value.__notes__)
    client.close()


def test_concurrent_first_uses_send_one_probe(creds: Any, real_detection: None) -> None:
    """Threads, and tasks on an event loop, that all start before the dialect is known wait
    for the one probe instead of sending their own."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from k8s_agent_sandbox_awx import AsyncBrokerSandboxClient
    from k8s_agent_sandbox_awx.client.wire._dialects import forget_detected

    script = RpcScript()
    answer = script.__call__
    lock = threading.Lock()

    started = threading.Barrier(6)  # every caller begins before the first probe can answer

    def slow_probe(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/healthz":
            time.sleep(0.2)  # every caller arrives while the first one probes
        with lock:
            return answer(request)

    def delete(client: Any) -> None:
        started.wait(30)  # a pool thread started late (a loaded machine) came after the answer:
        client.delete("broker-abc")  # a guessed dialect is not remembered, so it probed again

    clients = [_client(script, creds) for _ in range(6)]
    for client in clients:
        client._transport._http._transport = httpx.MockTransport(slow_probe)
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(delete, clients))
    assert script.ops().count("/v1/healthz") == 1
    for client in clients:
        client.close()

    forget_detected()
    script.requests.clear()

    class AsyncCreds:
        async def aget_credential(self, audience: str) -> Any:
            return creds.get_credential(audience)

        def invalidate(self, audience: str) -> None:
            creds.invalidate(audience)

    async def main() -> None:
        async def one() -> None:
            async def handler(request: httpx.Request) -> httpx.Response:
                if request.url.path == "/v1/healthz":
                    await asyncio.sleep(0.2)
                return answer(request)

            config = BrokerConnectionConfig(broker_url="https://broker.test")
            transport = httpx.MockTransport(handler)
            async with AsyncBrokerSandboxClient(
                config,
                auth=AsyncCreds(),  # type: ignore[arg-type]
                http_transport=transport,
            ) as client:
                await client.delete("broker-abc")

        await asyncio.gather(*(one() for _ in range(6)))

    asyncio.run(main())
    assert script.ops().count("/v1/healthz") == 1


@pytest.mark.e2e
def test_create_sandbox_takes_the_rpc_fields_too(rpc_broker: Any) -> None:
    env = rpc_broker.environ("kubernetes")
    with BrokerSandboxClient(environ=env) as client:
        sandbox = client.create_sandbox(
            "python-sandbox-warmpool", scopes=["commands"], pod_labels={"a": "b"}
        )
        [claim] = rpc_broker.claims()
        assert claim["metadata"]["annotations"][STAMP + "scopes"] == "commands"
        assert claim["spec"]["additionalPodMetadata"] == {"labels": {"a": "b"}}
        assert sandbox.commands.run("echo ok").stdout == "ok\n"
    with (
        BrokerSandboxClient(environ=env, broker_protocol="v1") as v1,
        pytest.raises(UnsupportedOperationError, match="'v1' dialect"),
    ):
        v1.create_sandbox(scopes=["commands"])  # refused before anything is sent


def test_a_busy_v1_broker_is_not_taken_for_rpc(creds: Any, real_detection: None) -> None:
    """A ``429`` (or ``408``) to the probe says the broker is busy, not which dialect it
    speaks: a 429 is retried (``Retry-After`` honoured), a 408 is an error, and neither is
    remembered as ``rpc`` for the life of the process from one busy moment of a v1 broker."""
    seen: list[str] = []
    busy = [429, 408]

    def v1_broker(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/v1/healthz" and busy:
            return httpx.Response(busy.pop(0), headers={"Retry-After": "0"}, text="slow down")
        if request.url.path == "/v1/healthz":
            return httpx.Response(200, json={"status": "ok", "api_version": "v1"})
        return httpx.Response(204)

    config = BrokerConnectionConfig(broker_url="https://broker.test")
    with BrokerSandboxClient(
        config, auth=creds, http_transport=httpx.MockTransport(v1_broker)
    ) as client:
        client._transport.retry = client._transport.retry.__class__(backoff_base=0.0)
        client._transport._sleep = lambda seconds: None
        with pytest.raises(BrokerError) as info:  # the 429 retried, then a 408
            client.delete("sbx-1")
        assert info.value.status_code == 408
        assert detected("https://broker.test") is None  # nothing remembered
        client.delete("sbx-1")
        assert client.dialect.name == "v1"
    assert seen == ["/v1/healthz"] * 3 + ["/v1/sandboxes/sbx-1"]
