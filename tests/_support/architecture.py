"""The checkers behind ``tests/test_architecture.py``: a package's import graph read from its
source (every import, function-level ones included; imports only type checkers see left out),
its cycles between modules and between folders, long functions, walls between groups, what a
module reaches, and imports of another package's private names.

Every checker takes the package's folder and name, so that its self-test can run it on a small
package written to a temporary folder and watch it fail.
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    """One import statement's target, as seen in ``source`` at ``line``: a module of the
    package (``external`` false: its dotted name below the package, ``""`` for the package's
    own ``__init__``) or another distribution's top-level name (``external``: ``httpx``)."""

    source: str
    target: str
    line: int
    lazy: bool  # inside a function: runs when the function does
    external: bool


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class Package:
    """The modules of the package ``name`` in the folder ``root``, by dotted name below it
    (``client.wire._protocol``; a package by its own name, ``client.wire``; the package's own
    ``__init__`` as ``""``), and what each imports."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name = root, name
        self.paths: dict[str, Path] = {}
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            self.paths[".".join(parts)] = path
        self.imports = {module: self._read(module) for module in self.paths}

    # ------------------------------------------------------------------ reading the imports

    def is_package(self, module: str) -> bool:
        return self.paths[module].name == "__init__.py"

    def _read(self, module: str) -> list[Import]:
        path = self.paths[module]
        base = module if self.is_package(module) else module.rpartition(".")[0]
        found: list[Import] = []

        def add(dotted: str, names: Iterable[str], line: int, lazy: bool) -> None:
            for alias in names:
                sub = f"{dotted}.{alias}" if dotted else alias
                target = sub if sub in self.paths else dotted
                if target != module:
                    found.append(Import(module, target, line, lazy, external=False))

        def visit(node: ast.AST, lazy: bool) -> None:
            if isinstance(node, ast.If) and _is_type_checking(node):
                for child in node.orelse:
                    visit(child, lazy)
                return
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top, _, rest = alias.name.partition(".")
                    if top != self.name:
                        found.append(Import(module, top, node.lineno, lazy, external=True))
                    elif rest and rest != module:
                        found.append(Import(module, rest, node.lineno, lazy, external=False))
            elif isinstance(node, ast.ImportFrom):
                names = [alias.name for alias in node.names]
                if node.level == 0 and node.module:
                    top, _, rest = node.module.partition(".")
                    if top == self.name:
                        add(rest, names, node.lineno, lazy)
                    elif top != "__future__":
                        found.append(Import(module, top, node.lineno, lazy, external=True))
                elif node.level > 0:
                    parts = base.split(".") if base else []
                    parts = parts[: len(parts) - (node.level - 1)]
                    if node.module:
                        parts.append(node.module)
                    add(".".join(parts), names, node.lineno, lazy)
            inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            for child in ast.iter_child_nodes(node):
                visit(child, inner)

        visit(ast.parse(path.read_text(), filename=str(path)), False)
        return found

    # ------------------------------------------------------------------ the graphs

    def where(self, imp: Import) -> str:
        """``client/_base.py:12`` (``, in a function`` for a function-level import)."""
        path = self.paths[imp.source].relative_to(self.root)
        return f"{path}:{imp.line}" + (", in a function" if imp.lazy else "")

    def internal(self, module: str) -> list[Import]:
        return [imp for imp in self.imports[module] if not imp.external]

    def external(self, module: str) -> list[Import]:
        return [imp for imp in self.imports[module] if imp.external]

    def graph(self) -> dict[str, set[str]]:
        """Module -> the modules of the package it imports."""
        return {m: {imp.target for imp in self.internal(m)} for m in self.paths}

    def folder(self, module: str) -> str:
        """The node of ``module`` in the folder graph: the folder (sub-package) it is in, a
        package's ``__init__`` its own folder; a top-level module is a node of its own (the
        top-level files are separate pieces: ``errors``, ``hookspecs``, ``_driver``, ...; the
        package's ``__init__`` is ``""``)."""
        if module not in self.paths or self.is_package(module) or "." not in module:
            return module
        return module.rpartition(".")[0]

    def folder_graph(self) -> dict[str, set[str]]:
        graph: dict[str, set[str]] = {self.folder(m): set() for m in self.paths}
        for module in self.paths:
            for imp in self.internal(module):
                if self.folder(imp.target) != self.folder(module):
                    graph[self.folder(module)].add(self.folder(imp.target))
        return graph

    def folder_edge(self, a: str, b: str) -> list[Import]:
        """The imports that make folder ``a`` import folder ``b``."""
        return [
            imp
            for module in self.paths
            if self.folder(module) == a
            for imp in self.internal(module)
            if self.folder(imp.target) == b
        ]


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shortest_path(graph: Mapping[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The shortest path ``[start, ..., goal]`` along the graph's edges (at least one)."""
    parents: dict[str, str] = {}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        for nxt in sorted(graph.get(node, ())):
            if nxt == goal:
                path = [goal, node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return path[::-1]
            if nxt not in parents and nxt != start:
                parents[nxt] = node
                todo.append(nxt)
    return None


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One shortest cycle ``[a, ..., a]`` through each strongly connected component."""
    found = []
    for component in strongly_connected(graph):
        inside = {n: graph.get(n, set()) & set(component) for n in component}
        path = shortest_path(inside, component[0], component[0])
        assert path is not None
        found.append(path)
    return found


def describe_cycle(
    path: list[str], edge: Mapping[tuple[str, str], list[Import]], pkg: Package
) -> str:
    """``a -> b (a.py:3) -> a (b.py:7, in a function)``: each step with the imports making it."""
    text = path[0] or "<package>"
    for a, b in itertools.pairwise(path):
        places = ", ".join(pkg.where(imp) for imp in edge[a, b])
        text += f" -> {b or '<package>'} ({places})"
    return text


def module_cycles(pkg: Package) -> list[str]:
    """Each import cycle between modules, described (``describe_cycle``)."""
    edge: dict[tuple[str, str], list[Import]] = {}
    for module in pkg.paths:
        for imp in pkg.internal(module):
            edge.setdefault((module, imp.target), []).append(imp)
    return [describe_cycle(path, edge, pkg) for path in cycles(pkg.graph())]


def folder_cycles(pkg: Package) -> list[str]:
    """Each cycle between folders (a folder's modules import a folder that imports them back)."""
    graph = pkg.folder_graph()
    edge = {(a, b): pkg.folder_edge(a, b) for a in graph for b in graph[a]}
    return [describe_cycle(path, edge, pkg) for path in cycles(graph)]


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method (nested ones too) with its qualified name."""

    def walk(
        node: ast.AST, prefix: str
    ) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield prefix + child.name, child
                yield from walk(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def long_functions(pkg: Package, limit: int) -> list[str]:
    """``broker/_app.py:120 BrokerApp._forward: 107 lines`` for each function over ``limit``."""
    found = []
    for path in sorted(pkg.paths.values()):
        for qualname, node in _functions(ast.parse(path.read_text(), filename=str(path))):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                where = path.relative_to(pkg.root)
                found.append(f"{where}:{node.lineno} {qualname}: {lines} lines")
    return found


def in_group(module: str, groups: Iterable[str]) -> bool:
    """Whether ``module`` is one of ``groups`` or inside one (``client.wire`` is in ``client``)."""
    return any(module == g or module.startswith(g + ".") for g in groups)


def wall_breaches(pkg: Package, group: str, forbidden: Iterable[str]) -> list[str]:
    """``credentials._chain imports client._client (credentials/_chain.py:12)`` for each import
    from inside ``group`` of a module in one of the ``forbidden`` groups."""
    forbidden = set(forbidden)
    return [
        f"{module} imports {imp.target} ({pkg.where(imp)})"
        for module in sorted(pkg.paths)
        if in_group(module, {group})
        for imp in pkg.internal(module)
        if in_group(imp.target, forbidden)
    ]


def reached(pkg: Package, *starts: str, parents: bool = False) -> dict[str, list[str]]:
    """Every module the ``starts`` import, directly or through others, with the shortest chain
    ``[start, ..., module]`` to it (a start's chain is itself). ``parents``: importing ``a.b.c``
    runs ``a/__init__`` and ``a/b/__init__`` too (what a fresh interpreter does), so those count
    as reached."""
    chains: dict[str, list[str]] = {start: [start] for start in starts}
    todo = deque(starts)
    while todo:
        module = todo.popleft()
        nexts = {imp.target for imp in pkg.internal(module)}
        if parents and module:
            parts = module.split(".")
            nexts |= {".".join(parts[:i]) for i in range(len(parts))}
        for nxt in sorted(nexts):
            if nxt not in chains and nxt in pkg.paths:
                chains[nxt] = [*chains[module], nxt]
                todo.append(nxt)
    return chains


def reached_imports(
    pkg: Package, *starts: str, names: set[str], parents: bool = False
) -> list[str]:
    """``client.core._flow -> errors -> _http imports httpx (_http.py:3)``: each import of an
    external name in ``names`` by a module the ``starts`` reach, once, with the shortest chain
    to it (``names`` empty: every external name that is not of the standard library)."""
    found = []
    for module, chain in sorted(reached(pkg, *starts, parents=parents).items()):
        for imp in pkg.external(module):
            if imp.target in names or (not names and imp.target not in sys.stdlib_module_names):
                found.append(f"{' -> '.join(chain)} imports {imp.target} ({pkg.where(imp)})")
    return found


def private_uses(path: Path, package: str, public: Mapping[str, set[str]]) -> list[str]:
    """``plugins/x/y.py:3 imports k8s_agent_sandbox_awx.client._client`` for each import, by
    the file at ``path``, of a module of ``package`` that is not in ``public`` (dotted below
    it: ``""`` the package, ``testing``) or of a name that module does not export."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition(".")
                if top == package and rest not in public:
                    found.append(f"{path}:{node.lineno} imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top, _, rest = node.module.partition(".")
            if top != package:
                continue
            if rest not in public:
                found.append(f"{path}:{node.lineno} imports from {node.module}")
                continue
            for alias in node.names:
                if alias.name not in public[rest]:
                    found.append(f"{path}:{node.lineno} imports {alias.name} from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            chain = node.value
            while isinstance(chain, ast.Attribute):
                chain = chain.value
            if (
                isinstance(chain, ast.Name)
                and chain.id == package
                and not node.attr.startswith("__")
            ):
                found.append(f"{path}:{node.lineno} uses {package}...{node.attr}")
    return found


# -- the module paths a document names ---------------------------------------------------------

_MAP_FOLDER = re.compile(r"^( +)([a-z_][a-z0-9_]*)/(?:\s|$)")  # "  client/   ..." starts a folder
_MAP_MODULE = re.compile(r"(?<![\w./`-])(_[a-z][a-z0-9_]*|[a-z][a-z0-9_]*\.py)\b")
_PROSE_PATH = re.compile(r"`([\w.-]+(?:/[\w.-]+)*(?:\.py|/))`")


def _text_blocks(doc: str) -> Iterator[tuple[int, list[str]]]:
    """The fenced ``text`` blocks of a Markdown document: (the line number of its first line,
    its lines)."""
    block: list[str] | None = None
    start = 0
    for number, line in enumerate(doc.splitlines(), 1):
        if block is None and line.strip() == "```text":
            block, start = [], number + 1
        elif block is not None and line.strip() == "```":
            yield start, block
            block = None
        elif block is not None:
            block.append(line)


def _module_exists(name: str, folder: Path, *, below: bool) -> bool:
    """Whether module ``name`` (``_jwt``, ``errors.py``) is a module or package in ``folder``
    (or, ``below``, anywhere below it)."""
    stem = name.removesuffix(".py")
    if (folder / f"{stem}.py").is_file() or (folder / stem / "__init__.py").is_file():
        return True
    return below and (
        any(folder.rglob(f"{stem}.py")) or any(p.is_dir() for p in folder.rglob(stem))
    )


def doc_module_gaps(doc: str, src: Path, root: Path) -> list[str]:
    """The module paths document ``doc`` names that do not exist, as ``line N: name``.

    - Its module maps (the fenced ``text`` blocks whose lines name folders: ``  client/``,
      ``    wire/``, by indentation): every folder named at a line's start must exist below its
      parent folder (``src`` at the top), and every module named in a folder's lines
      (``_name``, or ``name.py``) must exist in that folder's top-level folder or at the
      package's top (``_jwt ... (normalise_url from _urls)``: ``_urls`` is the package's).
    - Its prose: every backticked path ending in ``.py`` or ``/`` with a ``/`` in it
      (``client/_client.py``, ``tests/_support/_oci.py``) must exist below ``root`` or
      ``src``.
    """
    gaps: list[str] = []
    for start, lines in _text_blocks(doc):
        stack: list[tuple[int, Path]] = []  # (indentation, folder) of the folders open
        for number, line in enumerate(lines, start):
            folder = _MAP_FOLDER.match(line)
            if folder is not None:
                indent = len(folder.group(1))
                while stack and stack[-1][0] >= indent:
                    stack.pop()
                path = (stack[-1][1] if stack else src) / folder.group(2)
                if not path.is_dir():
                    gaps.append(f"line {number}: folder {path.relative_to(src)}/")
                stack.append((indent, path))
                line = line[folder.end() :]
            top = stack[0][1] if stack else src
            for name in _MAP_MODULE.findall(line):
                known = _module_exists(name, top, below=True) or _module_exists(
                    name, src, below=False
                )
                if not known:
                    where = f"{top.relative_to(src)}/" if stack else "the package"
                    gaps.append(f"line {number}: module {name} (in {where})")
    for number, line in enumerate(doc.splitlines(), 1):
        for path in _PROSE_PATH.findall(line):
            if "/" in path.rstrip("/") and not any((base / path).exists() for base in (root, src)):
                gaps.append(f"line {number}: path {path}")
    return gaps
