"""What the local stack says about itself (imported by the package, its modules and the CLI)."""

from __future__ import annotations

NO_ISOLATION_WARNING = (
    "local sandboxes are host processes with NO isolation: commands run as your user on this "
    "machine. Use the local broker for development and tests only, never for untrusted code."
)
EXTRA_HINT = (
    'the local broker needs the [local] extra: python3 -m pip install -e ".[local]" in a clone of '
    "the k8s-agent-sandbox-awx repository"
)
