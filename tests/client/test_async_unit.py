"""The async client's I/O layer with httpx.MockTransport: cancellation cleanup, auth, retries,
redirects, streamed bodies."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import (
    AsyncBrokerSandboxClient,
    BrokerAuthenticationError,
    BrokerConnectionConfig,
    BrokerRedirectError,
    BrokerUnavailableError,
)
from k8s_agent_sandbox_awx.client.core._retry import RetryPolicy
from k8s_agent_sandbox_awx.credentials._credential import Credential

BROKER = "https://broker.test"


class AsyncStub:
    """A CredentialSource stand-in with an async path; the sync path must not be used."""

    def __init__(self, *tokens: str) -> None:
        self.tokens = list(tokens) or ["tok-1"]
        self.index = 0
        self.calls = 0
        self.invalidated = 0
        self.lock = threading.Lock()

    def get_credential(self, audience: str) -> Credential:
        raise AssertionError("the async client must call aget_credential")

    async def aget_credential(self, audience: str) -> Credential:
        assert audience == BROKER
        self.calls += 1
        token = self.tokens[min(self.index, len(self.tokens) - 1)]
        return Credential(token=token, provider="stub", source="test")

    def invalidate(self, audience: str) -> None:
        self.invalidated += 1
        self.index += 1


def sandbox(name: str, phase: str = "Pending") -> dict[str, Any]:
    return {
        "name": name,
        "namespace": "default",
        "template": "python",
        "phase": phase,
        "ready": phase == "Ready",
        "router": {"sandbox_id": name, "namespace": "default", "port": 8888},
    }


class Broker:
    """A scripted async broker: records requests; hooks per (method, path)."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.hooks: dict[tuple[str, str], Any] = {}
        self.deleted: list[str] = []
        self.delete_done = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        self.requests.append(request)
        hook = self.hooks.get((request.method, request.url.path))
        if hook is not None:
            result = await hook(request)
            if result is not None:
                return result
        path = request.url.path
        if request.method == "POST" and path == "/v1/sandboxes":
            return httpx.Response(201, json=sandbox("sbx-1"))
        if request.method == "DELETE":
            self.deleted.append(path.rsplit("/", 1)[1])
            return httpx.Response(204)
        if request.method == "GET" and path.startswith("/v1/sandboxes/"):
            if request.url.params.get("wait") == "ready":
                await asyncio.sleep(60)  # a long-poll that never ends in time
            return httpx.Response(200, json=sandbox("sbx-1"))
        if path == "/execute":
            cmd = json.loads(request.content)["command"]
            return httpx.Response(200, json={"stdout": cmd, "stderr": "", "exit_code": 0})
        if "x-sandbox-id" in request.headers:  # the runtime's own 404: no such endpoint
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(404, json={"detail": "no route", "code": "not_found"})


def make(broker: Broker, source: Any, **settings: Any) -> AsyncBrokerSandboxClient:
    settings.setdefault("broker_protocol", "v1")  # the fake speaks v1 (no detection probe)
    config = BrokerConnectionConfig(broker_url=BROKER, **settings)
    client = AsyncBrokerSandboxClient(
        config, auth=source, http_transport=httpx.MockTransport(broker)
    )

    async def no_sleep(_seconds: float) -> None:
        return None

    client._transport._sleep = no_sleep
    client._transport.retry = RetryPolicy(max_attempts=config.max_attempts, backoff_base=0.0)
    return client


def test_cancel_during_the_create_request_replays_it_and_deletes() -> None:
    broker = Broker()
    first = asyncio.Event

    async def main() -> None:
        arrived = first()
        posts: list[str] = []

        async def slow_create(request: httpx.Request) -> None:
            posts.append(request.headers["Idempotency-Key"])
            if len(posts) == 1:
                arrived.set()
                await asyncio.sleep(60)  # the broker created it; the answer never comes

        broker.hooks[("POST", "/v1/sandboxes")] = slow_create
        client = make(broker, AsyncStub())
        task = asyncio.create_task(client.create_sandbox())
        await arrived.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(posts) == 2 and posts[0] == posts[1]  # replayed with the same key
        assert broker.deleted == ["sbx-1"]
        await client.close()

    asyncio.run(main())


def test_repeated_cancellation_does_not_interrupt_the_cleanup() -> None:
    broker = Broker()

    async def main() -> None:
        waiting = asyncio.Event()
        deleting = asyncio.Event()

        async def long_poll(request: httpx.Request) -> None:
            if request.url.params.get("wait") == "ready":
                waiting.set()
            return None

        async def slow_delete(request: httpx.Request) -> None:
            deleting.set()
            await asyncio.sleep(0.3)
            broker.delete_done += 1
            return None

        broker.hooks[("GET", "/v1/sandboxes/sbx-1")] = long_poll
        broker.hooks[("DELETE", "/v1/sandboxes/sbx-1")] = slow_delete
        client = make(broker, AsyncStub())
        task = asyncio.create_task(client.create_sandbox(sandbox_ready_timeout=120))
        await waiting.wait()
        task.cancel()
        await deleting.wait()
        for _ in range(5):  # cancelled again and again while the delete runs
            task.cancel()
            await asyncio.sleep(0.01)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert broker.delete_done == 1 and broker.deleted == ["sbx-1"]
        await client.close()
        assert client._transport.is_closed

    asyncio.run(main())


