"""The walls between the layers: an I/O-free protocol layer; the core never imports testing."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import k8s_agent_sandbox_awx

SRC = Path(k8s_agent_sandbox_awx.__file__).resolve().parent
IO_MODULES = {"httpx", "httpcore", "socket", "ssl", "requests", "urllib3", "asyncio", "time"}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found.add(base)
            found.update(
                f"{base}.{alias.name}" if node.module else base + alias.name for alias in node.names
            )
    return found


def test_protocol_layer_does_no_io() -> None:
    imported = {name.split(".")[0] for name in _imports(SRC / "_protocol.py")}
    assert imported & IO_MODULES == set()


def test_core_never_imports_testing() -> None:
    for path in SRC.glob("*.py"):
        if path.name in ("_cli.py", "_pytest_plugin.py"):
            continue  # dev/demo dispatch and the pytest fixture, both lazily
        names = _imports(path)
        assert not any("testing" in n.split(".") for n in names), path.name


def test_sandbox_use_does_not_load_the_local_stack() -> None:
    code = (
        "import sys\n"
        "from k8s_agent_sandbox_awx import Sandbox, BrokerSandboxClient, BrokerConnectionConfig\n"
        "import k8s_agent_sandbox_awx._cli\n"
        "bad = [m for m in sys.modules if m.startswith('k8s_agent_sandbox_awx.testing')\n"
        "       or m.split('.')[0] in ('uvicorn', 'starlette', 'jwt', 'trustme')]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
