"""The architecture (docs/architecture.md) as checks: the folders are layers and every import
goes down (``LAYERS``: the broker never imports the client, the client never the broker or the
CLI), no import cycle and no function over 60 lines outside the local stack (``broker/``,
``testing/``), the I/O-free layers never reaching httpx, the sandbox runtime on the standard
library, and sync/async shells that differ only by their I/O."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import k8s_agent_sandbox_awx

SRC = Path(k8s_agent_sandbox_awx.__file__).resolve().parent
PACKAGE = "k8s_agent_sandbox_awx"
MAX_FUNCTION_LINES = 60

CREDENTIALS = {"credentials", "hookspecs"}
"""The credential framework: the ``credentials`` package and the hook specifications (at the top
level, where plugin authors import them)."""
SHARED = {"_cookies", "_driver", "_upstream", "_urls", "_version"}
"""What both halves may use: the cookie jar that keeps nothing, the one driver, the upstream
boundary, the one URL rule, the version."""
LOCAL_STACK = {"broker", "testing"}
"""The local broker stack (the broker, its runtime and backends; LocalBroker, the test kits)."""


def _module_names() -> dict[str, Path]:
    """Every module of the package by its dotted name below the package (``client.wire._protocol``;
    a package by its own name, ``client.wire``; the top-level ``__init__`` as ``""``)."""
    names: dict[str, Path] = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _core_modules() -> dict[str, Path]:
    """Every module outside the local stack (what the cycle check covers today)."""
    return {name: path for name, path in _module_names().items() if _group(name) not in LOCAL_STACK}


def _group(name: str) -> str:
    """The top-level piece a module belongs to (``client``, ``credentials``, ``errors``, ...)."""
    return name.split(".")[0]


def in_group(name: str, groups: set[str]) -> bool:
    return any(name == g or name.startswith(g + ".") for g in groups)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_modules(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package modules the module ``name`` (at ``path``) imports anywhere (also inside
    functions), relative or absolute, by their dotted names; imports only type checkers see are
    left out. ``from package import x`` counts as importing ``package.x`` when that is a module,
    else ``package``."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def add(dotted: str, names: list[str]) -> None:
        for alias in names:
            sub = f"{dotted}.{alias}" if dotted else alias
            found.add(sub if sub in modules else dotted)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name[len(PACKAGE) + 1 :])
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            if node.level == 0 and node.module and node.module.split(".")[0] == PACKAGE:
                add(node.module[len(PACKAGE) + 1 :], names)
            elif node.level > 0:
                parts = package.split(".") if package else []
                base = parts[: len(parts) - (node.level - 1)]
                if node.module:
                    base.append(node.module)
                add(".".join(base), names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found - {name}


def _graph(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    modules = _module_names() if modules is None else modules
    names = set(_module_names())
    return {name: _imported_modules(path, name, names) for name, path in modules.items()}


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
    core = _core_modules()
    graph = {name: deps & set(core) for name, deps in _graph(core).items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_check_sees_relative_and_function_level_imports(tmp_path: Path) -> None:
    (tmp_path / "_a.py").write_text("from . import _b\n")
    (tmp_path / "_b.py").write_text("def f():\n    from ._a import x\n    return x\n")
    names = {"_a", "_b"}
    graph = {p.stem: _imported_modules(p, p.stem, names) for p in tmp_path.glob("*.py")}
    assert _cycle(graph) in (["_a", "_b", "_a"], ["_b", "_a", "_b"])
    # a relative import from a sub-package, two levels up
    (tmp_path / "_c.py").write_text("def f():\n    from .._d import y\n    return y\n")
    deps = _imported_modules(tmp_path / "_c.py", "pkg.sub._c", {"pkg.sub._c", "pkg._d"})
    assert deps == {"pkg._d"}


def test_no_function_over_60_lines_outside_testing() -> None:
    # outside the local stack: broker/ and testing/ (all of the former testing/)
    long: list[str] = []
    for name, path in sorted(_core_modules().items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}:{node.name} ({lines} lines)")
    assert long == []


def test_credentials_never_import_the_client() -> None:
    graph = _graph()
    framework = [name for name in graph if in_group(name, CREDENTIALS)]
    assert len(framework) > len(CREDENTIALS)
    for name in framework:
        outside = {d for d in graph[name] if not in_group(d, CREDENTIALS | SHARED)}
        assert outside == set(), (name, outside)


def test_core_never_imports_testing() -> None:
    graph = _graph(_core_modules())
    allowed = {
        "cli._local",  # the dev/demo commands (the pytest fixture is in testing/)
        "cli._broker",  # broker check/serve: the broker's configuration and server
    }
    importers = {
        name for name, deps in graph.items() if any(in_group(d, LOCAL_STACK) for d in deps)
    }
    assert sorted(importers) == sorted(allowed & importers)


LAYERS: dict[str, set[str]] = {
    # layer: the layers below it that it may import (its own is always allowed)
    "shared": set(),
    "credentials": {"shared"},
    "errors": {"shared", "credentials"},
    "client.wire": {"shared", "credentials", "errors"},
    "client.core": {"shared", "credentials", "errors", "client.wire"},
    "client.http": {"shared", "credentials", "errors", "client.wire", "client.core"},
    "client": {"shared", "credentials", "errors", "client.wire", "client.core", "client.http"},
    "broker.runtime": set(),
    "broker.identity": {"shared"},
    "broker.backends": {"shared", "broker.runtime"},
    "broker.config": {"shared", "broker.identity"},  # the scopes' names
    "broker.server": {"shared", "broker.config"},
    "broker": {
        *("shared", "broker.runtime", "broker.identity", "broker.backends"),
        *("broker.config", "broker.server"),
    },
    "testing": {
        *("shared", "credentials", "errors", "client.wire", "client.core", "client.http"),
        *("client", "broker.runtime", "broker.identity", "broker.backends", "broker"),
    },
    "cli": {
        *("shared", "credentials", "errors", "client.wire", "client.core", "client.http"),
        *("client", "testing"),  # testing: the dev/demo commands run the local broker
        *("broker.config", "broker.server", "broker"),  # broker check/serve
    },
    "api": {"shared"},  # the top-level __init__: its other names are imported on first use
}
"""The folders as layers, bottom to top: the credential framework below the client (wire, core,
http, then the sync and async shells), the broker beside it (runtime, identity, backends, then
the app), never importing it; testing above both, the CLI on top."""


def _layer(name: str) -> str:
    if name in SHARED:
        return "shared"
    if name == "hookspecs":  # at the top level for plugin authors; part of the framework
        return "credentials"
    if name in ("errors", ""):
        return "errors" if name else "api"
    deepest = [layer for layer in LAYERS if in_group(name, {layer})]
    assert deepest, f"{name}: in no layer of LAYERS (add its folder there, and to the docs)"
    return max(deepest, key=len)


def test_every_module_imports_only_its_layer_or_below() -> None:
    wrong = [
        f"{name} ({_layer(name)}) imports {dep} ({_layer(dep)})"
        for name, deps in sorted(_graph().items())
        for dep in sorted(deps)
        if _layer(dep) != _layer(name) and _layer(dep) not in LAYERS[_layer(name)]
    ]
    assert wrong == []


def test_the_layer_check_sees_a_wall_broken(tmp_path: Path) -> None:
    (tmp_path / "_x.py").write_text("from ...client import _client\n")
    deps = _imported_modules(tmp_path / "_x.py", "broker.backends._x", set(_module_names()))
    assert deps == {"client._client"}
    assert _layer("client._client") not in LAYERS[_layer("broker.backends._x")]


def test_the_runtime_uses_the_standard_library_only() -> None:
    """It is forked per sandbox and will run in a container image of its own."""
    lazily = {"python_multipart"}  # imported on the first upload; phase B: one multipart reader
    for name, path in _module_names().items():
        if in_group(name, {"broker.runtime"}):
            outside = _third_party(path) - set(sys.stdlib_module_names) - {PACKAGE}
            assert outside <= lazily, (name, outside - lazily)


IO_FREE = {
    "client._base",
    "client.wire._dataplane",
    "client.wire._dialect",
    "client.wire._dialect_v1",
    "client.wire._dialects",
    "_driver",
    "client.core._flow",
    "client.core._fsapi",
    "client.wire._protocol",
    "client.core._upload",
    "client.core._retry",
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
    graph, modules = _graph(), _module_names()
    layers = {name for name in modules if in_group(name, {"client.wire", "client.core"})}
    assert IO_FREE - {"client._base", "_driver"} <= layers
    for name in IO_FREE | layers:
        reached, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current not in reached:
                reached.add(current)
                todo.extend(graph.get(current, ()))
        performers = {
            "client.http._exchange",
            "client.http._transport",
            "client.http._async_transport",
        }
        assert reached.isdisjoint(performers), name
        if name in layers:  # client/wire and client/core never reach client/http at all
            assert not any(in_group(m, {"client.http"}) for m in reached), name
        for module in reached:
            io = {"httpx", "httpcore", "socket", "ssl", "requests", "urllib3"}
            assert not io & _third_party(modules[module]), (name, module)
        assert "asyncio" not in _third_party(modules[name]), name


def test_exchange_performs_nothing() -> None:
    # _exchange builds httpx requests and decides outcomes; it never sends, reads or sleeps.
    text = (SRC / "client/http/_exchange.py").read_text()
    assert "asyncio" not in _third_party(SRC / "client/http/_exchange.py")
    for call in ("_client.send(", "response.read(", "aread(", "sleep(", "iter_bytes("):
        assert call not in text, call


def test_sync_modules_never_import_asyncio() -> None:
    for module in (
        "client/http/_transport.py",
        "client/_client.py",
        "client/_commands.py",
        "client/_files.py",
    ):
        assert "asyncio" not in _third_party(SRC / module), module


def test_async_modules_use_the_async_http_client_only() -> None:
    for module in (
        "client/http/_async_transport.py",
        "client/_async_client.py",
        "client/_async_files.py",
    ):
        text = (SRC / module).read_text()
        assert "httpx.Client(" not in text and "time.sleep" not in text, module


def test_sandbox_use_does_not_load_the_local_stack() -> None:
    code = (
        "import sys\n"
        "from k8s_agent_sandbox_awx import Sandbox, BrokerSandboxClient, BrokerConnectionConfig\n"
        "import k8s_agent_sandbox_awx.cli._cli\n"
        "bad = [m for m in sys.modules if m.startswith(('k8s_agent_sandbox_awx.testing',\n"
        "                                               'k8s_agent_sandbox_awx.broker'))\n"
        "       or m.split('.')[0] in ('uvicorn', 'starlette', 'jwt', 'trustme')]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_abstract_methods_of_the_shared_bases_are_enforced() -> None:
    import pytest

    from k8s_agent_sandbox_awx.client._base import ClientBase
    from k8s_agent_sandbox_awx.client.wire._dialect import Dialect

    for base in (ClientBase, Dialect):
        with pytest.raises(TypeError, match="abstract"):
            base()  # type: ignore[abstract]
