"""docs/writing-plugins.md's "Testing a plugin" examples run, against its example provider.

The example provider is "installed" for a child pytest run only: its module and a dist-info
directory with its entry point go on that child's PYTHONPATH, so this process and the other
tests never see an ``acme-ci`` plugin.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs" / "writing-plugins.md"

pytestmark = pytest.mark.skipif(not DOCS.is_file(), reason="needs the repository's docs/")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.slow
def test_the_testing_section_examples_pass(tmp_path: Path) -> None:
    text = DOCS.read_text()
    [provider] = [
        b for b in _python_blocks(text) if '"""Credential provider for Acme CI jobs."""' in b
    ]
    section = text[text.index("## Testing a plugin") :]
    conftest, unit, asyncs, e2e = _python_blocks(section)[:4]

    site = tmp_path / "site"
    (site / "acme_agent_sandbox").mkdir(parents=True)
    (site / "acme_agent_sandbox" / "__init__.py").write_text(provider)
    dist_info = site / "acme_agent_sandbox-1.0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: acme-agent-sandbox\nVersion: 1.0.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[k8s_agent_sandbox_awx.providers]\nacme-ci = acme_agent_sandbox\n"
    )
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(conftest)
    # The async examples test an async hook; the example provider has the sync one only, so
    # only the chain example (which works for both) runs here.
    chain_only = "@pytest.mark.asyncio" + asyncs.split("@pytest.mark.asyncio")[2]
    (tests / "test_provider.py").write_text(unit + "\n\n" + chain_only)
    (tests / "test_e2e.py").write_text(e2e)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
    )

    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_SANDBOX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\b8 passed\b", done.stdout), done.stdout[-2000:]
