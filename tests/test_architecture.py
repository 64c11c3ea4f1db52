"""The architecture (docs/architecture.md) as checks, for ALL of src/ (broker/ and testing/
included): no import cycle between modules or between folders, no function over 60 lines, the
walls between the pieces (the credential framework below the client; the broker beside the
client, meeting it only through the protocol; testing/ may import anything), the folders as
layers (every import goes down), the I/O-free core never reaching httpx, the sandbox runtime on
the standard library alone, sync/async shells that differ only by their I/O, plugins that
use public names only, and a map (docs/architecture.md) that names only modules that exist.

Imports are read from the source (``tests/_support/architecture.py``): function-level imports
count, imports only type checkers see (``if TYPE_CHECKING:``) do not. Each checker has a
self-test below that makes it fail on a small package written for it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import k8s_agent_sandbox_awx
from tests._support.architecture import (
    Package,
    doc_module_gaps,
    folder_cycles,
    in_group,
    long_functions,
    module_cycles,
    private_uses,
    reached,
    reached_imports,
    wall_breaches,
)

SRC = Path(k8s_agent_sandbox_awx.__file__).resolve().parent
PLUGINS = SRC.parents[1] / "plugins"
PACKAGE = "k8s_agent_sandbox_awx"
MAX_FUNCTION_LINES = 60
PKG = Package(SRC, PACKAGE)


def _none(found: list[str], rule: str) -> None:
    """Assert that ``found`` is empty; the message names the rule and every offender."""
    assert found == [], f"{rule}: {len(found)} offender(s)\n  " + "\n  ".join(found)


def _package(tmp_path: Path, files: dict[str, str], name: str = "pkg") -> Package:
    """A package ``name`` in ``tmp_path`` made of ``files`` (path below it -> source)."""
    root = tmp_path / name
    for relative, source in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(textwrap.dedent(source))
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return Package(root, name)


# ------------------------------------------------------------------------------ cycles


def test_no_import_cycle_between_modules() -> None:
    _none(module_cycles(PKG), "import cycles between modules (function-level imports count)")


def test_no_import_cycle_between_folders() -> None:
    _none(
        folder_cycles(PKG),
        "import cycles between folders (a folder's modules import a folder that imports them back)",
    )


def test_the_cycle_checks_see_relative_lazy_and_folder_cycles(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "_a.py": "from . import _b\n",
            "_b.py": "def f():\n    from ._a import x\n    return x\n",
            "sub/_c.py": "def f():\n    from .._d import y\n    return y\n",
            "_d.py": "y = 1\n",
            "one/_x.py": "from ..two import _y\n",
            "two/_y.py": "X = 1\n",
            "two/_z.py": "from pkg.one._x import X\n",
            "_typed.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import _u\n",
            "_u.py": "from . import _typed\n",
        },
    )
    assert module_cycles(pkg) == [
        "_a -> _b (_a.py:1) -> _a (_b.py:2, in a function)"
    ]  # _typed <-> _u is no cycle: the import back is for type checkers only
    assert pkg.graph()["sub._c"] == {"_d"}  # a relative import two levels up
    assert folder_cycles(pkg) == [
        "_a -> _b (_a.py:1) -> _a (_b.py:2, in a function)",  # a top-level module: its own node
        "one -> two (one/_x.py:1) -> one (two/_z.py:1)",  # no module cycle: _x -> _y, _z -> _x
    ]


# ------------------------------------------------------------------------------ long functions


def test_no_function_over_60_lines() -> None:
    _none(long_functions(PKG, MAX_FUNCTION_LINES), f"functions over {MAX_FUNCTION_LINES} lines")


def test_the_length_check_sees_methods_and_nested_functions(tmp_path: Path) -> None:
    source = """\
        class C:
            def m(self):
                x = 1
                x = 2
                return x


        def outer():
            async def inner():
                x = 1
                return x

            return inner
        """
    pkg = _package(tmp_path, {"_long.py": source})
    assert long_functions(pkg, 3) == [
        "_long.py:2 C.m: 4 lines",
        "_long.py:8 outer: 6 lines",
    ]
    assert long_functions(pkg, 2) == [
        "_long.py:2 C.m: 4 lines",
        "_long.py:8 outer: 6 lines",
        "_long.py:9 outer.<locals>.inner: 3 lines",
    ]
    assert long_functions(pkg, 6) == []


# ------------------------------------------------------------------------------ walls

WALLS: dict[str, set[str]] = {
    "credentials": {"client", "broker", "cli", "testing"},
    "hookspecs": {"client", "broker", "cli", "testing"},  # the framework's, at the top level
    "client": {"broker", "testing", "cli"},
    "broker": {"client", "cli", "testing"},  # it meets clients only through the protocol
    "mcp": {"broker", "testing", "cli"},  # the MCP server is a client of the broker
    # the broker's two planes meet only in what both import (broker/common) and in the app
    "broker.control": {"broker.dataplane"},
    "broker.dataplane": {"broker.control"},
    "broker.common": {"broker.control", "broker.dataplane"},
}
"""Group -> the groups it never imports (``testing/`` may import anything)."""


@pytest.mark.parametrize("group", sorted(WALLS))
def test_the_walls_between_the_pieces(group: str) -> None:
    assert any(in_group(m, {group}) for m in PKG.paths), f"no module in {group}"
    _none(wall_breaches(PKG, group, WALLS[group]), f"{group} imports {sorted(WALLS[group])}")


def test_the_wall_check_sees_a_wall_broken(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "broker/backends/_x.py": "def f():\n    from ...client import _client\n",
            "client/_client.py": "from ..broker import backends\n",
        },
    )
    assert wall_breaches(pkg, "broker", {"client"}) == [
        "broker.backends._x imports client._client (broker/backends/_x.py:2, in a function)"
    ]
    assert wall_breaches(pkg, "client", {"broker"}) == [
        "client._client imports broker.backends (client/_client.py:1)"
    ]


def test_core_never_imports_testing() -> None:
    allowed = {
        "cli._local",  # the dev/demo commands (the pytest fixture is in testing/)
        "cli._dev_state",  # dev's state directory: the local broker's socket and certificates
        "cli._broker",  # broker check/serve: the broker's configuration and server
    }
    found = [
        breach
        for group in sorted({m.split(".")[0] for m in PKG.paths} - {"testing", "broker"})
        for breach in wall_breaches(PKG, group, {"testing", "broker"})
        if breach.split()[0] not in allowed
    ]
    _none(found, f"outside the local stack, only {sorted(allowed)} import testing/ or broker/")


# ------------------------------------------------------------------------------ layers

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
    "broker.common": {"shared", "broker.runtime", "broker.identity"},
    "broker.control": {"shared", "broker.identity", "broker.backends", "broker.common"},
    "broker.dataplane": {
        *("shared", "broker.runtime", "broker.identity", "broker.backends"),
        *("broker.config", "broker.server", "broker.common"),
    },
    "broker": {
        *("shared", "broker.runtime", "broker.identity", "broker.backends"),
        *("broker.config", "broker.server"),
        *("broker.common", "broker.control", "broker.dataplane"),
    },
    "testing": {
        *("shared", "credentials", "errors", "client.wire", "client.core", "client.http"),
        *("client", "broker.runtime", "broker.identity", "broker.backends", "broker"),
        *("broker.common", "broker.control", "broker.dataplane"),
        "broker.server",  # the local broker's server: uvicorn's, with the broker's fresh Date
    },
    "mcp": {
        *("shared", "credentials", "errors", "client.wire", "client.core", "client.http"),
        "client",
    },
    "cli": {
        *("shared", "credentials", "errors", "client.wire", "client.core", "client.http"),
        *("client", "mcp", "testing"),  # testing: the dev/demo commands run the local broker
        *("broker.config", "broker.server", "broker"),  # broker check/serve
    },
    "api": {"shared"},  # the top-level __init__: its other names are imported on first use
}
"""The folders as layers, bottom to top: the credential framework below the client (wire, core,
http, then the sync and async shells), the broker beside it (runtime, identity, backends, what
both planes share, the control plane and the data plane side by side, then the app), never
importing it; testing above both, the CLI on top. ``shared``: the top-level
private modules (``_driver``, ``_upstream``, ``_version``, ...) both halves may use."""


def _layer(name: str) -> str:
    if name == "":
        return "api"
    if "." not in name and name.startswith("_"):
        return "shared"
    if name == "hookspecs":  # at the top level for plugin authors; part of the framework
        return "credentials"
    deepest = [layer for layer in LAYERS if in_group(name, {layer})]
    assert deepest, f"{name}: in no layer of LAYERS (add its folder there, and to the docs)"
    return max(deepest, key=len)


def _layer_breaches(pkg: Package) -> list[str]:
    return [
        f"{imp.source} ({_layer(imp.source)}) imports {imp.target} ({_layer(imp.target)}) "
        f"({pkg.where(imp)})"
        for module in sorted(pkg.paths)
        for imp in pkg.internal(module)
        if _layer(imp.target) != _layer(module) and _layer(imp.target) not in LAYERS[_layer(module)]
    ]


def test_every_module_imports_only_its_layer_or_below() -> None:
    _none(_layer_breaches(PKG), "imports up or across the layers (LAYERS)")


def test_the_layer_check_sees_an_import_up(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "client/wire/_x.py": "from .. import _client\n",
            "client/_client.py": "",
            "_shared.py": "",
        },
    )
    assert _layer_breaches(pkg) == [
        "client.wire._x (client.wire) imports client._client (client) (client/wire/_x.py:1)"
    ]


# ------------------------------------------------------------------------------ what is reached

IO_FREE = {"client._base", "_driver"}
"""Beside every module of client/wire and client/core: what the sync and the async shells
share, decisions only, no I/O, no httpx."""
IO = {"httpx", "httpcore", "socket", "ssl", "requests", "urllib3"}


def test_the_io_free_core_never_reaches_httpx_even_transitively() -> None:
    core = sorted(m for m in PKG.paths if in_group(m, {"client.wire", "client.core"}))
    assert len(core) > 5, core
    found = [
        hit
        for module in [*core, *sorted(IO_FREE)]
        for hit in reached_imports(PKG, module, names=IO)
    ]
    for module in core:  # client/wire and client/core never reach client/http at all
        found += [f"{module} reaches {m}" for m in _reach(module) if in_group(m, {"client.http"})]
    for module in [*core, *sorted(IO_FREE)]:
        found += [
            f"{module} imports asyncio ({PKG.where(imp)})"
            for imp in PKG.external(module)
            if imp.target == "asyncio"
        ]
    _none(found, "the I/O-free core (client/wire, client/core, client._base, _driver) does I/O")


def _reach(module: str) -> list[str]:
    return sorted(reached(PKG, module))


def test_the_reach_check_follows_imports_through_other_modules(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "core/_a.py": "from .. import errors\n",
            "errors.py": "def f():\n    from . import _net\n",
            "_net.py": "import httpx\nimport json\n",
        },
    )
    assert reached_imports(pkg, "core._a", names={"httpx"}) == [
        "core._a -> errors -> _net imports httpx (_net.py:1)"
    ]
    assert reached_imports(pkg, "_net", names=set()) == ["_net imports httpx (_net.py:1)"]


RUNTIME_EXTERNALS = {"python_multipart"}
"""What the runtime may import beyond the standard library: the one streaming multipart parser
(its image, deploy/runtime/Containerfile, installs exactly the package and this)."""


def test_the_runtime_uses_the_standard_library_only() -> None:
    """It is forked per sandbox and runs in a container image of its own: everything a
    runtime module reaches (the package ``__init__`` files above it included: a fresh
    interpreter runs them) imports the standard library only, lazily or not, besides
    :data:`RUNTIME_EXTERNALS`."""
    runtime = sorted(m for m in PKG.paths if in_group(m, {"broker.runtime"}))
    assert "broker.runtime.__main__" in runtime
    found = reached_imports(PKG, *runtime, names=set(), parents=True)
    found = [f for f in found if f.split(" imports ")[1].split(" ")[0] not in RUNTIME_EXTERNALS]
    _none(found, "broker/runtime reaches a module that is not of the standard library")


def test_the_stdlib_check_sees_a_parent_package_and_a_lazy_import(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "import json\n",
            "run/_x.py": "def f():\n    import python_multipart\n",
            "run/_y.py": "import os\n",
        },
    )
    (pkg.root / "run" / "__init__.py").write_text("import starlette\n")
    pkg = Package(pkg.root, "pkg")
    assert reached_imports(pkg, "run._x", names=set(), parents=True) == [
        "run._x -> run imports starlette (run/__init__.py:1)",
        "run._x imports python_multipart (run/_x.py:2, in a function)",
    ]
    assert reached_imports(pkg, "run._y", names=set()) == []


# ------------------------------------------------------------------------------ shells


def _third_party(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


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
        "client/_ports.py",
        "client/_port_forward.py",
    ):
        assert "asyncio" not in _third_party(SRC / module), module


def test_async_modules_use_the_async_http_client_only() -> None:
    for module in (
        "client/http/_async_transport.py",
        "client/_async_client.py",
        "client/_async_files.py",
        "client/_async_ports.py",
        "client/_async_port_forward.py",
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
    from k8s_agent_sandbox_awx.client._base import ClientBase
    from k8s_agent_sandbox_awx.client.wire._dialect import Dialect

    for base in (ClientBase, Dialect):
        with pytest.raises(TypeError, match="abstract"):
            base()  # type: ignore[abstract]


# ------------------------------------------------------------------------------ plugins


def _public_names() -> dict[str, set[str]]:
    """The package's public modules (dotted below it) -> the names each exports: the package
    (``__all__``, the error names it keeps for compatibility, its public modules), ``testing``,
    ``hookspecs`` (where plugin authors import it) and ``errors``."""
    from k8s_agent_sandbox_awx import errors, hookspecs, testing

    top = {*k8s_agent_sandbox_awx.__all__, *errors.__all__, "errors", "hookspecs", "testing"}
    return {
        "": top,
        "testing": set(testing.__all__),
        "hookspecs": set(hookspecs.__all__),
        "errors": set(errors.__all__),
    }


def test_plugins_use_public_names_only() -> None:
    files = sorted(PLUGINS.glob("*/**/*.py"))
    assert len(files) > 4, files
    found = [hit for path in files for hit in private_uses(path, PACKAGE, _public_names())]
    _none(
        [hit.replace(str(PLUGINS.parent) + "/", "") for hit in found],
        "plugins/ use names the package and k8s_agent_sandbox_awx.testing do not export",
    )


def test_the_public_names_check_sees_private_imports(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import pkg.client._x\n"
        "from pkg import Sandbox, _secret\n"
        "from pkg.testing import LocalBroker\n"
        "from pkg.client import _y\n"
        "import pkg\n"
        "pkg._cache.clear()\n"
    )
    public = {"": {"Sandbox"}, "testing": {"LocalBroker"}}
    assert [hit.replace(f"{tmp_path}/", "") for hit in private_uses(plugin, "pkg", public)] == [
        "plugin.py:1 imports pkg.client._x",
        "plugin.py:2 imports _secret from pkg",
        "plugin.py:4 imports from pkg.client",
        "plugin.py:6 uses pkg..._cache",
    ]


# ------------------------------------------------------------------------------ the map itself

ROOT = SRC.parents[1]


def test_every_module_path_the_architecture_names_exists() -> None:
    """docs/architecture.md's module map (its ``text`` block: folders by indentation, the
    modules named in their lines) and its prose (backticked paths such as
    ``client/_client.py``) name only folders and modules that exist."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    _none(doc_module_gaps(doc, SRC, ROOT), "docs/architecture.md names what does not exist")


def test_the_map_check_sees_a_folder_a_module_and_a_path_made_up(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {"_urls.py": "", "client/_client.py": "", "client/wire/_protocol.py": ""},
    )
    doc = textwrap.dedent("""\
        The client starts in `client/_client.py`, then `client/_nowhere.py`.

        ```text
        pkg/
          _urls.py     the one URL rule
          client/      the client
            wire/      the wire: _protocol (from _urls), _invented
            _client    Sandbox
          gone/        a folder that is not there
        ```
        """)
    gaps = doc_module_gaps(doc, pkg.root, tmp_path)
    assert gaps == [
        "line 7: module _invented (in client/)",
        "line 9: folder gone/",
        "line 1: path client/_nowhere.py",
    ]
    fixed = doc.replace(", _invented", "").replace("`client/_nowhere.py`", "`client/wire/`")
    fixed = fixed.replace("  gone/        a folder that is not there\n", "")
    assert doc_module_gaps(fixed, pkg.root, tmp_path) == []
