"""The package's public surface: version and lazy exports."""

from __future__ import annotations

import subprocess
import sys

import k8s_agent_sandbox_awx


def test_version_is_defined_once() -> None:
    from k8s_agent_sandbox_awx._version import __version__

    assert k8s_agent_sandbox_awx.__version__ == __version__


def test_import_does_not_load_upstream_or_httpx() -> None:
    code = (
        "import sys, k8s_agent_sandbox_awx; "
        "mods = ('k8s_agent_sandbox', 'httpx', 'kubernetes'); "
        "print(','.join(m for m in mods if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
