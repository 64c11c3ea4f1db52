"""pytest-xdist workers side by side: each its own temporary directory.

A local broker sweeps the temporary directory for dead brokers' leftovers as it starts, and some
tests count what is left in it; with workers sharing one directory, one worker's broker would
sweep another's test leftovers mid-test. So each worker gets a private ``TMPDIR`` (its runtimes,
API servers and commands inherit it), removed when the worker ends. Ports are never fixed
(every server binds port 0) and session brokers are per worker, so nothing else is shared.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

_ENV = "AGENT_SANDBOX_TEST_WORKER_TMPDIR"


def worker_name() -> str | None:
    """The xdist worker this process is (``gw0``, ...), or None outside xdist."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def use_private_tmpdir() -> None:
    """In an xdist worker: point ``TMPDIR`` (and :mod:`tempfile`) at a new directory of its
    own. Elsewhere: nothing."""
    worker = worker_name()
    if worker is None or os.environ.get(_ENV):
        return
    path = tempfile.mkdtemp(prefix=f"awx-tests-{worker}-")
    os.environ["TMPDIR"] = os.environ[_ENV] = path
    tempfile.tempdir = path


def remove_private_tmpdir() -> None:
    """Remove the worker's directory (what its tests left: they check their own clean-up)."""
    path = os.environ.pop(_ENV, None)
    if path is not None:
        with contextlib.suppress(Exception):  # a tree too deep for rmtree is left to the OS
            shutil.rmtree(path)
