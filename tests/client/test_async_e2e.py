"""End-to-end: the synchronous suite's scenarios through the async API, against the local
broker over real HTTPS on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from k8s_agent_sandbox_awx import (
    AsyncBrokerSandboxClient,
    AsyncSandbox,
    BrokerAuthenticationError,
    BrokerConnectionConfig,
    BrokerTLSError,
    BrokerUnavailableError,
    BrokerWarmPoolNotFoundError,
    CommandTimeoutError,
    ConfigurationError,
    FileInfo,
    KubernetesAuth,
    OIDCTokenAuth,
    SandboxReadyTimeoutError,
)
from k8s_agent_sandbox_awx._upstream import (
    ExecutionResult,
    SandboxError,
    SandboxNotFoundError,
    SandboxTemplateNotFoundError,
)
from k8s_agent_sandbox_awx.client.wire._dialect import LIST, REPLAY_CREATE

pytestmark = pytest.mark.e2e

STAMP = "broker.agent-sandbox-awx.io/"
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.mark.parametrize("kind", ["kubernetes", "gitlab"])
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_readme_example_zero_arg(
    live: Any, broker: Any, use_env: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.delenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD")  # truly zero-config
    use_env(broker.environ(kind, namespace="team-a", service_account="agent"))

    async def main() -> None:
        sandbox = await AsyncSandbox.create()
        result = await sandbox.commands.run('echo "Hello from Agent Sandbox!"')
        assert isinstance(result, ExecutionResult)
        assert (result.stdout, result.stderr, result.exit_code) == (
            "Hello from Agent Sandbox!\n",
            "",
            0,
        )
        [claim] = broker.claims()
        annotations = claim["metadata"]["annotations"]
        assert annotations[STAMP + "provider"] == kind
        if LIST in sandbox.client.dialect.features:
            assert [i.name for i in await AsyncSandbox.list()] == [sandbox.name]
        await sandbox.kill()
        await sandbox.kill()  # idempotent
        assert sandbox.client._transport.is_closed

    run(main())
    assert live(broker) == []


def test_async_with_files_streamed_and_cleanup(
    live: Any, dialect_broker: Any, tmp_path: Path
) -> None:
    broker = dialect_broker
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    auth = KubernetesAuth(env.pop("AGENT_SANDBOX_TOKEN_FILE"))
    local_in = tmp_path / "in.csv"
    local_in.write_bytes(b"a,b\n1,2\n" * 1000)
    big = os.urandom(3 * 1024 * 1024 + 17)

    async def chunks() -> AsyncIterator[bytes]:
        for offset in range(0, len(big), 500_000):
            await asyncio.sleep(0)
            yield big[offset : offset + 500_000]

    class AsyncSink:
        def __init__(self) -> None:
            self.digest = hashlib.sha256()

        async def write(self, data: bytes) -> int:
            self.digest.update(data)
            return len(data)

    async def main() -> None:
        async with await AsyncSandbox.create(
            template="python", labels={"team": "ml"}, auth=auth, environ=env
        ) as sandbox:
            if sandbox.client.dialect.name == "v1":  # /rpc reports no labels
                assert sandbox.info.labels == {"team": "ml"}
            await sandbox.files.write("data/in.csv", source)  # a sync file, read off-loop
            await sandbox.files.write("data/note.txt", "héllo")
            await sandbox.files.write("data/big.bin", chunks())  # an async iterable, streamed
            assert await sandbox.files.read("data/note.txt") == "héllo".encode()
            assert await sandbox.files.exists("data/in.csv")
            assert not await sandbox.files.exists("nope")
            entries = await sandbox.files.list("data")
            assert all(isinstance(e, FileInfo) for e in entries)
            assert sorted(e.name for e in entries) == ["big.bin", "in.csv", "note.txt"]
            assert await sandbox.files.read_to("data/in.csv", tmp_path / "out.csv") == 8000
            assert (tmp_path / "out.csv").read_bytes() == local_in.read_bytes()
            sink = AsyncSink()
            assert await sandbox.files.read_to("data/big.bin", sink) == len(big)
            assert sink.digest.hexdigest() == hashlib.sha256(big).hexdigest()
            streamed = [c async for c in sandbox.files.iter_bytes("data/big.bin")]
            assert b"".join(streamed) == big and max(map(len, streamed)) <= 1024 * 1024
            async with contextlib.aclosing(sandbox.files.iter_bytes("data/big.bin")) as it:
                async for first in it:
                    assert first == big[: len(first)]
                    break  # stopping early closes the response
            with pytest.raises(SandboxError, match="max_bytes"):
                await sandbox.files.read_to("data/big.bin", tmp_path / "cut.bin", max_bytes=10)
            with pytest.raises(SandboxError, match="does not exist"):
                await sandbox.files.read("missing.bin")
            assert (await sandbox.commands.run("sh -c 'exit 3'")).exit_code == 3
            with pytest.raises(CommandTimeoutError) as timeout:
                await sandbox.commands.run("sleep 5", timeout=0.5)
            assert timeout.value.result is not None and timeout.value.result.timed_out
            raise RuntimeError("user code failed")

    with pytest.raises(RuntimeError, match="user code failed"), open(local_in, "rb") as source:
        run(main())
    assert live(broker) == []  # killed although the block raised
    assert not (tmp_path / "cut.bin").exists()
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".part"] == []


def test_token_file_rotation_between_two_commands(
    live: Any, dialect_broker: Any, tmp_path: Path
) -> None:
    broker = dialect_broker
    path = tmp_path / "tokens" / "agent-sandbox-token"
    env = broker.environ("kubernetes", token_file=path, namespace="team-a")
    old = path.read_text()

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env) as sandbox:
            assert (await sandbox.commands.run("echo one")).stdout == "one\n"
            broker.write_projected_token(path, namespace="team-a")
            broker.revoke_token(old)  # only a re-read token can work now
            assert (await sandbox.commands.run("echo two")).stdout == "two\n"

    run(main())
    assert live(broker) == []


def test_401_refreshes_the_credential_once(
    live: Any, dialect_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    broker = dialect_broker
    caplog.set_level(logging.DEBUG)
    env = broker.environ("gitlab")
    tokens = [
        broker.issue_gitlab_token("group/project"),
        broker.issue_gitlab_token("group/project"),
    ]
    calls: list[str] = []

    async def fetch() -> str:  # an async token callable: awaited on the running loop
        calls.append("x")
        return tokens[min(len(calls), 2) - 1]

    async def main() -> None:
        auth = OIDCTokenAuth(fetch)
        async with await AsyncSandbox.create(auth=auth, environ=env) as sandbox:
            assert len(calls) == 1
            broker.revoke_token(tokens[0])
            assert (await sandbox.commands.run("echo ok")).stdout == "ok\n"
            assert len(calls) == 2  # invalidated and fetched again after the 401
            broker.revoke_token(tokens[1])
            with pytest.raises(BrokerAuthenticationError) as info:
                await sandbox.commands.run("echo never")
            assert info.value.status_code == 401 and info.value.code == "token_revoked"
            assert tokens[1] not in str(info.value) and tokens[0] not in str(info.value)
            fresh = OIDCTokenAuth(broker.issue_gitlab_token("group/project"))
            sandbox.client._transport.auth = fresh  # type: ignore[attr-defined]

    run(main())
    for token in tokens:
        for part in token.split(".")[1:]:
            assert part not in caplog.text
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("k8s_agent_sandbox_awx")]
    assert ours and not any("Bearer" in m or "uthorization" in m for m in ours)
    assert live(broker) == []


def test_retries_never_run_a_command_twice(live: Any, dialect_broker: Any) -> None:
    broker = dialect_broker
    env = broker.environ("kubernetes")

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env) as sandbox:
            name = sandbox.sandbox_id  # the broker's sandbox (under /rpc the claim's name differs)
            broker.drop_connection_after_execute(1, sandbox=name)
            with pytest.raises(BrokerUnavailableError, match="not idempotent"):
                await sandbox.commands.run("echo once")
            assert broker.execution_count(name) == 1
            broker.inject_unavailable(
                1, retry_after=0, scope="data", path="/commands", sandbox=name
            )
            with pytest.raises(BrokerUnavailableError):
                await sandbox.commands.run("echo never")
            assert broker.execution_count(name) == 1
            broker.inject_unavailable(2, retry_after=0, scope="data", sandbox=name)
            assert await sandbox.files.exists("x") is False  # retried through a 503 burst
            assert (await sandbox.commands.run("echo fine")).stdout == "fine\n"
            assert broker.execution_count(name) == 2

    run(main())


@pytest.mark.usefixtures("dialect")  # once per dialect
@pytest.mark.dialect_feature(REPLAY_CREATE, reason="a create is retried with its key")
def test_create_is_retried_with_its_idempotency_key(live: Any, broker: Any) -> None:
    env = broker.environ("kubernetes")
    before = len(broker.claims(include_deleted=True))
    broker.inject_unavailable(2, retry_after=0, scope="control", path="/v1/sandboxes")

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env):
            assert len(broker.claims(include_deleted=True)) == before + 1

    run(main())


def test_ready_timeout_deletes_the_claim(live: Any, dialect_broker: Any) -> None:
    broker = dialect_broker
    env = broker.environ("kubernetes")
    before = len(broker.claims(include_deleted=True))
    broker.set_readiness_delay(30)
    with pytest.raises(SandboxReadyTimeoutError) as info:
        run(AsyncSandbox.create(environ=env, ready_timeout=1))
    assert info.value.phase == "Pending"
    assert live(broker) == []
    assert len(broker.claims(include_deleted=True)) == before + 1


@pytest.mark.parametrize("cancels", [1, 3])
def test_cancelled_create_deletes_its_claim(live: Any, dialect_broker: Any, cancels: int) -> None:
    """Cancelled while waiting for Ready (also again and again during the cleanup): the claim
    is deleted before CancelledError propagates, and the connections are closed."""
    broker = dialect_broker
    env = broker.environ("kubernetes")
    before = len(broker.claims(include_deleted=True))
    broker.set_readiness_delay(30)

    async def main() -> None:
        task = asyncio.create_task(AsyncSandbox.create(environ=env, ready_timeout=60))
        deadline = time.monotonic() + 20
        while not broker.claims() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        assert broker.claims(), "the create never reached the broker"
        await asyncio.sleep(0.1)  # inside the long-poll wait
        for _ in range(cancels):
            task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await task
        # the delete finished before the cancellation reached us
        assert [c for c in broker.claims() if not c["metadata"].get("deletionTimestamp")] == []

    run(main())
    assert live(broker) == []
    assert len(broker.claims(include_deleted=True)) == before + 1


def test_cancelled_async_with_block_kills_the_sandbox(live: Any, dialect_broker: Any) -> None:
    broker = dialect_broker
    env = broker.environ("kubernetes")
    entered = asyncio.Event

    async def main() -> None:
        started = entered()

        async def user() -> None:
            async with await AsyncSandbox.create(environ=env) as sandbox:
                await sandbox.commands.run("true")
                started.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(user())
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [c for c in broker.claims() if not c["metadata"].get("deletionTimestamp")] == []

    run(main())
    assert live(broker) == []


def test_connect_and_errors(live: Any, broker: Any, dialect: str) -> None:
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    other = broker.environ("kubernetes", namespace="team-b", service_account="intruder")

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env) as sandbox:
            again = await AsyncSandbox.connect(sandbox.name, environ=env)
            assert (await again.commands.run("echo hi")).stdout == "hi\n"
            assert (await again.status())[0] == "SandboxReady"
            await again.close_connection()
            # another namespace's sandbox is not disclosed (404) by either dialect (issue 23)
            with pytest.raises(SandboxNotFoundError):
                await AsyncSandbox.connect(sandbox.name, environ=other)
        # /rpc: template= names the warm pool, which does not exist
        missing = SandboxTemplateNotFoundError if dialect == "v1" else BrokerWarmPoolNotFoundError
        with pytest.raises(missing):
            await AsyncSandbox.create(template="no-such-template", environ=env)

    run(main())
    assert live(broker) == []


def test_api_url_and_http_are_rejected(live: Any, broker: Any) -> None:
    env = broker.environ("kubernetes")
    before = len(broker.claims(include_deleted=True))
    with pytest.raises(ConfigurationError, match="bypass the broker"):
        AsyncBrokerSandboxClient(environ=env, api_url="https://127.0.0.1:1/")
    plain = broker.url.replace("https://", "http://")
    with pytest.raises(ConfigurationError, match="http://"):
        run(AsyncSandbox.create(broker_url=plain, environ=env))
    with pytest.raises(ConfigurationError, match="clear text"):
        run(
            AsyncSandbox.create(
                broker_url="http://sandbox-broker.example", environ=env, allow_insecure_http=True
            )
        )
    assert len(broker.claims(include_deleted=True)) == before


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_tls_is_verified(live: Any, broker: Any) -> None:
    env = broker.environ("kubernetes")
    del env["AGENT_SANDBOX_CA_BUNDLE"]
    with pytest.raises(BrokerTLSError, match="CA"):
        run(AsyncSandbox.list(environ=env))


def test_kill_after_close_connection_still_deletes(live: Any, dialect_broker: Any) -> None:
    broker = dialect_broker
    env = broker.environ("kubernetes")

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env) as sandbox:
            await sandbox.close_connection()
            with pytest.raises(SandboxNotFoundError, match="connect"):
                await sandbox.commands.run("true")

    run(main())
    assert live(broker) == []


@pytest.mark.usefixtures("dialect")  # once per dialect
@pytest.mark.dialect_feature(LIST, reason="upstream's list_active_sandboxes and the like")
@pytest.mark.upstream  # upstream usage, end to end
def test_code_written_for_the_upstream_async_client(live: Any, broker: Any) -> None:
    from k8s_agent_sandbox_awx import AsyncBrokerSandboxClient as AsyncSandboxClient

    config = BrokerConnectionConfig(api_url=broker.url + "/", ca_cert=broker.ca_bundle)
    auth = OIDCTokenAuth(broker.issue_gitlab_token("group/project"))

    async def main() -> None:
        async with AsyncSandboxClient(config, auth=auth) as client:
            sandbox = await client.create_sandbox(
                "python", namespace="default", sandbox_ready_timeout=60, labels={"app": "x"}
            )
            active = await client.list_active_sandboxes()
            assert active == [(sandbox.namespace, sandbox.claim_name)]
            assert sandbox.claim_name in await client.list_all_sandboxes()
            result = await sandbox.commands.run("echo hello", timeout=30)
            assert (result.stdout, result.exit_code) == ("hello\n", 0)
            await sandbox.files.write("a.txt", "text")
            assert await sandbox.files.read("a.txt") == b"text"
            assert await client.get_sandbox(sandbox.claim_name) is sandbox
            await client.delete_sandbox(sandbox.claim_name)
            await client.delete_sandbox(sandbox.claim_name)  # already gone
            with pytest.raises(SandboxNotFoundError):
                await client.get_sandbox(sandbox.claim_name)
            await asyncio.gather(*(client.create_sandbox("python") for _ in range(3)))
        assert client._transport.is_closed

    run(main())
    assert live(broker) == []  # the context manager deleted the rest


def test_quota_errors_leave_nothing_behind(live: Any, broker: Any, dialect: str) -> None:
    from k8s_agent_sandbox_awx import BrokerQuotaError

    env = broker.environ("kubernetes", namespace="team-q", service_account="agent")

    async def main() -> None:
        async with AsyncBrokerSandboxClient(environ=env) as client:
            await asyncio.gather(*(client.create_sandbox() for _ in range(5)))
            before = len(broker.claims(include_deleted=True))
            with pytest.raises(BrokerQuotaError) as quota:
                await client.create_sandbox()
            # /rpc errors are plain text: no code
            assert quota.value.code == ("quota_exceeded" if dialect == "v1" else None)
            assert len(broker.claims(include_deleted=True)) == before

    run(main())
    assert live(broker) == []


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_asyncio_timeout_around_create_deletes_the_claim(live: Any, broker: Any) -> None:
    """``asyncio.timeout()`` cancels the create; the claim is deleted and TimeoutError raised."""
    env = broker.environ("kubernetes")
    before = len(broker.claims(include_deleted=True))
    broker.set_readiness_delay(30)

    async def main() -> None:
        async with asyncio.timeout(1.0):
            await AsyncSandbox.create(environ=env, ready_timeout=60)

    with pytest.raises(TimeoutError):
        run(main())
    assert live(broker) == []
    assert len(broker.claims(include_deleted=True)) == before + 1
