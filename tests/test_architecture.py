"""The architecture (docs/architecture.md) as checks: no import cycle among the core modules,
no function over 60 lines outside ``testing``, one-way dependencies between the groups, shared
layers free of I/O, and sync/async shells that differ only by their I/O."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import k8s_agent_sandbox_awx

SRC = Path(k8s_agent_sandbox_awx.__file__).resolve().parent
PACKAGE = "k8s_agent_sandbox_awx"
MAX_FUNCTION_LINES = 60

CREDENTIALS = {
    "_auth",
    "_bridge",
    "_cache",
    "_chain",
    "_credential",
    "_credential_errors",
    "_jwt",
    "_plugins",
    "_providers",
    "hookspecs",
}
SHARED = {"_driver", "_upstream", "_version"}
"""What both halves may use: the one driver, the upstream boundary, the version."""


def _core_modules() -> dict[str, Path]:
    return {p.stem: p for p in SRC.glob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere (also inside functions), relative or
    absolute; imports only type checkers see are left out."""
    found: set[str] = set()

    def add(dotted: str) -> None:
        head = dotted.split(".")[0]
        if head in modules or head == "testing":
            found.add(head)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    add(alias.name[len(PACKAGE) + 1 :])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.startswith(PACKAGE):
                rest = node.module[len(PACKAGE) + 1 :]
                if rest:
                    add(rest)
                else:
                    for alias in node.names:
                        add(alias.name)
            elif node.level == 1:
                if node.module:
                    add(node.module)
                else:
                    for alias in node.names:
                        add(alias.name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found - {path.stem}


def _graph() -> dict[str, set[str]]:
    modules = _core_modules()
    names = set(modules)
    return {name: _imported_modules(path, names) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_cycle_among_core_modules() -> None:
    graph = _graph()
    graph.pop("testing", None)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_check_sees_relative_and_function_level_imports(tmp_path: Path) -> None:
    (tmp_path / "_a.py").write_text("from . import _b\n")
    (tmp_path / "_b.py").write_text("def f():\n    from ._a import x\n    return x\n")
    names = {"_a", "_b"}
    graph = {p.stem: _imported_modules(p, names) for p in tmp_path.glob("*.py")}
    assert _cycle(graph) in (["_a", "_b", "_a"], ["_b", "_a", "_b"])


def test_no_function_over_60_lines_outside_testing() -> None:
    long: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        if "testing" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert long == []


def test_credentials_never_import_the_client() -> None:
    graph = _graph()
    for name in CREDENTIALS:
        assert graph[name] <= CREDENTIALS | SHARED, (name, graph[name] - CREDENTIALS - SHARED)


def test_core_never_imports_testing() -> None:
    graph = _graph()
    allowed = {"_cli", "_pytest_plugin"}  # the dev/demo commands and the pytest fixture
    assert sorted(name for name, deps in graph.items() if "testing" in deps) == sorted(
        name for name in allowed if "testing" in graph[name]
    )


IO_FREE = {
    "_base",
    "_dataplane",
    "_dialect",
    "_dialect_v1",
    "_dialects",
    "_driver",
    "_flow",
    "_fsapi",
    "_protocol",
    "_upload",
}
"""What the sync and the async shells share: decisions only, no I/O, no httpx."""


def _third_party(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_shared_layers_do_no_io_even_through_what_they_import() -> None:
    graph, modules = _graph(), _core_modules()
    for name in IO_FREE:
        reached, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current not in reached:
                reached.add(current)
                todo.extend(graph.get(current, ()))
        assert reached.isdisjoint({"_exchange", "_transport", "_async_transport"}), name
        for module in reached - {"testing"}:
            io = {"httpx", "httpcore", "socket", "ssl", "requests", "urllib3"}
            assert not io & _third_party(modules[module]), (name, module)
        assert "asyncio" not in _third_party(modules[name]), name


def test_exchange_performs_nothing() -> None:
    # _exchange builds httpx requests and decides outcomes; it never sends, reads or sleeps.
    text = (SRC / "_exchange.py").read_text()
    assert "asyncio" not in _third_party(SRC / "_exchange.py")
    for call in ("_client.send(", "response.read(", "aread(", "sleep(", "iter_bytes("):
        assert call not in text, call


def test_sync_modules_never_import_asyncio() -> None:
    for module in ("_transport.py", "_client.py", "_commands.py", "_files.py"):
        assert "asyncio" not in _third_party(SRC / module), module


def test_async_modules_use_the_async_http_client_only() -> None:
    for module in ("_async_transport.py", "_async_client.py"):
        text = (SRC / module).read_text()
        assert "httpx.Client(" not in text and "time.sleep" not in text, module


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


def test_abstract_methods_of_the_shared_bases_are_enforced() -> None:
    import pytest

    from k8s_agent_sandbox_awx._base import ClientBase
    from k8s_agent_sandbox_awx._dialect import Dialect

    for base in (ClientBase, Dialect):
        with pytest.raises(TypeError, match="abstract"):
            base()  # type: ignore[abstract]
