"""The docs tell a newcomer what works today (issue 10, "docs slips").

- no install by name from the package index: a different, unrelated package has this name there
  today, so until a release exists every install command installs from this repository;
- the README says to use a virtual environment and which Python is needed;
- examples read only files they made; benchmark figures are found in the repository.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        *(p for p in (ROOT / "docs").glob("*.md") if p.name != "changelog.md"),
        *(ROOT / "plugins").glob("*/README.md"),
    ]
)
SOURCES = sorted((ROOT / "src").rglob("*.py"))
# our distribution names: the core and its plugins (k8s-agent-sandbox-awx-github-actions, ...)
OURS = re.compile(
    r"""^["'(]*k8s-agent-sandbox-awx(-[a-z0-9-]+)?(\[[^\]]*\])?([<>=!~@].*)?["'),;.:]*$"""
)

PROSE = {"in", "from", "then", "and", "or", "to", "for", "with"}


def _installs_by_name(text: str) -> list[str]:
    found = []
    for line in text.splitlines():
        for command in re.findall(r"pip install\s+(.*)", line):
            for word in command.split("#", 1)[0].split():
                if word in PROSE:  # the command ended, the sentence goes on
                    break
                if OURS.match(word):
                    found.append(f"{line.strip()}  <- {word}")
    return found


