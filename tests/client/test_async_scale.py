"""100 sandboxes at once from one event loop: create, a command and a file round trip each,
kill; one credential fetch for the whole run; nothing leaked (claims, runtimes, sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx import AsyncSandbox, OIDCTokenAuth, clear_credential_cache
from k8s_agent_sandbox_awx.credentials import _cache
from tests._support.programs import process_alive as _alive

pytestmark = pytest.mark.e2e

COUNT = 100


@contextlib.contextmanager
def _roomy(**options: Any) -> Iterator[Any]:
    from k8s_agent_sandbox_awx.testing import LocalBroker, Policy

    policy = Policy(templates=("python",), namespace="gitlab-ci", max_sandboxes=COUNT + 10)
    with LocalBroker(gitlab_policy=policy, warn=False, **options) as broker:
        yield broker


@pytest.fixture
def roomy_broker(_session_brokers: Any, dialect: str) -> Any:
    """A local broker (for the session, one per dialect) whose GitLab policy allows COUNT live
    sandboxes per caller (the default policy allows 5)."""
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    return _session_brokers(_roomy, dialect)


def _tcp_by_inode() -> dict[str, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) of this machine's IPv4 TCP sockets."""
    table: dict[str, tuple[int, int, str]] = {}
    with open("/proc/net/tcp") as fh:
        next(fh)
        for line in fh:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            table[inode] = (int(local.split(":")[1], 16), int(remote.split(":")[1], 16), state)
    return table


def _client_sockets(broker_port: int, *, side: str = "client") -> list[tuple[int, int, str]]:
    """This process's TCP sockets connected to the broker's port (``side="client"``), or the
    broker's accepted connections (``side="server"``, the listening socket excluded)."""
    table = _tcp_by_inode()
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            entry = table.get(link[8:-1])
            if entry is None:
                continue
            if (side == "client" and entry[1] == broker_port) or (
                side == "server" and entry[0] == broker_port and entry[2] != "0A"
            ):
                found.append(entry)
    return found


def _settle(check: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if not value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@pytest.mark.slow
def test_100_sandboxes_concurrently(roomy_broker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    broker = roomy_broker
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    clear_credential_cache()
    fetches: list[str] = []

    async def fetch(audience: str) -> str:
        fetches.append(audience)
        await asyncio.sleep(0.01)  # a slow fetch: concurrent tasks must wait for this one
        # the first token's cache window ends at exp - 60 s (10 % of 600 s); the next one's
        # window is long enough for the rest of the test
        return broker.issue_gitlab_token("group/project", ttl=600 if len(fetches) == 1 else 3600)

    auth = OIDCTokenAuth(fetch)
    pids: dict[str, int] = {}
    handles: list[AsyncSandbox] = []

    async def cycle(i: int) -> str:
        payload = hashlib.sha256(str(i).encode()).digest() * 4096  # 128 KiB, distinct
        async with await AsyncSandbox.create(
            auth=auth, broker_url=broker.url, ca_cert=broker.ca_bundle, labels={"i": str(i)}
        ) as sandbox:
            handles.append(sandbox)
            pid = broker.runtime_pid(sandbox.name)
            assert pid is not None
            pids[sandbox.name] = pid
            result = await sandbox.commands.run(f"echo {i}")
            assert (result.stdout, result.exit_code) == (f"{i}\n", 0)
            await sandbox.files.write(f"data/{i}.bin", payload)
            assert await sandbox.files.read(f"data/{i}.bin") == payload
            return sandbox.name

    async def main() -> list[str]:
        return await asyncio.gather(*(cycle(i) for i in range(COUNT)))

    port = int(broker.url.rsplit(":", 1)[1])
    # Warm up with one cycle: the broker (in this process) then has its fork server running
    # and its issuers' keys fetched over its own keep-alive connection to itself.
    asyncio.run(cycle(COUNT + 50))
    assert fetches == [broker.url]
    handles.clear()
    fds_before = set(os.listdir("/proc/self/fd"))
    connected_before = set(_client_sockets(port))  # the broker's own JWKS connection
    accepted_before = len(_client_sockets(port, side="server"))
    names = asyncio.run(main())

    assert len(set(names)) == COUNT and len(handles) == COUNT
    assert fetches == [broker.url]  # one fetch for the whole run: one expiry window

    # The next window: 560 s later (past the first token's cache window, before its exp) a
    # second burst fetches once more, once, however many tasks find the entry stale at once.
    offset = 560.0
    monkeypatch.setattr(_cache, "_clock", lambda: time.time() + offset)

    async def second_burst() -> list[str]:
        return await asyncio.gather(*(cycle(i) for i in range(COUNT, COUNT + 20)))

    assert len(asyncio.run(second_burst())) == 20
    assert fetches == [broker.url, broker.url]
    handles[:] = handles[:COUNT]
    assert all(not h.is_active and h.client._transport.is_closed for h in handles)
    assert _settle(lambda: [c for c in broker.claims()]) == []
    assert broker.sandboxes() == []
    assert len(broker.claims(include_deleted=True)) >= COUNT
    assert _settle(lambda: [p for p in pids.values() if _alive(p)]) == []
    # no client connection to the broker is left open (those from before the run are known by
    # their ports: the broker's own JWKS connection, idle all along, may have been closed by the
    # broker meanwhile, CLOSE_WAIT until its pool uses it again, a slow run's common case)
    before = {entry[:2] for entry in connected_before}
    assert _settle(lambda: {e for e in _client_sockets(port) if e[:2] not in before}) == set()
    # ... and the broker saw every one of them closed
    assert _settle(lambda: len(_client_sockets(port, side="server")) > accepted_before) is False

    # ... and no other descriptor opened during the run is still open: neither the client's
    # nor the broker's (it runs in this process; its router's keep-alive connections to a
    # runtime are closed with that sandbox, none is left in CLOSE_WAIT)
    def leftover() -> dict[str, Any]:
        table = _tcp_by_inode()
        found: dict[str, Any] = {}
        for fd in set(os.listdir("/proc/self/fd")) - fds_before:
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # closed meanwhile (or the listdir's own descriptor)
            found[fd] = table.get(link[8:-1]) if link.startswith("socket:[") else link
        return found

    assert _settle(leftover) == {}
    clear_credential_cache()
