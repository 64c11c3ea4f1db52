"""Sandboxes of one process with the same connection settings share one pool of TLS
connections (``client/http/_pool.py``, ``_async_pool.py``), against a local broker over real
HTTPS on loopback. The broker counts the TLS handshakes it completes (its server context's SNI
callback runs once per handshake, with or without a server name)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import (
    AsyncBrokerSandboxClient,
    AsyncSandbox,
    BrokerConnectionConfig,
    BrokerSandboxClient,
    Sandbox,
)
from k8s_agent_sandbox_awx.client.http import _async_pool, _pool

pytestmark = pytest.mark.e2e


class Handshakes:
    """The TLS handshakes the broker's server has seen since ``start``."""

    def __init__(self, broker: Any) -> None:
        self._context = broker._server.config.ssl
        self._lock = threading.Lock()
        self.count = 0

    def _seen(self, ssl_object: Any, server_name: str | None, context: Any) -> None:
        with self._lock:
            self.count += 1

    def start(self) -> Handshakes:
        self.count = 0
        self._context.sni_callback = self._seen
        return self

    def stop(self) -> None:
        self._context.sni_callback = None


@pytest.fixture(scope="module")
def pool_broker() -> Iterator[Any]:
    """A broker of this module's own (warmed up: its fork server runs and its issuers' keys
    are fetched, so that it makes no TLS connection to itself during a test)."""
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    from k8s_agent_sandbox_awx.testing import LocalBroker

    with LocalBroker(warn=False) as broker:
        for kind in ("gitlab", "kubernetes"):
            with Sandbox.create(environ=broker.environ(kind)) as sandbox:
                sandbox.commands.run("true")
        yield broker


@pytest.fixture
def handshakes(pool_broker: Any) -> Iterator[Handshakes]:
    _pool.close_idle()  # every test starts without a connection
    counter = Handshakes(pool_broker).start()
    yield counter
    counter.stop()
    _pool.close_idle()


def test_sandboxes_created_one_after_another_share_one_tls_connection(
    pool_broker: Any, handshakes: Handshakes
) -> None:
    env = pool_broker.environ("gitlab")
    for i in range(3):  # each killed before the next is created
        with Sandbox.create(environ=env) as sandbox:
            assert sandbox.commands.run(f"echo {i}").stdout == f"{i}\n"
    with Sandbox.create(environ=env) as first, Sandbox.create(environ=env) as second:
        assert first.commands.run("echo a").stdout == "a\n"
        assert second.commands.run("echo b").stdout == "b\n"
    assert handshakes.count == 1


def test_a_closed_sandbox_leaves_the_others_working(
    pool_broker: Any, handshakes: Handshakes
) -> None:
    env = pool_broker.environ("gitlab")
    with Sandbox.create(environ=env) as stays:
        gone = Sandbox.create(environ=env)
        gone.commands.run("true")
        gone.kill()  # closes its connections: not the pool the other one uses
        assert gone.client._transport.is_closed and not stays.client._transport.is_closed
        assert stays.commands.run("echo still").stdout == "still\n"
        left = Sandbox.create(environ=env)
        left.close_connection()  # the sandbox runs on; the handle is done
        assert stays.files.write("f.txt", b"x").name == "f.txt"
        with pytest.raises(RuntimeError, match="connections were closed"):
            left.client._transport.send(left.client._use_dialect().whoami().spec)
        Sandbox.kill(left.name, environ=env)
    assert handshakes.count == 1


def test_threads_creating_sandboxes_at_once_share_the_pool(
    pool_broker: Any, handshakes: Handshakes
) -> None:
    env = pool_broker.environ("gitlab")
    threads = 4
    barrier = threading.Barrier(threads)
    outputs: list[str] = []
    errors: list[BaseException] = []

    def cycle(i: int) -> None:
        try:
            barrier.wait(10)
            with Sandbox.create(environ=env) as sandbox:
                outputs.append(sandbox.commands.run(f"echo {i}").stdout)
        except BaseException as exc:
            errors.append(exc)

    for wave in range(2):
        started = [threading.Thread(target=cycle, args=(wave * 10 + i,)) for i in range(threads)]
        for thread in started:
            thread.start()
        for thread in started:
            thread.join(60)
    assert errors == []
    assert sorted(outputs) == sorted(f"{w * 10 + i}\n" for w in range(2) for i in range(threads))
    # at most one connection per request in flight at once, and the second wave reuses them
    assert 1 <= handshakes.count <= threads


