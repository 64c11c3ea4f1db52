"""The overlay touches upstream ``k8s-agent-sandbox`` in one documented place only.

An upstream refactor must break here, in CI, and not at a user's site: every module of the
overlay imports upstream names only through ``_upstream.py``, and that module imports exactly the
documented public names (``UPSTREAM_NAMES``, listed in ``docs/upstream.md``).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx import _upstream

pytestmark = pytest.mark.upstream  # the seam itself

SRC = Path(_upstream.__file__).resolve().parent
DOCS = SRC.parents[1] / "docs" / "upstream.md"


def _upstream_imports(path: Path) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "k8s_agent_sandbox":
                found.extend((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "k8s_agent_sandbox":
                    found.append((alias.name, "*"))
    return found


def test_only_the_upstream_module_imports_upstream() -> None:
    offenders = {
        str(path.relative_to(SRC)): imports
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "_upstream.py" and (imports := _upstream_imports(path))
    }
    assert offenders == {}, (
        "import upstream names through k8s_agent_sandbox_awx._upstream, not directly"
    )


def test_upstream_module_imports_exactly_the_documented_names() -> None:
    imported = sorted(_upstream_imports(Path(_upstream.__file__)))
    documented = sorted(
        (module, name) for module, names in _upstream.UPSTREAM_NAMES.items() for name in names
    )
    assert imported == documented


def test_documented_names_exist_upstream_and_are_listed_in_docs() -> None:
    text = DOCS.read_text()
    for module, names in _upstream.UPSTREAM_NAMES.items():
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name), f"{module}.{name} is gone upstream"
            assert f"`{module}.{name}`" in text, f"{module}.{name} is not in docs/upstream.md"
