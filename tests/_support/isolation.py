"""The isolation of the test session's local sandboxes (``AGENT_SANDBOX_TEST_ISOLATION``).

``none`` (default: host processes, the fastest), ``bwrap`` (every local broker and backend a
test makes without ``isolation=`` runs its sandboxes in bubblewrap; CI runs a subset so, see
docs/local-broker.md) or ``auto``. It becomes the library's ``AGENT_SANDBOX_LOCAL_ISOLATION``
for this process and what it starts (xdist workers, child pytests).
"""

from __future__ import annotations

import os

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
