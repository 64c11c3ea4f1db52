"""``sandbox.commands``: run commands through the broker (legacy ``POST /execute``)."""

from __future__ import annotations

import logging

from . import _protocol as proto
from ._exceptions import CommandTimeoutError, RequestTimeoutError
from ._transport import BrokerTransport
from ._upstream import ExecutionResult

__all__ = ["Commands"]

logger = logging.getLogger("k8s_agent_sandbox_awx.commands")


class Commands:
    """Runs commands in one sandbox. Returned by ``Sandbox.commands``."""

    def __init__(self, transport: BrokerTransport, router: proto.RouterTarget) -> None:
        self._transport = transport
        self._router = router

    def run(
        self,
        command: str,
        timeout: float = 60,
        command_timeout: float | None = None,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        raise_on_timeout: bool = True,
    ) -> ExecutionResult:
        """Run ``command`` (split with shell-like rules, run without a shell) and return its
        :class:`ExecutionResult`. A non-zero exit code is a result, not an exception.

        ``timeout`` is the command's time limit in seconds (``command_timeout``, upstream's
        name, wins if given): it is sent to the runtime (``timeout_seconds``) and the broker
        (``X-Sandbox-Timeout``); the client waits a little longer for the answer. When the limit
        is exceeded the runtime kills the command and :class:`CommandTimeoutError` is raised
        (``.result`` holds the output so far); with ``raise_on_timeout=False`` the result with
        ``timed_out=True`` is returned instead, as upstream does. The command is never retried.
        """
        if env or cwd:
            raise NotImplementedError(
                "env and cwd are not supported by the legacy python-runtime behind the broker; "
                "set variables at create time (Sandbox.create(env=...)) or prefix the command."
            )
        limit = float(command_timeout if command_timeout is not None else timeout)
        spec = proto.execute(self._router, command, command_timeout=limit)
        try:
            response = self._transport.send(spec)
        except RequestTimeoutError as exc:
            raise CommandTimeoutError(
                f"No answer for the command within its time limit of {limit:g}s plus "
                f"{proto.COMMAND_TIMEOUT_MARGIN:g}s; it may still be running in sandbox "
                f"{self._router.sandbox_id!r}. Pass a larger timeout= to commands.run.",
                command_timeout=limit,
            ) from exc
        result = proto.parse_execution_result(proto.parse_json(response.content, "run a command"))
        if result.timed_out and raise_on_timeout:
            raise CommandTimeoutError(
                f"The command ran longer than its time limit of {limit:g}s and was killed "
                f"(exit code {result.exit_code}). Pass a larger timeout= to commands.run, or "
                "raise_on_timeout=False to get the partial output as a result.",
                command_timeout=limit,
                result=result,
            )
        logger.debug(
            "command finished in sandbox %s: exit %s", self._router.sandbox_id, result.exit_code
        )
        return result
