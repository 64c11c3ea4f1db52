"""The isolation of the test session's local sandboxes (``AGENT_SANDBOX_TEST_ISOLATION``).

``none`` (default: host processes, the fastest), ``bwrap`` (every local broker and backend a
test makes without ``isolation=`` runs its sandboxes in bubblewrap; CI runs a subset so, see
docs/local-broker.md) or ``auto``. It becomes the library's ``AGENT_SANDBOX_LOCAL_ISOLATION``
for this process and what it starts (xdist workers, child pytests).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx.broker.backends.local import _bubblewrap

TEST_ISOLATION_ENV = "AGENT_SANDBOX_TEST_ISOLATION"
LIBRARY_ENV = "AGENT_SANDBOX_LOCAL_ISOLATION"
MODES = ("none", "bwrap", "auto")


def select() -> str:
    """The session's isolation, from ``$AGENT_SANDBOX_TEST_ISOLATION`` (ValueError naming the
    choices for anything else); sets the library's variable to it."""
    mode = os.environ.get(TEST_ISOLATION_ENV) or "none"
    if mode not in MODES:
        raise ValueError(f"{TEST_ISOLATION_ENV}={mode!r}: give one of {', '.join(MODES)}")
    os.environ[LIBRARY_ENV] = mode
    return mode


REQUIRE_ENV = "AGENT_SANDBOX_REQUIRE_BWRAP"
REQUIRED = os.environ.get(REQUIRE_ENV) == "1"
"""``AGENT_SANDBOX_REQUIRE_BWRAP=1`` (CI sets it): a test that needs a working bwrap fails
without one instead of skipping."""


def need_bwrap() -> None:
    """Skip the test (fail it with ``AGENT_SANDBOX_REQUIRE_BWRAP=1``) where bwrap cannot run."""
    probe = _bubblewrap.probe_bwrap()
    if probe.works:
        return
    if REQUIRED:
        pytest.fail(f"{REQUIRE_ENV}=1, but {probe.detail}", pytrace=False)
    pytest.skip(f"bubblewrap cannot run here: {probe.detail}")


@contextlib.contextmanager
def fake_bwrap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str | None
) -> Iterator[None]:
    """PATH with only ``tmp_path/bin``: a ``bwrap`` running ``script`` there, or none; the
    probe forgotten before and after (it is cached per process)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if script is not None:
        fake = bin_dir / "bwrap"
        fake.write_text(f"#!/bin/sh\n{script}\n")
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    _bubblewrap.forget_probe()
    monkeypatch.setenv("PATH", str(bin_dir))
    try:
        yield
    finally:
        _bubblewrap.forget_probe()


def sandboxes_isolated() -> bool:
    """Whether the local sandboxes this session makes without ``isolation=`` run in bubblewrap
    (its ``$AGENT_SANDBOX_LOCAL_ISOLATION``: ``bwrap``, or ``auto`` where bwrap works)."""
    try:
        return _bubblewrap.choose(None).mode == "bwrap"
    except (ValueError, _bubblewrap.IsolationUnavailable):
        return False  # the brokers fail to start, and say why


def host_processes_only(why: str) -> pytest.MarkDecorator:
    """Skip a test of the host-process layout when the session's sandboxes are isolated
    (``AGENT_SANDBOX_TEST_ISOLATION=bwrap``), saying ``why`` it does not apply there."""
    return pytest.mark.skipif(sandboxes_isolated(), reason=f"host-process sandboxes only: {why}")


ROOTS_ARE_MOUNTS = (
    "in bubblewrap /app and /workspace are mount points, which a command cannot remove or "
    "replace (test_isolation.py::test_the_sandbox_roots_cannot_be_replaced)"
)
HOST_PIDS = (
    "it looks a command's pid up in the host's /proc, and an isolated sandbox's pids are its "
    "own PID namespace's (test_isolation.py::test_deleting_a_sandbox_kills_everything_it_started)"
)
HOST_TMP = (
    "the sandbox is given a path under the test's temporary directory, which an isolated "
    "sandbox does not see (its /tmp is its own, the host's temporary directory is hidden)"
)
TCP_PORTS = (
    "it looks at the runtime's TCP port, and an isolated built-in runtime listens on a Unix "
    "socket (test_isolation.py::test_a_tcp_runtime_cannot_serve_a_sandbox_without_network)"
)
PID_LAYOUT = (
    "its pid arithmetic (ns_last_pid) is the host-process layout's: a supervisor and its "
    "runtime, without bwrap and the namespace's init between them"
)
