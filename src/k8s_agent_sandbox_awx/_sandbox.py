"""``Sandbox``: the handle users hold (``with Sandbox.create() as sb: sb.commands.run(...)``)."""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Mapping
from typing import Self, Unpack

from . import _flow as flow
from . import _protocol as proto
from ._base import ExcType, SandboxBase, Traceback, make_client
from ._client import BrokerSandboxClient
from ._commands import Commands
from ._files import Files
from ._upstream import SandboxNotFoundError

__all__ = ["Sandbox", "SandboxInfo"]

SandboxInfo = proto.SandboxInfo

logger = logging.getLogger("k8s_agent_sandbox_awx.sandbox")


class Sandbox(SandboxBase[BrokerSandboxClient, Commands, Files]):
    """One sandbox behind the broker.

    Get one with :meth:`create` (waits until Ready), :meth:`connect` (reattach by name) or
    ``BrokerSandboxClient.create_sandbox``. ``commands`` and ``files`` speak the upstream types
    (``ExecutionResult``, ``FileEntry``). :meth:`kill` deletes it (idempotent); used as a context
    manager it is killed on exit, also when the block raises.
    """

    def __init__(
        self, client: BrokerSandboxClient, info: proto.SandboxInfo, *, owns_client: bool = False
    ) -> None:
        transport = client.transport
        commands, files = Commands(transport, info.router), Files(transport, info.router)
        super().__init__(client, info, commands, files, owns_client)

    def refresh(self) -> proto.SandboxInfo:
        """Fetch the current state from the broker."""
        self._info = self._client.get_info(self.name)
        return self._info

    def status(self) -> tuple[str, str]:
        """Upstream-style ``(status, message)``: SandboxReady, SandboxNotReady or
        SandboxNotFound."""
        try:
            info: proto.SandboxInfo | None = self.refresh()
        except SandboxNotFoundError:
            info = None
        return self._status_of(info, self.name)

    # ---------------------------------------------------------------------------- teardown

    def close_connection(self) -> None:
        """Stop using this handle; the sandbox keeps running (reattach with connect)."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            self._client.close()

    def kill(self) -> None:
        """Delete the sandbox. Idempotent: a sandbox that is already gone is not an error."""
        if self._killed:
            return
        if self._needs_own_client_to_kill():
            client = BrokerSandboxClient(self._client.connection_config, auth=self._client.auth)
            try:
                client._delete(self.name)
            finally:
                client.close()
        else:
            self._client._delete(self.name)
        logger.info("killed sandbox %s", self.name)
        if self._killed_now():
            self._client.close()

    terminate = kill

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: ExcType, exc: BaseException | None, tb: Traceback) -> None:
        if exc is None:
            self.kill()
            return
        try:
            self.kill()
        except Exception as kill_error:
            logger.error("could not kill sandbox %s: %s", self.name, kill_error)
            self._exit_note(exc, kill_error)

    # ---------------------------------------------------------------------- constructors

    @staticmethod
    def _owning(client: BrokerSandboxClient, make: Callable[[], Sandbox]) -> Sandbox:
        """The handle ``make()`` returns, owning ``client`` (closed if ``make`` fails)."""
        try:
            handle = make()
        except BaseException:
            client.close()
            raise
        handle._owns_client = True
        return handle

    @classmethod
    def create(
        cls,
        template: str | None = None,
        labels: Mapping[str, str] | None = None,
        **options: Unpack[flow.SandboxCreateOptions],
    ) -> Sandbox:
        """Create a sandbox through the broker and wait until it is Ready.

        Without arguments everything comes from the environment: ``AGENT_SANDBOX_BROKER_URL``,
        ``AGENT_SANDBOX_CA_BUNDLE``, ``AGENT_SANDBOX_TEMPLATE`` and the credential chain
        (``AGENT_SANDBOX_TOKEN``, ``AGENT_SANDBOX_TOKEN_FILE``, the projected token, plugins).
        Keyword options (they beat the environment): ``auth``, ``broker_url``, ``ca_cert``,
        ``config``, ``environ``, ``annotations``, ``env``, ``lifetime_seconds``,
        ``ready_timeout``, ``request_timeout``, ``allow_insecure_http``, ``idempotency_key``.
        The handle owns its HTTP connections; :meth:`kill` (or leaving the ``with`` block)
        deletes the sandbox and closes them.
        """
        ready_timeout, create_options = flow.sandbox_create_args(template, options)
        client = make_client(BrokerSandboxClient, options, creating=True)
        return cls._owning(
            client,
            lambda: client.create_sandbox(
                labels=labels, sandbox_ready_timeout=ready_timeout, **create_options
            ),
        )

    @classmethod
    def connect(
        cls, name: str, *, ready_timeout: float = 30, **options: Unpack[flow.ConnectOptions]
    ) -> Sandbox:
        """Reattach to one of my sandboxes by name (waits up to ``ready_timeout`` for Ready).
        Keyword options: ``auth``, ``broker_url``, ``ca_cert``, ``config``, ``environ``."""
        client = make_client(BrokerSandboxClient, options, named=("name", "ready_timeout"))
        return cls._owning(client, lambda: client.get_sandbox(name, resolve_timeout=ready_timeout))

    @classmethod
    def list(
        cls,
        label_selector: Mapping[str, str] | str | None = None,
        **options: Unpack[flow.ConnectOptions],
    ) -> builtins.list[proto.SandboxInfo]:
        """My sandboxes as the broker reports them (``SandboxInfo``), newest first.
        Keyword options: ``auth``, ``broker_url``, ``ca_cert``, ``config``, ``environ``."""
        client = make_client(BrokerSandboxClient, options, what="list()", named=("label_selector",))
        try:
            return client.list_sandboxes(label_selector)
        finally:
            client.close()
