"""Each local runtime listens on a port of its own, however many start at once: the runtime binds
port 0 itself and reports the port (``{port_file}``), so no port chosen by the backend can be
taken by another runtime between the choice and the bind (docs/local-broker.md, "The port")."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("uvicorn", reason="needs the [local] extra")

from k8s_agent_sandbox_awx.broker.backends.local import _processes
from k8s_agent_sandbox_awx.broker.backends.local._launcher import RuntimeHandle, SandboxSpec
from k8s_agent_sandbox_awx.broker.backends.local._processes import LocalProcessLauncher
from tests._support.isolation import TCP_PORTS, host_processes_only


async def _start(backend: LocalProcessLauncher, *names: str) -> list[RuntimeHandle]:
    specs = [SandboxSpec(name, "default", "python") for name in names]
    return list(await asyncio.gather(*(backend.start(spec) for spec in specs)))


async def _check_each_port_is_its_own_runtime(handles: list[RuntimeHandle]) -> None:
    assert len({h.port for h in handles}) == len(handles)
    for h in handles:
        Path(h.base_dir, "who").write_text(h.name)  # noqa: ASYNC240 - a test's small file
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as http:
        for h in handles:
            resp = await http.get(f"http://{h.host}:{h.port}/download/who")
            assert (resp.status_code, resp.text) == (200, h.name)


@host_processes_only(TCP_PORTS)
@pytest.mark.parametrize("fork_server", [True, False], ids=["forked", "exec"])
def test_a_port_taken_since_the_backend_chose_it_is_never_used(
    fork_server: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old race, made certain: the backend's choice of a free port always names a port
    another runtime listens on by the time this one binds."""
    backend = LocalProcessLauncher(fork_server=fork_server)

    async def main() -> None:
        try:
            [first] = await _start(backend, "first")
            monkeypatch.setattr(_processes, "_free_port", lambda host: first.port)
            [second] = await _start(backend, "second")
            assert backend.is_alive(first) and backend.is_alive(second)
            await _check_each_port_is_its_own_runtime([first, second])
        finally:
            await backend.close()

    asyncio.run(main())


@host_processes_only(TCP_PORTS)
def test_many_runtimes_started_at_once_get_distinct_ports() -> None:
    backend = LocalProcessLauncher()

    async def main() -> None:
        try:
            handles = await _start(backend, *(f"sbx-{i}" for i in range(50)))
            assert all(backend.is_alive(h) for h in handles)
            await _check_each_port_is_its_own_runtime(handles)
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_custom_command_without_port_file_still_gets_a_port(tmp_path: Any) -> None:
    """A runtime of one's own that takes ``--port {port}`` (no ``{port_file}``) keeps working."""
    command = (
        "{python} -m k8s_agent_sandbox_awx.broker.runtime "
        "--host {host} --port {port} --base-dir {base_dir}"
    )
    backend = LocalProcessLauncher(command)

    async def main() -> None:
        try:
            handles = await _start(backend, "custom-a", "custom-b")
            await _check_each_port_is_its_own_runtime(handles)
        finally:
            await backend.close()

    asyncio.run(main())
