"""What the local stack says about itself (imported by the package, its modules and the CLI).

Each warning is true of the isolation it is shown for (docs/local-broker.md, "Isolation"):
:data:`NO_ISOLATION_WARNING` for host processes, :data:`BWRAP_ISOLATION_WARNING` for sandboxes
in namespaces of their own (bubblewrap), which are not a virtual machine."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..broker.backends.local._bubblewrap import Isolation

NO_ISOLATION_WARNING = (
    "local sandboxes are host processes with NO isolation: commands run as your user on this "
    "machine, with your files, your processes and your network (install bubblewrap for "
    "sandboxes in namespaces of their own). Use the local broker for development and tests "
    "only, never for untrusted code."
)
BWRAP_ISOLATION_WARNING = (
    "local sandboxes run in Linux namespaces of their own (bubblewrap), which are not a virtual "
    "machine. A sandbox sees no other process and cannot change the host's files: it writes "
    "only its /app, /workspace and a private /tmp, /run and /dev. But it reads the host files "
    "your user can read (your home directory's keys and tokens included; not the broker's "
    "temporary directory), shares the host's kernel (a kernel bug is an escape), runs with your "
    "user id (root in a sandbox is root on the host, without capabilities), has no CPU, memory "
    "or disk limits, and shares the host's network, loopback services included, unless its "
    "policy turns the network off. Use the local broker for development and tests only, never "
    "for untrusted code."
)
EXTRA_HINT = (
    'the local broker needs the [local] extra: python3 -m pip install -e ".[local]" in a clone of '
    "the k8s-agent-sandbox-awx repository"
)


def isolation_warning(mode: str | None) -> str:
    """The warning for sandboxes isolated as ``mode`` (``"bwrap"``, else no isolation)."""
    return BWRAP_ISOLATION_WARNING if mode == "bwrap" else NO_ISOLATION_WARNING


def local_isolation(isolation: str | None = None) -> Isolation:
    """The isolation local sandboxes get here for ``isolation`` (``"auto"``, ``"bwrap"``,
    ``"none"``; ``None``: ``$AGENT_SANDBOX_LOCAL_ISOLATION``, else ``"auto"``), as a
    :class:`LocalBroker` made now would have it; ValueError for another value,
    IsolationUnavailable for ``"bwrap"`` without a working bwrap (``bwrap`` probed once per
    process)."""
    from ..broker.backends.local._bubblewrap import choose

    return choose(isolation)
