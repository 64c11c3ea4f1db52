"""The layers the sync and the async client share are free of I/O; the sync modules never load
asyncio and the async ones never block on httpx's sync client."""

from __future__ import annotations

import ast
from pathlib import Path

import k8s_agent_sandbox_awx

SRC = Path(k8s_agent_sandbox_awx.__file__).resolve().parent


def _top_imports(name: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse((SRC / name).read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_shared_operations_do_no_io() -> None:
    for module in (
        "_flow.py",
        "_base.py",
        "_protocol.py",
        "_driver.py",
        "_dataplane.py",
        "_dialect.py",
        "_dialect_v1.py",
    ):
        assert _top_imports(module) & {"httpx", "httpcore", "asyncio", "socket", "ssl"} == set()


def test_exchange_performs_nothing() -> None:
    # _exchange builds httpx requests and decides outcomes; it never sends, reads or sleeps.
    text = (SRC / "_exchange.py").read_text()
    assert "asyncio" not in _top_imports("_exchange.py")
    for call in ("_client.send(", "response.read(", "aread(", "sleep(", "iter_bytes("):
        assert call not in text, call


def test_sync_modules_never_import_asyncio() -> None:
    for module in ("_transport.py", "_client.py", "_commands.py", "_files.py"):
        assert "asyncio" not in _top_imports(module), module


def test_async_modules_use_the_async_http_client_only() -> None:
    for module in ("_async_transport.py", "_async_client.py"):
        text = (SRC / module).read_text()
        assert "httpx.Client(" not in text and "time.sleep" not in text, module
