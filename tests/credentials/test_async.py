"""The async path: ``await source.aget_credential(audience)`` for every source, the single-flight
cache under many tasks (and shared with threads), sync and async plugin hooks."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx import (
    AudienceMismatchError,
    Credential,
    CredentialPluginWarning,
    CredentialRequest,
    CredentialSource,
    CredentialSourceError,
    DefaultCredentials,
    EmptyCredentialError,
    KubernetesAuth,
    NoCredentialsError,
    OIDCTokenAuth,
    TokenExpiredError,
    UnreadableCredentialError,
    explain,
    hookimpl,
)

BROKER = "https://sandbox-broker.example"
OTHER = "https://other-service.example"


def chain(env: dict[str, str], token_path: str, plugins=None) -> DefaultCredentials:
    return DefaultCredentials(
        {"AGENT_SANDBOX_LOAD_PLUGINS": "", **env}, _token_path=token_path, _plugins=plugins or []
    )


class Counter:
    """Counts calls and remembers the threads they ran on (thread-safe)."""

    def __init__(self) -> None:
        self.calls = 0
        self.threads: set[int] = set()
        self.lock = threading.Lock()

    def hit(self) -> None:
        with self.lock:
            self.calls += 1
            self.threads.add(threading.get_ident())


class AsyncPlugin(Counter):
    """A third-party provider with only the async hook."""

    def __init__(self, variable: str, delay: float = 0.0) -> None:
        super().__init__()
        self.variable, self.delay = variable, delay

    @hookimpl
    async def agent_sandbox_get_credential_async(
        self, request: CredentialRequest
    ) -> Credential | None:
        self.hit()
        await asyncio.sleep(self.delay)
        value = request.environ.get(self.variable)
        if value is None:
            return request.not_here(f"{self.variable} is not set")
        if value == "BROKEN":
            raise EmptyCredentialError(f"{self.variable} is broken", provider="async-plugin")
        return Credential(value, "", source=f"async {self.variable}")


class SyncPlugin(Counter):
    """A third-party provider with only the sync hook; its fetch blocks (like an HTTP call)."""

    def __init__(self, variable: str, delay: float = 0.0) -> None:
        super().__init__()
        self.variable, self.delay = variable, delay

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential | None:
        self.hit()
        time.sleep(self.delay)
        value = request.environ.get(self.variable)
        if value is None:
            return request.not_here(f"{self.variable} is not set")
        return Credential(value, "", source=f"sync {self.variable}")


class BothHooks:
    def __init__(self, token: str) -> None:
        self.token = token
        self.used: list[str] = []

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential | None:
        self.used.append("sync")
        return Credential(self.token, "", source="both")

    @hookimpl
    async def agent_sandbox_get_credential_async(
        self, request: CredentialRequest
    ) -> Credential | None:
        self.used.append("async")
        return Credential(self.token, "", source="both")


async def ticking_while(awaitable: Awaitable[object]) -> tuple[object, int]:
    """Await ``awaitable`` while another task ticks every 10 ms; return (result, ticks)."""
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        result = await awaitable
    finally:
        stop.set()
        await task
    return result, ticks


# --- every source ------------------------------------------------------------------------


def test_every_source_is_an_async_credential_source(tmp_path: Path, mint) -> None:
    (tmp_path / "t").write_text(mint())
    for source in (
        KubernetesAuth(tmp_path / "t"),
        OIDCTokenAuth(mint()),
        OIDCTokenAuth(lambda: "x"),
        OIDCTokenAuth.from_env("X"),
        DefaultCredentials({}),
    ):
        assert isinstance(source, CredentialSource)
        assert asyncio.iscoroutinefunction(source.aget_credential)


@pytest.mark.asyncio
async def test_kubernetes_auth_async_rereads_the_file(tmp_path: Path, mint, projected) -> None:
    first, second = mint(sub="first"), mint(sub="second")
    auth = KubernetesAuth(projected(tmp_path, first, 1))
    cred = await auth.aget_credential(BROKER)
    assert (cred.token, cred.file_backed, cred.provider) == (first, True, "KubernetesAuth")
    projected(tmp_path, second, 2)  # the kubelet's atomic ..data swap
    assert (await auth.aget_credential(BROKER)).token == second
    with pytest.raises(AudienceMismatchError):
        await auth.aget_credential(OTHER)


@pytest.mark.asyncio
async def test_kubernetes_auth_async_errors(tmp_path: Path, mint, clock) -> None:
    with pytest.raises(UnreadableCredentialError, match="does not exist"):
        await KubernetesAuth(tmp_path / "missing").aget_credential(BROKER)
    (tmp_path / "t").write_text(mint(ttl=60))
    clock.advance(120)  # past exp and the allowed clock skew
    with pytest.raises(TokenExpiredError):
        await KubernetesAuth(tmp_path / "t").aget_credential(BROKER)


@pytest.mark.asyncio
async def test_oidc_static_string_async(mint, clock) -> None:
    token = mint(ttl=60)
    auth = OIDCTokenAuth(token)
    assert (await auth.aget_credential(BROKER)).token == token
    with pytest.raises(AudienceMismatchError):
        await auth.aget_credential(OTHER)
    clock.advance(120)  # past exp and the allowed clock skew
    with pytest.raises(TokenExpiredError):
        await auth.aget_credential(BROKER)


@pytest.mark.asyncio
async def test_oidc_sync_callable_runs_in_a_worker_thread_and_is_cached(mint) -> None:
    counter = Counter()

    def fetch(audience: str) -> str:
        counter.hit()
        return mint(aud=audience)

    auth = OIDCTokenAuth(fetch)
    tokens = {(await auth.aget_credential(BROKER)).token for _ in range(5)}
    assert len(tokens) == 1 and counter.calls == 1
    assert threading.get_ident() not in counter.threads  # not on the event loop's thread


def test_a_hung_sync_callable_never_holds_up_the_end_of_asyncio_run(mint) -> None:
    """The sync callable runs in a daemon helper thread, not in the loop's default executor,
    whose shutdown ``asyncio.run`` would wait for: a cancelled request lets the program end."""
    started, release = threading.Event(), threading.Event()

    def fetch() -> str:
        started.set()
        release.wait(30)  # a token endpoint that never answers
        return mint()

    auth = OIDCTokenAuth(fetch)

    async def main() -> None:
        task = asyncio.create_task(auth.aget_credential(BROKER))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    runner = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    runner.start()
    runner.join(10)
    ended = not runner.is_alive()
    release.set()
    assert ended  # asyncio.run returned while the fetch was still hung


@pytest.mark.asyncio
async def test_oidc_async_callable_with_and_without_audience(mint) -> None:
    counter = Counter()

    async def fetch_for(audience: str) -> str:
        counter.hit()
        await asyncio.sleep(0)
        return mint(aud=audience)

    async def fetch() -> str:
        counter.hit()
        return mint()

    class Fetcher:
        async def __call__(self) -> str:
            counter.hit()
            return mint()

    for function in (fetch_for, fetch, Fetcher()):
        auth = OIDCTokenAuth(function)
        assert (await auth.aget_credential(BROKER)).provider == "OIDCTokenAuth"
        await auth.aget_credential(BROKER)  # cached
    assert counter.calls == 3
    assert counter.threads == {threading.get_ident()}  # awaited on the running loop


@pytest.mark.asyncio
async def test_oidc_awaitable_returning_callable(mint) -> None:
    token = mint()

    async def produce() -> str:
        return token

    auth = OIDCTokenAuth(lambda: produce())
    assert (await auth.aget_credential(BROKER)).token == token
    assert OIDCTokenAuth(lambda: produce()).get_credential(BROKER).token == token


def test_async_callable_on_the_sync_path(mint) -> None:
    token = mint()

    async def fetch() -> str:
        await asyncio.sleep(0)
        return token

    assert OIDCTokenAuth(fetch).get_credential(BROKER).token == token


@pytest.mark.asyncio
async def test_async_callable_on_the_sync_path_inside_a_running_loop(mint) -> None:
    """The sync API called from async code (a misuse, but it must not fail or deadlock)."""
    token = mint()

    async def fetch() -> str:
        return token

    assert OIDCTokenAuth(fetch).get_credential(BROKER).token == token


@pytest.mark.asyncio
async def test_oidc_async_callable_failures(mint, no_secret) -> None:
    token = mint()

    async def leaky() -> str:
        raise OSError(f"denied for {token}")

    async def nothing() -> None:
        return None

    with pytest.raises(CredentialSourceError, match="OSError") as caught:
        await OIDCTokenAuth(leaky).aget_credential(BROKER)
    no_secret(token, str(caught.value), repr(caught.value.args))
    assert caught.value.__cause__ is None
    with pytest.raises(NoCredentialsError, match="returned None"):
        await OIDCTokenAuth(nothing).aget_credential(BROKER)
    with pytest.raises(CredentialSourceError, match="returned int"):
        await OIDCTokenAuth(lambda: 42).aget_credential(BROKER)


@pytest.mark.asyncio
async def test_oidc_from_env_async(mint) -> None:
    token = mint()
    env = {"MY_ID_TOKEN": token}
    auth = OIDCTokenAuth.from_env("MY_ID_TOKEN", environ=env)
    assert (await auth.aget_credential(BROKER)).token == token
    env["MY_ID_TOKEN"] = mint(sub="next")
    assert (await auth.aget_credential(BROKER)).token == token  # cached
    auth.invalidate(BROKER)  # sync, non-blocking: called directly from async code
    assert (await auth.aget_credential(BROKER)).token == env["MY_ID_TOKEN"]
    with pytest.raises(NoCredentialsError, match="UNSET_VARIABLE is not set"):
        await OIDCTokenAuth.from_env("UNSET_VARIABLE", environ={}).aget_credential(BROKER)
    with pytest.raises(EmptyCredentialError):
        await OIDCTokenAuth.from_env("E", environ={"E": " "}).aget_credential(BROKER)


@pytest.mark.asyncio
async def test_default_credentials_async_for_each_builtin(tmp_path: Path, mint, missing_path):
    env_token, file_token, projected_token = mint(sub="env"), mint(sub="file"), mint(sub="proj")
    (tmp_path / "file").write_text(file_token)
    (tmp_path / "proj").write_text(projected_token)
    cases = [
        ({"AGENT_SANDBOX_TOKEN": env_token}, missing_path, env_token, "agent-sandbox-token"),
        (
            {"AGENT_SANDBOX_TOKEN_FILE": str(tmp_path / "file")},
            missing_path,
            file_token,
            "agent-sandbox-token-file",
        ),
        ({}, str(tmp_path / "proj"), projected_token, "kubernetes-projected"),
    ]
    for env, path, token, provider in cases:
        creds = chain(env, path)
        for _ in range(2):  # discovery, then the per-request path
            cred = await creds.aget_credential(BROKER)
            assert (cred.token, cred.provider) == (token, provider)
    with pytest.raises(NoCredentialsError) as caught:
        await chain({}, missing_path).aget_credential(BROKER)
    assert "agent-sandbox-token: AGENT_SANDBOX_TOKEN is not set" in str(caught.value)
    with pytest.raises(EmptyCredentialError):  # here but broken stops the chain
        await chain({"AGENT_SANDBOX_TOKEN": ""}, str(tmp_path / "proj")).aget_credential(BROKER)


@pytest.mark.asyncio
async def test_default_credentials_async_on_os_environ(monkeypatch: pytest.MonkeyPatch, mint):
    token = mint()
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", token)
    monkeypatch.setenv("AGENT_SANDBOX_LOAD_PLUGINS", "")
    assert (await DefaultCredentials().aget_credential(BROKER)).token == token


@pytest.mark.asyncio
async def test_selected_file_provider_that_disappears_async(tmp_path: Path, mint) -> None:
    path = tmp_path / "file"
    path.write_text(mint())
    creds = chain({}, str(path))
    await creds.aget_credential(BROKER)
    path.unlink()
    with pytest.raises(CredentialSourceError, match="no longer applies"):
        await creds.aget_credential(BROKER)


@pytest.mark.asyncio
async def test_selected_file_provider_is_read_and_checked_at_every_request_async(
    tmp_path: Path, mint, clock
) -> None:
    path = tmp_path / "file"
    path.write_text(mint(sub="first"))
    creds = chain({"AGENT_SANDBOX_TOKEN_FILE": str(path)}, str(tmp_path / "proj"))
    first = await creds.aget_credential(BROKER)
    path.write_text(mint(sub="second"))
    second = await creds.aget_credential(BROKER)
    assert first.token != second.token == creds.get_credential(BROKER).token
    assert second.file_backed and second.provider == "agent-sandbox-token-file"
    path.write_text(mint(aud=OTHER))
    with pytest.raises(AudienceMismatchError):
        await creds.aget_credential(BROKER)
    path.write_text(mint(now=0, ttl=1))
    with pytest.raises(TokenExpiredError):
        await creds.aget_credential(BROKER)


# --- plugins -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_plugin_is_awaited_on_the_loop(mint, missing_path) -> None:
    token = mint()
    plugin = AsyncPlugin("A")
    creds = chain({"A": token}, missing_path, [("async-plugin", plugin)])
    cred = await creds.aget_credential(BROKER)
    assert (cred.token, cred.provider, cred.source) == (token, "async-plugin", "async A")
    assert plugin.threads == {threading.get_ident()}


@pytest.mark.asyncio
async def test_sync_plugin_does_not_block_the_loop(mint, missing_path) -> None:
    token = mint()
    plugin = SyncPlugin("S", delay=0.2)
    creds = chain({"S": token}, missing_path, [("sync-plugin", plugin)])
    cred, ticks = await ticking_while(creds.aget_credential(BROKER))
    assert isinstance(cred, Credential) and cred.token == token
    assert ticks >= 3  # the loop kept running while the blocking fetch slept in a thread
    assert threading.get_ident() not in plugin.threads


def test_async_only_plugin_on_the_sync_path_and_in_explain(mint, missing_path) -> None:
    token = mint()
    plugin = AsyncPlugin("A")
    creds = chain({"A": token}, missing_path, [("async-plugin", plugin)])
    assert creds.get_credential(BROKER).token == token
    assert threading.get_ident() not in plugin.threads  # ran on a helper thread's loop
    result = explain(BROKER, auth=creds)
    assert result.selected == "async-plugin"


@pytest.mark.asyncio
async def test_async_only_plugin_on_the_sync_path_inside_a_running_loop(mint, missing_path):
    token = mint()
    creds = chain({"A": token}, missing_path, [("async-plugin", AsyncPlugin("A"))])
    assert creds.get_credential(BROKER).token == token


@pytest.mark.asyncio
async def test_plugin_with_both_hooks_each_path_uses_its_own(mint, missing_path) -> None:
    plugin = BothHooks(mint())
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": ""}
    await chain(env, missing_path, [("both", plugin)]).aget_credential(BROKER)
    chain(env, missing_path, [("both", plugin)]).get_credential(BROKER)
    assert plugin.used == ["async", "sync"]


@pytest.mark.asyncio
async def test_async_plugin_not_here_and_broken(mint, missing_path) -> None:
    with pytest.raises(NoCredentialsError, match="async-plugin: A is not set"):
        await chain({}, missing_path, [("async-plugin", AsyncPlugin("A"))]).aget_credential(BROKER)
    creds = chain({"A": "BROKEN"}, missing_path, [("async-plugin", AsyncPlugin("A"))])
    with pytest.raises(EmptyCredentialError, match="A is broken"):
        await creds.aget_credential(BROKER)


def test_hooks_of_the_wrong_kind_are_refused(missing_path) -> None:
    class AsyncInSyncHook:
        @hookimpl
        async def agent_sandbox_get_credential(self, request: CredentialRequest) -> None:
            return None

    class SyncInAsyncHook:
        @hookimpl
        def agent_sandbox_get_credential_async(self, request: CredentialRequest) -> None:
            return None

    plugins = [("async-in-sync", AsyncInSyncHook()), ("sync-in-async", SyncInAsyncHook())]
    with pytest.warns(CredentialPluginWarning):
        creds = chain({}, missing_path, plugins)
        creds.registry()
    failed = {d.name: d.detail for d in explain(BROKER, auth=creds).decisions}
    assert "name it agent_sandbox_get_credential_async" in failed["async-in-sync"]
    assert "is not an async def" in failed["sync-in-async"]


# --- the single-flight cache -------------------------------------------------------------


async def _wave(source: CredentialSource, tasks: int = 200) -> set[str]:
    results = await asyncio.gather(*(source.aget_credential(BROKER) for _ in range(tasks)))
    return {c.token for c in results}


@pytest.mark.asyncio
async def test_200_tasks_cause_one_fetch_per_expiry_async_callable(mint, clock) -> None:
    counter = Counter()

    async def fetch() -> str:
        counter.hit()
        await asyncio.sleep(0.05)  # a slow token endpoint widens the race
        return mint(now=clock.now, ttl=600)

    auth = OIDCTokenAuth(fetch)
    for window in range(1, 4):
        assert len(await _wave(auth)) == 1
        assert len(await _wave(auth)) == 1  # still valid: no fetch
        assert counter.calls == window
        clock.advance(600)  # past exp - margin


@pytest.mark.asyncio
async def test_200_tasks_cause_one_fetch_per_expiry_sync_callable(mint, clock) -> None:
    counter = Counter()

    def fetch() -> str:
        counter.hit()
        time.sleep(0.05)
        return mint(now=clock.now, ttl=600)

    auth = OIDCTokenAuth(fetch)
    threads_before = threading.active_count()
    for window in range(1, 4):
        assert len(await _wave(auth)) == 1
        assert counter.calls == window
        clock.advance(600)
    # one worker thread for the leader's fetch at most, never one per waiter
    assert threading.active_count() - threads_before <= 2


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_200_tasks_through_the_chain_cause_one_fetch_per_expiry(
    kind: str, mint, clock, missing_path
) -> None:
    plugin: Counter = AsyncPlugin("A", delay=0.05) if kind == "async" else SyncPlugin("A", 0.05)
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": "", "A": mint(now=clock.now, ttl=600)}
    creds = DefaultCredentials(env, _token_path=missing_path, _plugins=[("plugin", plugin)])
    threads_before = threading.active_count()
    for window in range(1, 4):  # the first window's one fetch is discovery itself
        assert len(await _wave(creds)) == 1
        assert plugin.calls == window
        clock.advance(600)
        env["A"] = mint(now=clock.now, ttl=600)
    # loading the plugins and a sync fetch use a worker thread in the leading task only
    assert threading.active_count() - threads_before <= 2


@pytest.mark.asyncio
async def test_a_failed_fetch_fails_every_waiter_with_one_fetch(mint) -> None:
    counter = Counter()

    async def fetch() -> str:
        counter.hit()
        await asyncio.sleep(0.02)
        raise EmptyCredentialError("the token endpoint answered an empty token")

    auth = OIDCTokenAuth(fetch)
    results = await asyncio.gather(
        *(auth.aget_credential(BROKER) for _ in range(50)), return_exceptions=True
    )
    assert all(isinstance(r, EmptyCredentialError) for r in results)
    assert counter.calls == 1
    with pytest.raises(EmptyCredentialError):  # nothing was cached: the next call fetches
        await auth.aget_credential(BROKER)
    assert counter.calls == 2


@pytest.mark.asyncio
async def test_a_cancelled_leader_hands_the_fetch_to_a_waiter(mint) -> None:
    counter = Counter()
    token = mint()
    first_started = asyncio.Event()

    async def fetch() -> str:
        counter.hit()
        if counter.calls == 1:
            first_started.set()
            await asyncio.sleep(10)  # cancelled before it answers
        return token

    auth = OIDCTokenAuth(fetch)
    leader = asyncio.create_task(auth.aget_credential(BROKER))
    await first_started.wait()
    waiters = [asyncio.create_task(auth.aget_credential(BROKER)) for _ in range(20)]
    await asyncio.sleep(0)
    leader.cancel()
    results = await asyncio.gather(*waiters)
    assert {c.token for c in results} == {token}
    assert counter.calls == 2
    assert leader.cancelled()


@pytest.mark.asyncio
async def test_threads_waiting_for_a_cancelled_task_take_over_the_fetch(mint) -> None:
    """A flight led by a task and joined by threads: the task is cancelled, one thread fetches
    for all the others (one more fetch, never one per thread)."""
    counter = Counter()
    token = mint()
    first_started = asyncio.Event()

    async def fetch() -> str:
        counter.hit()
        if counter.calls == 1:
            first_started.set()
            await asyncio.sleep(10)  # cancelled before it answers
        return token

    auth = OIDCTokenAuth(fetch)
    leader = asyncio.create_task(auth.aget_credential(BROKER))
    await first_started.wait()
    seen: list[str] = []
    threads = [
        threading.Thread(target=lambda: seen.append(auth.get_credential(BROKER).token))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    await asyncio.sleep(0.2)  # let them join the task's flight
    leader.cancel()
    for t in threads:
        await asyncio.to_thread(t.join, 10)
    assert seen == [token] * 8
    assert counter.calls == 2
    assert leader.cancelled()


@pytest.mark.asyncio
async def test_a_cancelled_waiter_does_not_disturb_the_flight(mint) -> None:
    counter = Counter()
    release = asyncio.Event()
    token = mint()

    async def fetch() -> str:
        counter.hit()
        await release.wait()
        return token

    auth = OIDCTokenAuth(fetch)
    tasks = [asyncio.create_task(auth.aget_credential(BROKER)) for _ in range(10)]
    await asyncio.sleep(0.01)
    tasks[5].cancel()
    release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[5], asyncio.CancelledError)
    assert {c.token for i, c in enumerate(results) if i != 5} == {token}  # type: ignore[union-attr]
    assert counter.calls == 1


# --- one cache for both paths ------------------------------------------------------------


@pytest.mark.asyncio
async def test_sync_and_async_share_the_cache(mint, missing_path) -> None:
    counter = Counter()

    def fetch() -> str:
        counter.hit()
        return mint(sub=f"fetch-{counter.calls}")

    auth = OIDCTokenAuth(fetch)
    sync_token = auth.get_credential(BROKER).token
    assert (await auth.aget_credential(BROKER)).token == sync_token  # fetched by sync code
    assert counter.calls == 1
    auth.invalidate(BROKER)
    async_token = (await auth.aget_credential(BROKER)).token
    assert async_token != sync_token
    assert auth.get_credential(BROKER).token == async_token  # fetched by async code
    assert counter.calls == 2

    # the discovery chain: a cached env token selected by sync code is served to async code
    env_token = mint(sub="env")
    creds = chain({"AGENT_SANDBOX_TOKEN": env_token}, missing_path)
    assert creds.get_credential(BROKER).token == env_token
    assert (await creds.aget_credential(BROKER)).token == env_token


@pytest.mark.asyncio
async def test_threads_and_tasks_together_cause_one_fetch(mint, clock) -> None:
    counter = Counter()

    def fetch() -> str:
        counter.hit()
        time.sleep(0.1)
        return mint(now=clock.now, ttl=600)

    auth = OIDCTokenAuth(fetch)
    seen: set[str] = set()
    lock = threading.Lock()
    barrier = threading.Barrier(17)

    def worker() -> None:
        barrier.wait()
        token = auth.get_credential(BROKER).token
        with lock:
            seen.add(token)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    await asyncio.to_thread(barrier.wait)
    tokens = await _wave(auth, 100)
    for t in threads:
        await asyncio.to_thread(t.join)
    assert len(tokens | seen) == 1
    assert counter.calls == 1


def test_tasks_of_another_loop_wait_for_a_thread_led_fetch(mint) -> None:
    counter = Counter()
    started = threading.Event()

    def fetch() -> str:
        counter.hit()
        started.set()
        time.sleep(0.1)
        return mint()

    auth = OIDCTokenAuth(fetch)
    thread = threading.Thread(target=auth.get_credential, args=(BROKER,))
    thread.start()
    started.wait()
    tokens = asyncio.run(_wave(auth, 50))
    thread.join()
    assert len(tokens) == 1 and counter.calls == 1


@pytest.mark.asyncio
async def test_sync_call_on_the_loop_thread_during_an_async_flight_does_not_deadlock(mint):
    """A sync call on the loop's own thread never waits for a flight led by a task of that
    loop (it would block the loop that must finish the flight): it fetches by itself."""
    counter = Counter()
    started, release = threading.Event(), threading.Event()
    token = mint()

    def fetch() -> str:
        counter.hit()
        if counter.calls == 1:
            started.set()
            release.wait(10)  # the leader's fetch, in a worker thread
        return token

    auth = OIDCTokenAuth(fetch)
    leader = asyncio.create_task(auth.aget_credential(BROKER))
    await asyncio.to_thread(started.wait, 10)
    assert auth.get_credential(BROKER).token == token  # returns: no deadlock
    release.set()
    assert (await leader).token == token
    assert counter.calls == 2


@pytest.mark.asyncio
async def test_invalidate_is_synchronous_and_never_blocks(mint) -> None:
    auth = OIDCTokenAuth(lambda: mint())
    await auth.aget_credential(BROKER)
    invalidate: Callable[[str], object] = auth.invalidate
    assert invalidate(BROKER) is None
    assert not asyncio.iscoroutinefunction(invalidate)


# --- many zero-argument clients ----------------------------------------------------------


@pytest.fixture
def default_chain_plugin(monkeypatch: pytest.MonkeyPatch, mint, clock) -> SyncPlugin:
    """A counting plugin in the process's default chain (what ``DefaultCredentials()`` uses)."""
    from k8s_agent_sandbox_awx.credentials import _plugins

    for name in ("AGENT_SANDBOX_TOKEN", "AGENT_SANDBOX_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setenv("AGENT_SANDBOX_LOAD_PLUGINS", "")
    monkeypatch.setenv("SBX_ZERO_ARG", mint(now=clock.now, ttl=600))
    plugin = SyncPlugin("SBX_ZERO_ARG", delay=0.1)
    registry = _plugins.load_providers(os.environ, plugins=[("counting", plugin)])
    monkeypatch.setitem(_plugins._default_registries, (None, ""), registry)
    return plugin


@pytest.mark.asyncio
async def test_200_zero_arg_clients_at_once_cause_one_fetch(default_chain_plugin) -> None:
    results = await asyncio.gather(
        *(DefaultCredentials().aget_credential(BROKER) for _ in range(200))
    )
    assert {c.provider for c in results} == {"counting"}
    assert len({c.token for c in results}) == 1
    assert default_chain_plugin.calls == 1


def test_zero_arg_clients_in_threads_cause_one_fetch(default_chain_plugin) -> None:
    barrier = threading.Barrier(16)
    tokens: list[str] = []

    def worker() -> None:
        barrier.wait()
        creds = DefaultCredentials()
        tokens.append(creds.get_credential(BROKER).token)
        tokens.append(creds.get_credential(BROKER).token)  # now selected, or from the cache

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tokens) == 32 and len(set(tokens)) == 1
    assert default_chain_plugin.calls == 1
