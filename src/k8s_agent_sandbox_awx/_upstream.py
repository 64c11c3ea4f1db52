"""The one place the overlay touches the upstream client ``k8s-agent-sandbox``.

Every upstream name the overlay uses is imported here and nowhere else, from upstream's public
modules only. ``UPSTREAM_NAMES`` is the documented list (see ``docs/upstream.md``); a test fails if
any other module imports from ``k8s_agent_sandbox`` or if this list and the imports drift apart,
so an upstream refactor breaks loudly in CI and not at a user's site.
"""

from __future__ import annotations

from k8s_agent_sandbox.constants import CREATED_BY_LABEL
from k8s_agent_sandbox.exceptions import (
    SandboxClaimFailedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxNotReadyError,
    SandboxRequestError,
    SandboxTemplateNotFoundError,
    SandboxWarmPoolNotFoundError,
)
from k8s_agent_sandbox.models import (
    ExecutionResult,
    FileEntry,
    SandboxDirectConnectionConfig,
)

UPSTREAM_NAMES: dict[str, tuple[str, ...]] = {
    "k8s_agent_sandbox.constants": ("CREATED_BY_LABEL",),
    "k8s_agent_sandbox.exceptions": (
        "SandboxClaimFailedError",
        "SandboxError",
        "SandboxNotFoundError",
        "SandboxNotReadyError",
        "SandboxRequestError",
        "SandboxTemplateNotFoundError",
        "SandboxWarmPoolNotFoundError",
    ),
    "k8s_agent_sandbox.models": (
        "ExecutionResult",
        "FileEntry",
        "SandboxDirectConnectionConfig",
    ),
}

__all__ = [
    "CREATED_BY_LABEL",
    "UPSTREAM_NAMES",
    "ExecutionResult",
    "FileEntry",
    "SandboxClaimFailedError",
    "SandboxDirectConnectionConfig",
    "SandboxError",
    "SandboxNotFoundError",
    "SandboxNotReadyError",
    "SandboxRequestError",
    "SandboxTemplateNotFoundError",
    "SandboxWarmPoolNotFoundError",
]
