"""The one place the overlay touches the upstream client ``k8s-agent-sandbox``.

Every upstream name the overlay uses is imported here and nowhere else, from upstream's public
modules only. ``UPSTREAM_NAMES`` is the documented list (see ``docs/upstream.md``); a test fails if
any other module imports from ``k8s_agent_sandbox`` or if this list and the imports drift apart,
so an upstream refactor breaks loudly in CI and not at a user's site. ``ExecutionResult`` is
upstream's, subclassed here with the one field the overlay adds (``output_truncated``).
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
from k8s_agent_sandbox.models import ExecutionResult as _UpstreamExecutionResult
from k8s_agent_sandbox.models import (
    FileEntry,
    SandboxDirectConnectionConfig,
)


class ExecutionResult(_UpstreamExecutionResult):
    """Upstream's ``ExecutionResult`` (what ``commands.run`` returns) plus the overlay's fields.

    ``output_truncated``: the runtime kept only the first part of ``stdout`` or ``stderr`` (the
    local runtime keeps 1 MiB of each). A runtime that does not send the field never truncates:
    ``False``.

    A managed command (``POST /commands``) also sets ``command_id`` (the runtime's id) and
    ``state``: ``exited``, ``cancelled`` (killed) or ``timed_out``; a legacy ``/execute`` result
    has ``command_id=None`` and ``state`` ``exited`` (``timed_out`` when it timed out).
    """

    output_truncated: bool = False
    command_id: str | None = None
    state: str = "exited"


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
