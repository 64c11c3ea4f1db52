"""pytest-xdist workers side by side: each its own temporary directory; the Kubernetes tests on
two workers.

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
from typing import Any

GROUPS = {
    "tests/kube/test_real_node.py": "real-node",  # its own cluster: beside the kube groups
    # the Kubernetes tests in two groups of about equal time (353 s in all on an idle machine:
    # these four files 175 s, the others 177 s); one group held one worker for 361 s, two
    # thirds of CI's whole pytest phase (540 s) on an idle machine already
    "tests/kube/test_client_suite.py": "kube-2",
    "tests/kube/test_controller.py": "kube-2",
    "tests/kube/test_router_data_plane.py": "kube-2",
    "tests/kube/test_kube_api.py": "kube-2",
    "tests/kube/": "kube",
    "tests/client/test_large_files.py": "large-files",
    "tests/client/test_async_large_files.py": "large-files",
}
"""Test path -> group: under ``--dist loadgroup`` a group's tests run on one worker, one after
the other. The Kubernetes tests share ONE API server per process (~4.5 s to start and ~380 MB
each): two groups, two API servers (one took the run's longest worker); the large-file round
trips each keep a core busy, and three at once only slow each other (and every other worker)
down."""

_ENV = "AGENT_SANDBOX_TEST_WORKER_TMPDIR"
_MADE: list[str] = []  # the directory this process made (a child pytest inherits only _ENV)


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
    _MADE.append(path)


def remove_private_tmpdir() -> None:
    """Remove the worker's directory (what its tests left: they check their own clean-up), in
    the process that made it only: a pytest that a test runs inherits the variables, not it."""
    while _MADE:
        with contextlib.suppress(Exception):  # a tree too deep for rmtree is left to the OS
            shutil.rmtree(_MADE.pop())


def make_scheduler(config: Any, log: Any) -> Any:
    """Under ``--dist loadgroup``: xdist's load scheduling, with each group of ``GROUPS`` one
    work unit (one worker), the biggest units first (the Kubernetes tests start early), then
    every other test in collection order (``slow_first``). Other modes: None (xdist's own).
    xdist's loadgroup itself reads its groups from a suffix it appends to node ids, which
    pytest 9.2 no longer lets a plugin change (xdist 3.8 then splits every group): the group
    here is by path instead."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class PathGroups(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            for prefix, group in GROUPS.items():
                if nodeid.startswith(prefix):
                    return group
            return nodeid

    return PathGroups(config, log)


def slow_first(items: list[Any]) -> None:
    """In an xdist worker: the tests marked ``slow`` first (in place, otherwise in order), so
    the longest tests do not start last and hold the end of the run."""
    if worker_name() is not None:
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
