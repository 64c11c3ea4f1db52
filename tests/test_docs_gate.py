"""The docs gate of .ci/run fails on any mkdocs warning (a broken link above all).

``.ci/run`` and these tests call the same script, ``.ci/docs-check``, so what is proven here is
what CI runs: the real docs pass, and a copy of them with one broken link fails.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS_CHECK = ROOT / ".ci" / "docs-check"


def _docs_check(project: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(DOCS_CHECK), sys.executable, str(project)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy_of_the_docs(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copy2(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    return project


def test_ci_run_builds_the_docs_through_the_docs_check_script() -> None:
    run = (ROOT / ".ci" / "run").read_text()
    assert 'bash .ci/docs-check "$PY"' in run
    assert "mkdocs build" not in run, "build the docs only through .ci/docs-check"
    # mkdocs counts strict-mode warnings from what it prints: --quiet makes them pass
    [build] = [line for line in DOCS_CHECK.read_text().splitlines() if "mkdocs build" in line]
    assert "--strict" in build and "--quiet" not in build and " -q" not in build


def test_the_real_docs_pass_the_gate() -> None:
    result = _docs_check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "link",
    [
        "[gone](no-such-page.md)",  # a page that does not exist
        "[outside](../bench/bench_broker.py)",  # a file outside docs/
        "[anchor](client.md#no-such-section)",  # an anchor that does not exist
    ],
)
def test_the_gate_fails_on_a_broken_link(link: str, tmp_path: Path) -> None:
    project = _copy_of_the_docs(tmp_path)
    assert _docs_check(project).returncode == 0  # the copy itself passes
    index = project / "docs" / "index.md"
    index.write_text(index.read_text() + f"\nSee {link}.\n")
    result = _docs_check(project)
    assert result.returncode != 0, result.stdout + result.stderr
    target = link.split("(", 1)[1].rstrip(")").split("#")[-1]
    assert target in result.stdout + result.stderr


def test_the_gate_fails_on_a_warning_even_if_mkdocs_exits_0(tmp_path: Path) -> None:
    """The second guard: a WARNING line fails the gate whatever mkdocs's exit status."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'WARNING -  something is off'\nexit 0\n")
    fake.chmod(0o755)
    result = subprocess.run(
        ["bash", str(DOCS_CHECK), str(fake), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "something is off" in result.stdout
