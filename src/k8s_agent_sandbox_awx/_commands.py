"""``sandbox.commands``: run commands through the broker (legacy ``POST /execute``)."""

from __future__ import annotations

from typing import Unpack

from . import _flow as flow
from ._base import SandboxPart
from ._transport import BrokerTransport
from ._upstream import ExecutionResult

__all__ = ["Commands"]


class Commands(SandboxPart[BrokerTransport]):
    """Runs commands in one sandbox. Returned by ``Sandbox.commands``."""

    def run(
        self, command: str, timeout: float = 60, **options: Unpack[flow.RunOptions]
    ) -> ExecutionResult:
        """Run ``command`` (split with shell-like rules, run without a shell) and return its
        :class:`ExecutionResult`. A non-zero exit code is a result, not an exception.

        ``timeout`` is the command's time limit in seconds (``command_timeout=``, upstream's
        name, wins if given): it is sent to the runtime (``timeout_seconds``) and the broker
        (``X-Sandbox-Timeout``); the client waits a little longer for the answer. When the limit
        is exceeded the runtime kills the command and :class:`CommandTimeoutError` is raised
        (``.result`` holds the output so far); with ``raise_on_timeout=False`` the result with
        ``timed_out=True`` is returned instead, as upstream does. The command is never retried.
        ``env=``/``cwd=`` are not supported by the legacy runtime (``NotImplementedError``).
        """
        call = flow.command(self._target, command, timeout, options)
        return self._transport.call(call)