def test_async_two_event_loops_one_after_the_other(
    pool_broker: Any, handshakes: Handshakes
) -> None:
    env = pool_broker.environ("gitlab")
    client = AsyncBrokerSandboxClient(environ=env)  # made outside any loop, used by two
    pools: list[Any] = []

    async def use(tag: str) -> None:
        for i in range(2):
            async with await AsyncSandbox.create(environ=env) as sandbox:
                assert (await sandbox.commands.run(f"echo {tag}{i}")).stdout == f"{tag}{i}\n"
        sandbox = await client.create_sandbox()
        assert (await sandbox.commands.run("echo c")).stdout == "c\n"
        await sandbox.kill()
        pools.append(client._transport._http._pool)

    asyncio.run(use("a"))
    assert pools[0].client.is_closed  # closed with its loop: not leaked, never reused
    asyncio.run(use("b"))
    assert pools[1] is not pools[0] and pools[1].client.is_closed
    assert handshakes.count == 2  # one connection per loop

    async def close() -> None:
        await client.close()

    asyncio.run(close())


def test_a_forked_child_makes_its_own_connection(pool_broker: Any, handshakes: Handshakes) -> None:
    env = pool_broker.environ("gitlab")
    with Sandbox.create(environ=env) as sandbox:
        assert sandbox.commands.run("echo parent").stdout == "parent\n"
        assert handshakes.count == 1
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the handle carried over, never the parent's connection
            try:
                os.write(write, sandbox.commands.run("echo child").stdout.encode())
            except BaseException as exc:
                os.write(write, f"failed: {type(exc).__name__}: {exc}".encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            said = pipe.read().decode()
        os.waitpid(pid, 0)
        assert said == "child\n"
        assert handshakes.count == 2
        assert sandbox.commands.run("echo again").stdout == "again\n"  # the parent's works
    assert handshakes.count == 2


def test_settings_that_differ_get_different_pools(pool_broker: Any, handshakes: Handshakes) -> None:
    env = pool_broker.environ("gitlab")
    with Sandbox.create(environ=env) as one, Sandbox.create(environ=env, request_timeout=29) as two:
        assert one.commands.run("echo 1").stdout == "1\n"
        assert two.commands.run("echo 2").stdout == "2\n"
        assert handshakes.count == 2
        config = BrokerConnectionConfig.from_env(env, request_timeout=29)
        three = Sandbox.connect(two.name, config=config, environ=env)
        assert three.commands.run("echo 3").stdout == "3\n"
        three.close_connection()
    assert handshakes.count == 2


def test_clients_of_different_callers_share_a_pool_never_a_token(
    pool_broker: Any, handshakes: Handshakes
) -> None:
    mine = pool_broker.environ("gitlab", project_path="group/mine")
    theirs = pool_broker.environ("gitlab", project_path="group/theirs")
    with BrokerSandboxClient(environ=mine) as me, BrokerSandboxClient(environ=theirs) as them:
        assert me.whoami()["subject"] != them.whoami()["subject"]
        sandbox = me.create_sandbox()
        assert [s.name for s in me.list_sandboxes()] == [sandbox.name]
        assert them.list_sandboxes() == []  # its own token on the shared connection
        assert me.whoami()["subject"] != them.whoami()["subject"]
    assert handshakes.count == 1


def test_a_client_keeps_its_own_connection_limit_on_the_shared_pool(pool_broker: Any) -> None:
    config = BrokerConnectionConfig(
        broker_url=pool_broker.url, ca_cert=pool_broker.ca_bundle, max_connections=1
    )
    busy, other = _pool.Lease(config), _pool.Lease(config)
    try:
        assert busy.client is other.client  # one pool
        held = busy.send(_healthz(busy, pool=5))  # open: holds the client's one connection
        with pytest.raises(httpx.PoolTimeout, match="max_connections=1"):
            busy.send(_healthz(busy, pool=0.2))
        answer = other.send(_healthz(other, pool=0.2))  # another client is not held up
        assert answer.read() and answer.status_code == 200
        busy.close()  # closes the answer it had open, not the other client's
        assert held.is_closed
        assert other.send(_healthz(other, pool=1)).read()
    finally:
        busy.close()
        other.close()


def _healthz(lease: Any, *, pool: float) -> httpx.Request:
    timeout = httpx.Timeout(10, pool=pool)
    return lease.client.build_request(
        "GET", f"{lease._config.broker_url}/v1/healthz", timeout=timeout
    )


def test_an_explicit_transport_is_never_shared(pool_broker: Any) -> None:
    config = BrokerConnectionConfig(broker_url=pool_broker.url, ca_cert=pool_broker.ca_bundle)
    shared = _pool.Lease(config)
    own = [_pool.Lease(config, httpx.HTTPTransport()) for _ in range(2)]
    try:
        assert len({id(shared.client), id(own[0].client), id(own[1].client)}) == 3
        own[0].close()
        assert own[0].client.is_closed and not own[1].client.is_closed
        assert not shared.client.is_closed
    finally:
        for lease in (shared, *own):
            lease.close()


def test_the_pool_key_names_what_makes_a_connection_differ(tmp_path: Any) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("one")

    def key(**settings: Any) -> _pool.PoolKey:
        base = {"broker_url": "https://broker.example", "ca_cert": str(ca)}
        return _pool.pool_key(BrokerConnectionConfig(**{**base, **settings}))

    same = key()
    assert key() == same and hash(key()) == hash(same)
    assert key(broker_url="https://other.example") != same
    assert key(request_timeout=5) != same
    assert key(max_keepalive_connections=1) != same
    assert key(trust_env_proxies=False) != same
    assert key(extra_headers={"X-Team": "secret-value"}) != same
    assert key(client_cert=(str(ca), str(ca))) != same
    assert key(max_connections=7) == same  # a client's own limit, kept by its lease
    assert key(max_attempts=2, template="python", sandbox_timeout=60) == same
    ca.write_text("a replaced bundle")
    assert key() != same
    shown = repr(key(extra_headers={"X-Team": "secret-value"}))
    assert shown == "PoolKey('https://broker.example')" and "secret" not in shown


def test_the_proxies_of_the_environment_are_part_of_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = BrokerConnectionConfig(broker_url="https://broker.example")
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    direct = _pool.pool_key(config)
    monkeypatch.setenv("HTTPS_PROXY", "http://user:pw@proxy.example:3128")
    through = _pool.pool_key(config)
    assert through != direct and "pw" not in repr(through)
    loopback = BrokerConnectionConfig(broker_url="https://127.0.0.1:8443")
    assert _pool.pool_key(loopback) == _pool.pool_key(loopback)  # never proxied: not read


def test_a_closed_loop_pool_is_dropped_not_reused(pool_broker: Any) -> None:
    config = BrokerConnectionConfig(broker_url=pool_broker.url, ca_cert=pool_broker.ca_bundle)
    loop = asyncio.new_event_loop()
    lease = _async_pool.AsyncLease(config, None)

    async def touch() -> Any:
        response = await lease.send(
            lease.client.build_request("GET", pool_broker.url + "/v1/healthz")
        )
        await response.aread()
        await response.aclose()
        return lease._pool

    first = loop.run_until_complete(touch())
    loop.close()  # without finalising its async generators: nothing can close the pool now

    async def again() -> Any:
        return await touch()

    second = asyncio.run(again())
    assert second is not first and first.abandoned
    assert all(other is not loop for other in _async_pool._loops.pools)