def test_401_refresh_uses_the_async_credential_path() -> None:
    broker = Broker()
    source = AsyncStub("old", "new")

    async def whoami(request: httpx.Request) -> httpx.Response:
        if request.headers["Authorization"] == "Bearer old":
            return httpx.Response(
                401,
                json={"detail": "expired", "code": "token_expired"},
                headers={"Agent-Sandbox-Broker-Error": "token_expired"},
            )
        return httpx.Response(200, json={"subject": "me"})

    broker.hooks[("GET", "/v1/whoami")] = whoami

    async def main() -> None:
        client = make(broker, source)
        assert await client.whoami() == {"subject": "me"}
        assert (source.calls, source.invalidated) == (2, 1)
        source.index = 0
        source.tokens = ["old"]
        with pytest.raises(BrokerAuthenticationError, match="re-read") as info:
            await client.whoami()
        assert "old" not in str(info.value).split("token_expired")[0].replace("re-read", "")
        await client.close()

    asyncio.run(main())


def test_retries_are_bounded_and_only_for_idempotent_requests() -> None:
    broker = Broker()
    attempts = {"exists": 0, "execute": 0}

    async def busy(request: httpx.Request) -> httpx.Response:
        key = "execute" if request.url.path in ("/execute", "/commands") else "exists"
        attempts[key] += 1
        return httpx.Response(503, json={"detail": "busy", "code": "unavailable"})

    broker.hooks[("GET", "/fs/exists")] = busy
    broker.hooks[("POST", "/execute")] = busy
    broker.hooks[("POST", "/commands")] = busy

    async def main() -> None:
        from k8s_agent_sandbox_awx.client._async_client import AsyncSandbox
        from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget, SandboxInfo

        client = make(broker, AsyncStub(), max_attempts=3)
        handle = AsyncSandbox(
            client, SandboxInfo("s", "default", None, "Ready", True, RouterTarget("s"))
        )
        with pytest.raises(BrokerUnavailableError):
            await handle.files.exists("x")
        with pytest.raises(BrokerUnavailableError):
            await handle.commands.run("echo hi")
        assert attempts == {"exists": 3, "execute": 1}

        async def stream() -> AsyncIterator[bytes]:
            yield b"one-shot"

        broker.hooks[("POST", "/fs/write")] = busy
        handle.files._api.has_fs = True  # a runtime with the file API
        with pytest.raises(BrokerUnavailableError):
            await handle.files.write("f.bin", stream())
        uploads = [r for r in broker.requests if r.url.path == "/fs/write"]
        assert len(uploads) == 1  # a consumed async stream is never re-sent
        assert uploads[0].headers.get("Transfer-Encoding") == "chunked"
        with pytest.raises(BrokerUnavailableError):
            await handle.files.write("g.bin", b"bytes are replayable")
        assert len([r for r in broker.requests if r.url.path == "/fs/write"]) == 1 + 3
        await client.close()

    asyncio.run(main())


def test_redirects_are_not_followed() -> None:
    broker = Broker()

    async def redirect(request: httpx.Request) -> httpx.Response:
        return httpx.Response(307, headers={"Location": "https://elsewhere.test/v1/whoami"})

    broker.hooks[("GET", "/v1/whoami")] = redirect

    async def main() -> None:
        client = make(broker, AsyncStub())
        with pytest.raises(BrokerRedirectError, match="never followed") as info:
            await client.whoami()
        assert info.value.location == "https://elsewhere.test/v1/whoami"
        assert [r.url.host for r in broker.requests] == ["broker.test"]
        await client.close()

    asyncio.run(main())


def test_unknown_keyword_arguments_are_refused() -> None:
    from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox

    async def main() -> None:
        with pytest.raises(TypeError, match="'templat'"):
            await AsyncSandbox.create(templat="python", broker_url=BROKER)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="'ready_timout'"):
            await AsyncSandbox.connect("x", ready_timout=3)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="'lifetime_seconds'"):
            await AsyncSandbox.list(lifetime_seconds=3)  # type: ignore[call-arg]
        client = make(Broker(), AsyncStub())
        with pytest.raises(TypeError, match="'labelz'"):
            await client.create_sandbox(labelz={})  # type: ignore[call-arg]
        await client.close()

    asyncio.run(main())
    with pytest.raises(TypeError, match="'templat'"):
        Sandbox.create(templat="python", broker_url=BROKER)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'cwdir'"):
        from k8s_agent_sandbox_awx.client._commands import Commands
        from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget

        Commands(None, RouterTarget("s")).run("true", cwdir="/")  # type: ignore[arg-type,call-arg]
