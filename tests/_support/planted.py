"""What the import-path and environment tests plant in a sandbox (tests/broker/
test_runtime_import_path.py, test_create_env.py): a module that proves it ran, the runtime's two
ways to start, and a local broker whose callers have the scopes a test gives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from k8s_agent_sandbox_awx.testing import LocalBroker, Policy, caller_namespace

PLANTED = (
    "import os\n"
    "open(os.path.join(os.environ.get('SANDBOX_WORKSPACE_DIR', '.'), 'PWNED'), 'w').write('x')\n"
    "raise OSError('planted')\n"
)
"""A module that proves it ran (a file in the workspace), then fails as a C library without
the function would (the move goes on)."""

RUNTIME_TEMPLATES: dict[str, str | list[str] | None] = {
    "python": None,
    "module": "{python} -m k8s_agent_sandbox_awx.broker.runtime --unix-socket {socket}",
}
"""The built-in runtime (forked, or a new interpreter in bubblewrap) and the same started as
a template's command (always a new interpreter, which reads its environment at start)."""


@contextlib.contextmanager
def scoped_broker(isolation: str, scopes: Sequence[str]) -> Iterator[LocalBroker]:
    """A local broker of :data:`RUNTIME_TEMPLATES` in ``isolation`` whose Kubernetes callers
    are granted ``scopes`` only."""
    policy = Policy(
        templates=tuple(RUNTIME_TEMPLATES), namespace=caller_namespace, scopes=tuple(scopes)
    )
    with LocalBroker(
        isolation=isolation, warn=False, templates=RUNTIME_TEMPLATES, kubernetes_policy=policy
    ) as broker:
        yield broker
