"""``agent-sandbox-awx mcp`` on the Kubernetes-backed broker (the app ``broker serve`` builds,
on the real API server with the stand-in agent-sandbox controller), driven by the ``mcp``
package's client over stdio and over streamable HTTP: the tools, the session's default sandbox
(a real SandboxClaim, stamped with the caller), commands, files, kill, and the session's end
deleting the default claim. The caller's token comes from the API server's TokenRequest."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp", reason="needs the [mcp] extra")

from tests._support._api import CLAIM, path
from tests._support.kube import KubeAPIServer, KubeError
from tests._support.kube_broker import SdkReplica
from tests._support.mcp_servers import HttpServer, server_env, stdio_client_of, texts

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

STAMP = "broker.agent-sandbox-awx.io/"


def _claim(kube: KubeAPIServer, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        claim = kube.get(path(CLAIM, namespace, name))
    except KubeError as exc:
        if exc.status_code == 404:
            return None
        raise
    return None if claim["metadata"].get("deletionTimestamp") else claim


async def _gone(kube: KubeAPIServer, namespace: str, name: str, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await asyncio.to_thread(_claim, kube, namespace, name) is None:
            return True
        await asyncio.sleep(0.1)
    return False


def _stamped(kube: KubeAPIServer, namespace: str, name: str) -> None:
    claim = _claim(kube, namespace, name)
    assert claim is not None, name
    annotations = claim["metadata"]["annotations"]
    assert annotations[STAMP + "subject"] == f"system:serviceaccount:{namespace}:agent"
    assert claim["spec"]["warmPoolRef"] == {"name": "python"}


async def test_stdio_tools_on_the_kubernetes_backend(
    kube: KubeAPIServer, namespace: str, python_replica: SdkReplica, tmp_path: Path
) -> None:
    _, environ = python_replica("v1")
    env = server_env(environ, AGENT_SANDBOX_TEMPLATE="python")
    async with stdio_client_of(env, tmp_path / "server.log") as server:
        names = {t.name for t in (await server.client.list_tools()).tools}
        assert {"run_command", "read_file", "write_file", "kill_sandbox"} <= names
        ran = await server.ok("run_command", command="echo from-a-claim")
        default = ran["sandbox"]
        assert (ran["exit_code"], ran["stdout"]) == (0, "from-a-claim\n")
        _stamped(kube, namespace, default)
        await server.ok("write_file", path="work/data.txt", content="in a pod\n")
        assert texts(await server.call("read_file", path="work/data.txt")) == "in a pod\n"
        listed = await server.ok("list_files", path="work")
        assert [e["name"] for e in listed["entries"]] == ["data.txt"]
        await server.ok("run_code", code="total = 40")
        kept = await server.ok("run_code", code="total + 2")
        assert (kept["sandbox"], kept["text"]) == (default, "42")
        failed = await server.ok("run_code", code="undefined_name")
        assert failed["error"]["name"] == "NameError"
        mine = await server.ok("list_sandboxes")
        assert [(s["sandbox"], s["default"]) for s in mine["sandboxes"]] == [(default, True)]
        made = (await server.ok("create_sandbox", template="python"))["sandbox"]
        _stamped(kube, namespace, made)
        assert (await server.ok("kill_sandbox", sandbox=made))["killed"] is True
        assert await _gone(kube, namespace, made)
        assert _claim(kube, namespace, default) is not None
    assert await _gone(kube, namespace, default)  # the session ended: its claim is deleted


async def test_http_sessions_on_the_kubernetes_backend_rpc_dialect(
    kube: KubeAPIServer, namespace: str, python_replica: SdkReplica, tmp_path: Path
) -> None:
    _, environ = python_replica("rpc")
    env = server_env(environ, AGENT_SANDBOX_TEMPLATE="python")
    with HttpServer(env, tmp_path / "server.log") as http:
        async with http.client() as session:
            ran = await session.ok("run_command", command="echo over-http")
            default = ran["sandbox"]
            assert ran["stdout"] == "over-http\n" and default.startswith("broker-")
            _stamped(kube, namespace, default)
            await session.ok("write_file", path="a.txt", content="kept")
            again = await session.ok("run_command", command="cat a.txt")
            assert (again["sandbox"], again["stdout"]) == (default, "kept")
            await session.ok("run_code", code="n = 6 * 7")
            assert (await session.ok("run_code", code="n"))["text"] == "42"
        assert await _gone(kube, namespace, default)  # DELETE ended the session
        assert http.stop() == 0
