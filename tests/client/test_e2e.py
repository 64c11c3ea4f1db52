"""End-to-end: the client against the local broker over real HTTPS on loopback."""

from __future__ import annotations

import hashlib
import io
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import (
    BrokerAuthenticationError,
    BrokerConnectionConfig,
    BrokerSandboxClient,
    BrokerTLSError,
    BrokerUnavailableError,
    BrokerWarmPoolNotFoundError,
    CommandTimeoutError,
    ConfigurationError,
    FileInfo,
    KubernetesAuth,
    OIDCTokenAuth,
    Sandbox,
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


@pytest.mark.parametrize("kind", ["kubernetes", "gitlab"])
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_readme_example_zero_arg(
    live: Any, broker: Any, use_env: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.delenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD")  # truly zero-config
    use_env(broker.environ(kind, namespace="team-a", service_account="agent"))

    sandbox = Sandbox.create()
    result = sandbox.commands.run('echo "Hello from Agent Sandbox!"')
    assert isinstance(result, ExecutionResult)
    assert (result.stdout, result.stderr, result.exit_code) == (
        "Hello from Agent Sandbox!\n",
        "",
        0,
    )
    [claim] = broker.claims()
    annotations = claim["metadata"]["annotations"]
    assert annotations[STAMP + "provider"] == kind
    expected = "system:serviceaccount:team-a:agent" if kind == "kubernetes" else "project_path:"
    assert annotations[STAMP + "subject"].startswith(expected)
    if LIST in sandbox.client.dialect.features:
        assert [i.name for i in Sandbox.list()] == [sandbox.name]
    sandbox.kill()
    sandbox.kill()  # idempotent
    assert live(broker) == []


def test_with_block_files_and_cleanup(live: Any, dialect_broker: Any, tmp_path: Path) -> None:
    broker = dialect_broker
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    auth = KubernetesAuth(env.pop("AGENT_SANDBOX_TOKEN_FILE"))
    local_in = tmp_path / "in.csv"
    local_in.write_bytes(b"a,b\n1,2\n" * 1000)
    with (
        pytest.raises(RuntimeError, match="user code failed"),
        Sandbox.create(template="python", labels={"team": "ml"}, auth=auth, environ=env) as sandbox,
    ):
        if sandbox.client.dialect.name == "v1":  # /rpc reports no labels
            assert sandbox.info.labels == {"team": "ml"}
        with open(local_in, "rb") as fh:
            sandbox.files.write("data/in.csv", fh)
        sandbox.files.write("data/note.txt", "héllo")
        assert sandbox.files.read("data/note.txt") == "héllo".encode()
        assert sandbox.files.exists("data/in.csv") and not sandbox.files.exists("nope")
        entries = sandbox.files.list("data")
        assert all(isinstance(e, FileInfo) for e in entries)
        assert sorted(e.name for e in entries) == ["in.csv", "note.txt"]
        assert sandbox.files.read_to("data/in.csv", tmp_path / "out.csv") == 8000
        assert (tmp_path / "out.csv").read_bytes() == local_in.read_bytes()
        with pytest.raises(SandboxError, match="does not exist"):
            sandbox.files.read("missing.bin")
        assert sandbox.commands.run("sh -c 'exit 3'").exit_code == 3
        with pytest.raises(CommandTimeoutError) as timeout:
            sandbox.commands.run("sleep 5", timeout=0.5)
        assert timeout.value.result is not None and timeout.value.result.timed_out
        raise RuntimeError("user code failed")
    assert live(broker) == []  # killed although the block raised


def test_token_file_rotation_between_two_commands(dialect_broker: Any, tmp_path: Path) -> None:
    broker = dialect_broker
    path = tmp_path / "tokens" / "agent-sandbox-token"
    env = broker.environ("kubernetes", token_file=path, namespace="team-a")
    old = path.read_text()
    with Sandbox.create(environ=env) as sandbox:
        assert sandbox.commands.run("echo one").stdout == "one\n"
        broker.write_projected_token(path, namespace="team-a")  # kubelet-style ..data swap
        broker.revoke_token(old)  # only a re-read token can work now
        assert path.read_text() != old
        assert sandbox.commands.run("echo two").stdout == "two\n"


def test_401_refreshes_the_credential_once(
    dialect_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    broker = dialect_broker
    caplog.set_level(logging.DEBUG)
    env = broker.environ("gitlab")
    tokens = [
        broker.issue_gitlab_token("group/project"),
        broker.issue_gitlab_token("group/project"),
    ]
    calls: list[str] = []

    def fetch() -> str:
        calls.append("x")
        return tokens[min(len(calls), 2) - 1]

    auth = OIDCTokenAuth(fetch)
    with Sandbox.create(auth=auth, environ=env) as sandbox:
        assert len(calls) == 1
        broker.revoke_token(tokens[0])
        assert sandbox.commands.run("echo ok").stdout == "ok\n"
        assert len(calls) == 2  # invalidated and fetched again after the 401
        broker.revoke_token(tokens[1])
        with pytest.raises(BrokerAuthenticationError) as info:
            sandbox.commands.run("echo never")
        assert info.value.status_code == 401 and info.value.code == "token_revoked"
        assert tokens[1] not in str(info.value) and tokens[0] not in str(info.value)
        fresh = OIDCTokenAuth(broker.issue_gitlab_token("group/project"))
        sandbox.client._transport.auth = fresh  # so that the exit can kill
    for token in tokens:
        for part in token.split(".")[1:]:
            assert part not in caplog.text  # no token (nor its signature) in any log record
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("k8s_agent_sandbox_awx")]
    assert ours and not any("Bearer" in m or "uthorization" in m for m in ours)


def test_retries_never_run_a_command_twice(dialect_broker: Any) -> None:
    broker = dialect_broker
    env = broker.environ("kubernetes")
    with Sandbox.create(environ=env) as sandbox:
        name = sandbox.sandbox_id  # the broker's sandbox (under /rpc the claim has its own name)
        broker.drop_connection_after_execute(1, sandbox=name)
        with pytest.raises(BrokerUnavailableError, match="not idempotent"):
            sandbox.commands.run("echo once")
        assert broker.execution_count(name) == 1
        broker.inject_unavailable(1, retry_after=0, scope="data", path="/commands", sandbox=name)
        with pytest.raises(BrokerUnavailableError):
            sandbox.commands.run("echo never")
        assert broker.execution_count(name) == 1
        # idempotent requests are retried through a 503 burst
        broker.inject_unavailable(2, retry_after=0, scope="data", sandbox=name)
        assert sandbox.files.exists("x") is False
        assert sandbox.commands.run("echo fine").stdout == "fine\n"
        assert broker.execution_count(name) == 2


@pytest.mark.usefixtures("dialect")  # once per dialect
@pytest.mark.dialect_feature(REPLAY_CREATE, reason="a create is retried with its key")
def test_create_is_retried_with_its_idempotency_key(broker: Any) -> None:
    env = broker.environ("kubernetes")
    before = len(broker.claims(include_deleted=True))
    broker.inject_unavailable(2, retry_after=0, scope="control", path="/v1/sandboxes")
    with Sandbox.create(environ=env):
        assert len(broker.claims(include_deleted=True)) == before + 1


def test_ready_timeout_deletes_the_claim(live: Any, dialect_broker: Any) -> None:
    broker = dialect_broker
    env = broker.environ("kubernetes")
    before = len(broker.claims(include_deleted=True))
    broker.set_readiness_delay(30)
    with pytest.raises(SandboxReadyTimeoutError) as info:
        Sandbox.create(environ=env, ready_timeout=1)
    assert info.value.phase == "Pending"
    assert live(broker) == []
    assert len(broker.claims(include_deleted=True)) == before + 1


def test_connect_and_errors(live: Any, broker: Any, dialect: str) -> None:
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    with Sandbox.create(environ=env) as sandbox:
        again = Sandbox.connect(sandbox.name, environ=env)
        assert again.commands.run("echo hi").stdout == "hi\n"
        again.close_connection()
        other = broker.environ("kubernetes", namespace="team-b", service_account="intruder")
        # another namespace's sandbox is not disclosed (404) by either dialect (issue 23: /rpc
        # answered 403 on the local backend); the same namespace's: tests/broker/test_rpc.py
        with pytest.raises(SandboxNotFoundError):
            Sandbox.connect(sandbox.name, environ=other)
    # /rpc: template= names the warm pool, which does not exist
    missing = SandboxTemplateNotFoundError if dialect == "v1" else BrokerWarmPoolNotFoundError
    with pytest.raises(missing):
        Sandbox.create(template="no-such-template", environ=env)
    assert live(broker) == []


def test_api_url_pointing_elsewhere_is_rejected(broker: Any) -> None:
    env = broker.environ("kubernetes")
    before = len(broker.claims(include_deleted=True))
    config = None
    with pytest.raises(ConfigurationError, match="bypass the broker"):
        config = BrokerConnectionConfig(broker_url=broker.url, api_url="https://127.0.0.1:1")
    assert config is None
    with pytest.raises(ConfigurationError, match="bypass the broker"):
        BrokerSandboxClient(environ=env, api_url="https://127.0.0.1:1/")
    assert len(broker.claims(include_deleted=True)) == before


def test_http_broker_url_is_rejected(broker: Any) -> None:
    env = broker.environ("kubernetes")
    before = len(broker.claims(include_deleted=True))
    plain = broker.url.replace("https://", "http://")
    with pytest.raises(ConfigurationError, match="http://"):
        Sandbox.create(broker_url=plain, environ=env)
    with pytest.raises(ConfigurationError, match="clear text"):
        Sandbox.create(
            broker_url="http://sandbox-broker.example", environ=env, allow_insecure_http=True
        )
    assert len(broker.claims(include_deleted=True)) == before


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_tls_is_verified(broker: Any) -> None:
    env = broker.environ("kubernetes")
    del env["AGENT_SANDBOX_CA_BUNDLE"]
    with pytest.raises(BrokerTLSError, match="CA"):
        Sandbox.list(environ=env)


def test_streamed_write_of_a_generated_stream(dialect_broker: Any) -> None:
    broker = dialect_broker

    class Generated(io.RawIOBase):
        """A non-seekable 8 MiB stream."""

        def __init__(self) -> None:
            self.left = 8 * 1024 * 1024

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            n = self.left if n < 0 else min(n, self.left)
            self.left -= n
            return b"z" * n

    env = broker.environ("kubernetes")
    with Sandbox.create(environ=env) as sandbox:
        sandbox.files.write("big/z.bin", Generated())  # type: ignore[arg-type]
        digest = hashlib.sha256()

        class Sink:
            def write(self, data: bytes) -> int:
                digest.update(data)
                return len(data)

        assert sandbox.files.read_to("big/z.bin", Sink()) == 8 * 1024 * 1024
        assert digest.hexdigest() == hashlib.sha256(b"z" * 8 * 1024 * 1024).hexdigest()
    assert os.environ.get("AGENT_SANDBOX_TOKEN") is None


def test_one_sandbox_from_many_threads(dialect_broker: Any) -> None:
    broker = dialect_broker
    from concurrent.futures import ThreadPoolExecutor

    env = broker.environ("kubernetes")
    with Sandbox.create(environ=env) as sandbox:

        def work(i: int) -> tuple[str, bytes]:
            sandbox.files.write(f"t/{i}.txt", str(i).encode() * 1000)
            out = sandbox.commands.run(f"echo {i}").stdout
            return out, sandbox.files.read(f"t/{i}.txt")

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(work, range(32)))
        assert results == [(f"{i}\n", str(i).encode() * 1000) for i in range(32)]
        assert broker.execution_count(sandbox.sandbox_id) == 32


def test_kill_after_close_connection_still_deletes(live: Any, dialect_broker: Any) -> None:
    broker = dialect_broker
    env = broker.environ("kubernetes")
    with Sandbox.create(environ=env) as sandbox:
        sandbox.close_connection()
        with pytest.raises(SandboxNotFoundError, match="connect"):
            sandbox.commands.run("true")
    assert live(broker) == []


def test_seekable_upload_sends_exactly_the_declared_size(
    dialect_broker: Any, tmp_path: Path
) -> None:
    broker = dialect_broker
    env = broker.environ("kubernetes")
    path = tmp_path / "f.bin"
    path.write_bytes(b"0123456789" * 100_000)
    with Sandbox.create(environ=env) as sandbox, open(path, "rb") as fh:
        fh.seek(5)
        sandbox.files.write("f.bin", fh)
        assert sandbox.files.read("f.bin") == path.read_bytes()[5:]


@pytest.mark.usefixtures("dialect")  # once per dialect
@pytest.mark.dialect_feature(LIST, reason="upstream's list_active_sandboxes and the like")
@pytest.mark.upstream  # upstream SandboxClient usage, end to end
def test_code_written_for_the_upstream_client(live: Any, broker: Any) -> None:
    """Upstream SandboxClient usage, with only the import and the config changed."""
    from k8s_agent_sandbox_awx import BrokerSandboxClient as SandboxClient

    config = BrokerConnectionConfig(api_url=broker.url + "/", ca_cert=broker.ca_bundle)
    auth = OIDCTokenAuth(broker.issue_gitlab_token("group/project"))
    with SandboxClient(config, auth=auth) as client:
        sandbox = client.create_sandbox(
            "python", namespace="default", sandbox_ready_timeout=60, labels={"app": "x"}
        )
        assert client.list_active_sandboxes() == [(sandbox.namespace, sandbox.claim_name)]
        assert sandbox.claim_name in client.list_all_sandboxes()
        result = sandbox.commands.run("echo hello", timeout=30)
        assert (result.stdout, result.exit_code) == ("hello\n", 0)
        sandbox.files.write("a.txt", "text")
        assert sandbox.files.read("a.txt") == b"text"
        assert [e.name for e in sandbox.files.list(".")] == ["a.txt"]
        assert sandbox.status()[0] == "SandboxReady"
        same = client.get_sandbox(sandbox.claim_name)
        assert same is sandbox
        client.delete_sandbox(sandbox.claim_name)
        client.delete_sandbox(sandbox.claim_name)  # already gone
        with pytest.raises(SandboxNotFoundError):
            client.get_sandbox(sandbox.claim_name)
        client.create_sandbox("python")
    assert live(broker) == []  # the context manager deleted the rest


def test_quota_and_permission_errors_are_typed(broker: Any, dialect: str) -> None:
    from k8s_agent_sandbox_awx import BrokerPermissionError, BrokerQuotaError

    env = broker.environ("kubernetes", namespace="team-q", service_account="agent")
    with BrokerSandboxClient(environ=env) as client:
        made = [client.create_sandbox() for _ in range(5)]  # the default policy's max_sandboxes
        before = len(broker.claims(include_deleted=True))
        with pytest.raises(BrokerQuotaError) as quota:
            client.create_sandbox()
        # /rpc errors are plain text: no code
        assert quota.value.code == ("quota_exceeded" if dialect == "v1" else None)
        assert "kill" in str(quota.value)
        assert len(broker.claims(include_deleted=True)) == before  # nothing left behind
        mine = made[0].name
        other = broker.environ("kubernetes", namespace="team-q", service_account="intruder")
        with BrokerSandboxClient(environ=other) as intruder:
            handle = Sandbox(intruder, client.get_info(mine))
            with pytest.raises(BrokerPermissionError) as denied:
                handle.commands.run("echo stolen")
            assert denied.value.code == "not_owner"
            handle._killed = True
        assert broker.execution_count(mine) == 0


def test_cleanup_true_deletes_at_exit(live: Any, broker: Any, dialect: str) -> None:
    import subprocess
    import sys

    env = {**os.environ, **broker.environ("kubernetes")}
    code = (
        "from k8s_agent_sandbox_awx import BrokerSandboxClient\n"
        "c = BrokerSandboxClient(cleanup=True)\n"
        "print(c.create_sandbox().name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip().startswith("sbx-" if dialect == "v1" else "broker-")  # a claim
    assert live(broker) == []


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_iter_bytes_streams_a_file(broker: Any) -> None:
    import contextlib

    env = broker.environ("kubernetes")
    data = os.urandom(2 * 1024 * 1024 + 5)
    with Sandbox.create(environ=env) as sandbox:
        sandbox.files.write("blob.bin", data)
        chunks = list(sandbox.files.iter_bytes("blob.bin"))
        assert b"".join(chunks) == data and max(map(len, chunks)) <= 1024 * 1024
        with contextlib.closing(sandbox.files.iter_bytes("blob.bin")) as it:
            assert next(it) == data[: 1024 * 1024]
        with pytest.raises(SandboxError, match="max_bytes"):
            list(sandbox.files.iter_bytes("blob.bin", max_bytes=100))
        assert sandbox.commands.run("echo still fine").stdout == "still fine\n"


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_truncated_command_output_is_flagged(broker: Any, use_env: Any) -> None:
    """The runtime keeps the first 1 MiB of each stream (its status says it cut the rest); a
    followed command's result has everything, streamed live."""
    use_env(broker.environ("kubernetes"))
    with Sandbox.create() as sandbox:
        big = sandbox.commands.run("head -c 3000000 /dev/zero")
        small = sandbox.commands.run("echo hi")
        assert big.command_id is not None
        retained = sandbox.commands.get(big.command_id).status()
    assert isinstance(big, ExecutionResult)
    assert (len(big.stdout), big.exit_code, big.output_truncated) == (3000000, 0, False)
    # whole output events are kept up to the cap: at most 1 MiB, less at most one pipe read
    assert 1024 * 1024 - 64 * 1024 <= len(retained.stdout or "") <= 1024 * 1024
    assert retained.output_truncated is True
    assert (small.stdout, small.output_truncated) == ("hi\n", False)