@pytest.mark.parametrize("path", PAGES + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_is_installed_by_name_from_the_package_index(path: Path) -> None:
    assert _installs_by_name(path.read_text()) == []


def test_the_install_check_sees_the_slips() -> None:
    for slip in (
        "pip install k8s-agent-sandbox-awx",
        'pip install "k8s-agent-sandbox-awx[local]"   # the local broker',
        "  - run: pip install k8s-agent-sandbox-awx k8s-agent-sandbox-awx-github-actions",
        "pip install 'k8s-agent-sandbox-awx>=0.5'",
        """    f'(pip install "k8s-agent-sandbox-awx[local]"); import failed: {exc}',""",
    ):
        assert _installs_by_name(slip), slip
    for fine in (
        'python3 -m pip install -e ".[local]"',
        "pip install -e plugins/google-cloud",
        'pip install -e ".[local]" in a clone of the k8s-agent-sandbox-awx repository',
    ):
        assert not _installs_by_name(fine), fine


def test_the_readme_says_venv_and_python_version() -> None:
    readme = (ROOT / "README.md").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    minimum = pyproject["project"]["requires-python"].removeprefix(">=")
    assert minimum == "3.11"
    assert f"Python {minimum}" in readme or f"Python >= {minimum}" in readme
    assert "python3 -m venv .venv" in readme and ". .venv/bin/activate" in readme
    # its two copy-paste commands: install + demo in the venv, and the whole test suite
    assert re.search(r"python3 -m pip install -e \"\.\[local\]\" && agent-sandbox-awx demo", readme)
    assert "bash .ci/run" in readme


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_read_only_files_they_made(path: Path) -> None:
    """A sandbox file an example reads was written (or made by a command) earlier in it."""
    for block in _python_blocks(path.read_text()):
        for match in re.finditer(r"\.(?:read_to|read|iter_bytes)\(\s*\"([^\"]+)\"", block):
            before = block[: match.start()]
            assert match.group(1) in before, f"{path.name}: reads {match.group(1)!r} it never made"


def test_benchmark_figures_are_located_in_the_repository() -> None:
    client = (ROOT / "docs" / "client.md").read_text()
    section = client.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    assert "issue" not in section
    assert "bench/" in section
    pages = re.findall(r"\]\(([a-z-]+\.md)(?:#[a-z0-9-]+)?\)", section)
    assert pages, "link the pages that hold the figures"
    for page in pages:
        assert re.search(r"\d ms|µs", (ROOT / "docs" / page).read_text()), page


def test_the_readme_lists_every_page_the_docs_index_lists() -> None:
    """docs/index.md's pages (its links to other pages of docs/) are all in the README's list
    (it lacked the broker, performance and migrating pages, issue 23)."""
    index = (ROOT / "docs" / "index.md").read_text()
    readme = (ROOT / "README.md").read_text()
    pages = set(re.findall(r"\]\(([a-z][\w/-]*\.md)\)", index))
    assert len(pages) >= 10, pages
    missing = sorted(page for page in pages if f"](docs/{page}" not in readme)
    assert missing == [], missing


def test_the_fixture_docs_say_it_needs_pytest() -> None:
    """No extra installs pytest: the page on the ``sandbox_broker`` fixture says so."""
    text = (ROOT / "docs" / "local-broker.md").read_text()
    section = text.split("## In tests: the `sandbox_broker` fixture", 1)[1].split("\n## ", 1)[0]
    assert "It needs pytest" in section and "no extra installs" in section


# -- a newcomer's trial (s25): what the examples and the install lines must never say -----------

USER_PAGES = sorted([*PAGES, *(ROOT / "docs" / "broker").glob("*.md")])
VARIABLE = re.compile(r"\b(?:AGENT_SANDBOX|SANDBOX|BROKER|KSA)_[A-Z0-9_]+\b")
# where a variable the docs name is read: the package, the plugins, the test suite and CI
READERS = [
    *SOURCES,
    *(ROOT / "plugins").glob("*/src/**/*.py"),
    *(ROOT / "tests").rglob("*.py"),
    *(p for p in (ROOT / ".ci").iterdir() if p.is_file()),
]


def test_every_variable_the_docs_name_is_read_somewhere() -> None:
    """A variable named in the docs that nothing reads is a stale or misspelt name."""
    code = "\n".join(p.read_text(errors="replace") for p in READERS if p != Path(__file__))
    named = {v for page in USER_PAGES for v in VARIABLE.findall(page.read_text())}
    assert len(named) > 30, named
    assert sorted(v for v in named if v not in code) == []


def _moves_across_roots(block: str) -> list[str]:
    """``files.move``/``rename`` calls with two literal paths in different roots (a relative
    path is in /app): the runtime refuses them (``cross_root``)."""

    def root(path: str) -> str:
        return "/workspace" if path.startswith(("/workspace/", "/app/workspace/")) else "/app"

    calls = re.finditer(r"\.(?:move|rename)\(\s*\"([^\"]+)\",\s*\"([^\"]+)\"", block)
    return [m.group(0) for m in calls if root(m.group(1)) != root(m.group(2))]


def _timeouts_over_the_cap(block: str) -> list[str]:
    """``commands.run(..., timeout=N)`` with N over the runtimes' default cap (300 s,
    ``SANDBOX_EXEC_TIMEOUT_SECONDS``): a ``400`` from the runtime, background or not."""
    calls = re.finditer(r"commands\.run\([^)]*?\btimeout=(\d+)", block, flags=re.S)
    return [m.group(0) for m in calls if int(m.group(1)) > 300]


@pytest.mark.parametrize("path", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_keep_to_the_runtime_rules(path: Path) -> None:
    for block in _python_blocks(path.read_text()):
        assert _moves_across_roots(block) == [], path.name
        assert _timeouts_over_the_cap(block) == [], path.name


def test_the_runtime_rule_checks_see_the_slips() -> None:
    assert _moves_across_roots('sb.files.move("data/a.csv", "/workspace/a.csv")')
    assert _moves_across_roots('sb.files.rename("/workspace/a", "/app/a")')
    assert not _moves_across_roots('sb.files.move("data/a.csv", "/app/data/b.csv")')
    assert not _moves_across_roots('sb.files.move("/workspace/a", "/app/workspace/b")')
    assert _timeouts_over_the_cap('sb.commands.run("x", background=True, timeout=3600)')
    assert not _timeouts_over_the_cap('sb.commands.run("x", background=True, timeout=300)')


def _plugin_without_the_core(line: str) -> bool:
    """A ``pip install`` of a plugin's directory that does not install the core from the clone
    in the same command: pip would take the core's name from the package index."""
    for command in re.findall(r"pip install\s+([^#`]*)", line):
        words = [w.strip("\"'") for w in command.split()]
        if not any("plugins/" in w for w in words):
            continue
        core = re.compile(r"^(\.|(.*/)?k8s-agent-sandbox-awx/?)(\[[^\]]*\])?$")
        if not any(core.match(w) for w in words):
            return True
    return False


@pytest.mark.parametrize("path", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_plugin_is_installed_with_the_core_from_the_clone(path: Path) -> None:
    slips = [line for line in path.read_text().splitlines() if _plugin_without_the_core(line)]
    assert slips == []


def test_the_plugin_install_check_sees_the_slips() -> None:
    assert _plugin_without_the_core('pip install -e "plugins/github-actions[test]"')
    assert _plugin_without_the_core("python3 -m pip install ./plugins/google-cloud")
    for fine in (
        'pip install -e ".[local]" -e "plugins/github-actions[test]"',
        "python3 -m pip install . ./plugins/google-cloud     # on Google Cloud",
        "- run: pip install ./k8s-agent-sandbox-awx ./k8s-agent-sandbox-awx/plugins/github-actions",
        "`python3 -m pip install -e . -e plugins/github-actions -e plugins/google-cloud`.",
    ):
        assert not _plugin_without_the_core(fine), fine
