"""A runtime without the file API, for tests: the local runtime with its ``/fs/*`` routes
removed, as the runtimes deployed before v0.4.0 (they answer ``404`` without a ``code``)."""

from __future__ import annotations

import sys

from k8s_agent_sandbox_awx.testing import _fs, _runtime

_fs.GET_ROUTES = frozenset()
_fs.POST_ROUTES = frozenset()

if __name__ == "__main__":
    sys.exit(_runtime.main())
