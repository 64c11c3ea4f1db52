"""The client's end-to-end suite once more, through the Kubernetes-backed broker.

The test functions below ARE the client tests (tests/client/test_*.py: imported, not copied):
their ``broker`` and ``files_broker`` fixtures are, in this module, ``broker serve`` replicas over
the Kubernetes backend on the session's real API server, with the stand-in agent-sandbox
controller's pods (tests/_support/kube_suite.py), in both dialects as the client tests run
them (a test that requests ``dialect`` runs once per dialect; the rest under v1). The subset:
commands (run, shell rules, callbacks, timeouts, interrupts, background, stdin, reattach,
limits, the CLI), streams (NDJSON events sync and async, long outputs, 1 MiB truncation),
files (every operation, streamed writes and reads, large reads through the download route,
watches), lifetime (timeouts and the policy cap, set_timeout shortening to an expiry,
keepalive) and the SDK's control plane (zero-argument create, connect, list, kill, cleanup at
exit, cancellations, quotas), sync and async. Left out: the tests that need what only a local
broker has (fault injection, execution counts, token revocation, GitLab tokens, old runtimes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx import (
    AsyncSandbox,
    BrokerError,
    BrokerPermissionError,
    BrokerWarmPoolNotFoundError,
    Sandbox,
)
from k8s_agent_sandbox_awx._upstream import SandboxNotFoundError, SandboxTemplateNotFoundError
from k8s_agent_sandbox_awx.errors import SandboxFileLimitError
from tests._support import _pod_containers, brokers, programs
from tests._support.kube import KubeAPIServer
from tests._support.kube_suite import KubeSuite, kube_suite

# the reused tests, by their own names (the async ones prefixed)
from tests.client import test_async_commands as async_commands
from tests.client import test_async_e2e as async_e2e
from tests.client import test_async_files_api as async_files
from tests.client import test_commands as commands
from tests.client import test_e2e as e2e
from tests.client import test_files_api as files
from tests.client import test_lifetime_client as lifetime
from tests.client import test_streams as streams
from tests.client.test_commands import sandbox  # noqa: F401  (the commands tests' fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def suite(kube: KubeAPIServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeSuite]:
    with kube_suite(kube, tmp_path_factory.mktemp("client-suite")) as made:
        yield made


@pytest.fixture(name="process_gone")
def _process_gone(suite: KubeSuite) -> Callable[..., bool]:
    """``process_gone(pid, within=10.0)`` for a command's pid: the pods are real containers,
    and a pid a command reports is its container's (its PID namespace), not this host's."""
    if suite.pod_spec is None:
        return programs.process_gone  # host-process pods (no image): the host's pids
    containers = suite.controller.kubelet.containers

    def gone(pid: int, within: float = 10.0) -> bool:
        deadline = time.monotonic() + within
        while _pod_containers.alive_in(containers(), pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    return gone


@pytest.fixture
def broker(
    suite: KubeSuite, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """The ``default`` policy's replica for the test's dialect, reset, with a clean
    credential environment (as tests/conftest.py's ``broker``)."""
    yield from brokers.clean_use(suite.broker("default", brokers.dialect_of(request)), monkeypatch)


@pytest.fixture
def files_broker(
    suite: KubeSuite, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """The ``files`` policy's replica (lifetimes capped at 120 s) for the test's dialect."""
    yield from brokers.clean_use(suite.broker("files", brokers.dialect_of(request)), monkeypatch)


# ------------------------------------------------------------------------------ control plane


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_readme_example_zero_arg(
    live: Any, broker: Any, use_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    e2e.test_readme_example_zero_arg(live, broker, use_env, monkeypatch, "kubernetes")


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_async_readme_example_zero_arg(
    live: Any, broker: Any, use_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async_e2e.test_readme_example_zero_arg(live, broker, use_env, monkeypatch, "kubernetes")


test_with_block_files_and_cleanup = e2e.test_with_block_files_and_cleanup
test_tls_is_verified = e2e.test_tls_is_verified
test_kill_after_close_connection_still_deletes = e2e.test_kill_after_close_connection_still_deletes
test_cleanup_true_deletes_at_exit = e2e.test_cleanup_true_deletes_at_exit
test_async_with_files_streamed_and_cleanup = async_e2e.test_async_with_files_streamed_and_cleanup
test_async_cancelled_with_block_kills = async_e2e.test_cancelled_async_with_block_kills_the_sandbox
test_async_kill_after_close_connection = async_e2e.test_kill_after_close_connection_still_deletes
test_async_quota_errors_leave_nothing_behind = async_e2e.test_quota_errors_leave_nothing_behind


def test_connect_and_errors(live: Any, broker: Any, dialect: str) -> None:
    """tests/client's ``test_connect_and_errors`` (sync, then async), with another identity of
    the same namespace too: the claims of a caller whose policy puts them in another namespace
    are not found (404 in both dialects, as on the local backend since issue 23), and another
    identity of the same namespace is refused (v1 404, ``/rpc`` 403, as deployed brokers)."""
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    elsewhere = broker.environ("kubernetes", namespace="team-b", service_account="intruder")
    beside = broker.environ("kubernetes", namespace="team-a", service_account="intruder")
    refused = SandboxNotFoundError if dialect == "v1" else BrokerPermissionError
    missing = SandboxTemplateNotFoundError if dialect == "v1" else BrokerWarmPoolNotFoundError
    absent = "no-such-template" if dialect == "v1" else "orphan"  # a pool the policy allows
    with Sandbox.create(environ=env) as made:
        again = Sandbox.connect(made.name, environ=env)
        assert again.commands.run("echo hi").stdout == "hi\n"
        again.close_connection()
        with pytest.raises(SandboxNotFoundError):
            Sandbox.connect(made.name, environ=elsewhere)
        with pytest.raises(refused):
            Sandbox.connect(made.name, environ=beside)
    with pytest.raises(missing):
        Sandbox.create(template=absent, environ=env)

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env) as made:
            again = await AsyncSandbox.connect(made.name, environ=env)
            assert (await again.commands.run("echo hi")).stdout == "hi\n"
            assert (await again.status())[0] == "SandboxReady"
            await again.close_connection()
            with pytest.raises(SandboxNotFoundError):
                await AsyncSandbox.connect(made.name, environ=elsewhere)
            with pytest.raises(refused):
                await AsyncSandbox.connect(made.name, environ=beside)
        with pytest.raises(missing):
            await AsyncSandbox.create(template=absent, environ=env)

    asyncio.run(main())
    assert live(broker) == []


# ------------------------------------------------------------------------------ commands

test_a_string_runs_through_bash = commands.test_a_string_runs_through_bash_and_a_list_is_an_argv
test_envs_and_cwd = commands.test_envs_merge_over_the_sandbox_environment_and_cwd_applies
test_result_carries = commands.test_result_carries_the_command_id_state_and_a_non_zero_exit
test_callbacks_get_the_output = commands.test_callbacks_get_the_output_while_the_command_runs
test_any_text_arrives_byte_for_byte = commands.test_any_text_arrives_byte_for_byte
test_a_command_over_its_time_limit = commands.test_a_command_over_its_time_limit_is_killed
test_an_interrupted_run_kills = commands.test_an_interrupted_foreground_run_kills_the_process_group
test_a_background_server = commands.test_a_background_server_is_waited_on_and_killed
test_stdin_and_iteration = commands.test_stdin_and_iteration
test_wait_callbacks_and_reattach = commands.test_wait_callbacks_and_reattach_replays_the_output
test_reattach_from_another_process = commands.test_reattach_from_another_process
test_the_running_limit = commands.test_the_running_limit_is_a_clear_error
test_sequential_runs_reuse_one_connection = commands.test_sequential_runs_reuse_one_connection
test_cli_run_streams = commands.test_cli_run_streams_and_exits_with_the_command_code
test_async_coroutine_callbacks = (
    async_commands.test_coroutine_callbacks_get_live_output_and_the_result_is_collected
)
test_async_cancelling_a_run_kills = (
    async_commands.test_cancelling_a_foreground_run_kills_the_process_group
)
test_async_background_wait_kill_stdin = (
    async_commands.test_background_wait_kill_stdin_iteration_and_reattach
)


# ------------------------------------------------------------------------------ streams

test_events_stream_sync_and_async = (
    streams.test_events_stream_through_the_local_broker_sync_and_async
)
test_truncated_command_output_is_flagged = e2e.test_truncated_command_output_is_flagged

# ------------------------------------------------------------------------------ files

test_every_file_operation = files.test_every_file_operation
test_runtime_refusals_are_typed_errors = files.test_runtime_refusals_are_typed_errors
test_watch_dir_sees_a_file = files.test_watch_dir_sees_a_file_created_by_a_command
test_remove_recursive_of_a_deep_tree = (
    files.test_remove_recursive_of_a_tree_deeper_than_the_recursion_limit
)
test_streamed_write_of_a_generated_stream = e2e.test_streamed_write_of_a_generated_stream
test_seekable_upload = e2e.test_seekable_upload_sends_exactly_the_declared_size
test_iter_bytes_streams_a_file = e2e.test_iter_bytes_streams_a_file
test_async_every_file_operation = async_files.test_every_file_operation
test_async_watch_dir_sees_a_file = async_files.test_watch_dir_sees_a_file_created_by_a_command

# ------------------------------------------------------------------------------ lifetime

test_timeout_default_and_policy_cap = lifetime.test_timeout_default_environment_and_policy_cap
test_set_timeout_shortening = (
    lifetime.test_set_timeout_shortening_makes_the_broker_delete_it_on_time
)
test_keepalive_never_fails_the_operation = lifetime.test_keepalive_never_fails_the_operation
test_async_lifetime_set_timeout_and_keepalive = async_files.test_lifetime_set_timeout_and_keepalive


# ------------------------------------------------------------------ the runtime's settings
# A create's env is the environment of the sandbox's commands. On a local broker it may also
# set the built-in runtime's own settings (its limits: the local tests above that raise them do
# so); on Kubernetes they are the template's container env, never a create's (issue 26.2,
# issue 28.2; docs/broker/kubernetes.md): here with the template ``tuned`` (kube_suite.TUNED).


def test_the_runtime_settings_are_the_templates(broker: Any) -> None:
    env = broker.environ("kubernetes")
    with Sandbox.create(template="tuned", environ=env) as tuned:
        handles = [tuned.commands.run("sleep 60", background=True) for _ in range(17)]
        assert len([c for c in tuned.commands.list() if c.state == "running"]) == 17
        for handle in handles:
            handle.kill()
    settings = {"SANDBOX_COMMAND_MAX_RUNNING": "64", "SANDBOX_FS_READ_MAX_BYTES": "1000"}
    with Sandbox.create(environ=env, env=settings) as plain:
        seen = plain.commands.run("echo $SANDBOX_COMMAND_MAX_RUNNING $SANDBOX_FS_READ_MAX_BYTES")
        assert seen.stdout == "64 1000\n"  # the commands' environment
        handles = [plain.commands.run("sleep 60", background=True) for _ in range(16)]
        with pytest.raises(BrokerError, match=r"429.*16"):  # not the runtime's
            plain.commands.run("true")
        for handle in handles:
            handle.kill()


def test_a_file_over_the_templates_read_limit(files_broker: Any) -> None:
    data = bytes(range(256)) * 20
    for template, limited in (("tuned", True), ("python", False)):
        env = {} if limited else {"SANDBOX_FS_READ_MAX_BYTES": "1000"}  # not the runtime's
        with files._sandbox(files_broker, template=template, env=env) as sb:
            sb.files.write("/workspace/big.bin", data)
            if limited:
                with pytest.raises(SandboxFileLimitError, match="SANDBOX_FS_READ_MAX_BYTES"):
                    sb.files.read("/workspace/big.bin")
            else:
                assert sb.files.read("/workspace/big.bin") == data
