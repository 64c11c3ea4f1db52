""".ci/run's exit status is its own: the EXIT trap that stops the background side job must not
turn a green run red (it did: ``kill`` of a side job that had already ended returned 1 under
``set -e``, and CI failed after printing ``== done``), nor a red run green."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[1] / ".ci" / "run"


def _exit_trap() -> str:
    match = re.search(r"^trap '.*?' EXIT$", RUN.read_text(), re.MULTILINE | re.DOTALL)
    assert match, ".ci/run has no EXIT trap (this test reads it)"
    return match.group(0)


@pytest.mark.parametrize("own_status", [0, 3])
def test_the_exit_trap_keeps_the_scripts_status(tmp_path: Path, own_status: int) -> None:
    script = "\n".join(
        [
            "set -euo pipefail",
            f'side_log="{tmp_path / "side.log"}"',
            "sleep 0.05 &",
            "side_pid=$!",
            _exit_trap(),
            'wait "$side_pid"',  # the side job has ended when the trap runs, as in CI
            "echo '== done'",
            f"exit {own_status}",
        ]
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert "== done" in done.stdout
    assert done.returncode == own_status, done.stderr
