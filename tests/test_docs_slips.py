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
