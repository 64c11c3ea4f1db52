"""``Sandbox``: the handle users hold (``with Sandbox.create() as sb: sb.commands.run(...)``)."""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from . import _protocol as proto
from ._commands import Commands
from ._files import Files
from ._upstream import SandboxNotFoundError

if TYPE_CHECKING:
    from ._auth import CredentialSource
    from ._client import BrokerSandboxClient
    from ._config import BrokerConnectionConfig

__all__ = ["Sandbox", "SandboxInfo"]

SandboxInfo = proto.SandboxInfo

logger = logging.getLogger("k8s_agent_sandbox_awx.sandbox")


def _make_client(
    *,
    config: BrokerConnectionConfig | None,
    auth: CredentialSource | None,
    environ: Mapping[str, str] | None,
    settings: dict[str, Any],
) -> BrokerSandboxClient:
    from ._client import BrokerSandboxClient

    overrides = {k: v for k, v in settings.items() if v is not None}
    if config is not None:
        if overrides:
            data = config.model_dump()
            data.update(overrides)
            if "broker_url" in overrides:
                data.pop("api_url", None)
            config = type(config).model_validate(data)
        return BrokerSandboxClient(config, auth=auth, environ=environ)
    return BrokerSandboxClient(auth=auth, environ=environ, **overrides)


class Sandbox:
    """One sandbox behind the broker.

    Get one with :meth:`create` (waits until Ready), :meth:`connect` (reattach by name) or
    ``BrokerSandboxClient.create_sandbox``. ``commands`` and ``files`` speak the upstream types
    (``ExecutionResult``, ``FileEntry``). :meth:`kill` deletes it (idempotent); used as a context
    manager it is killed on exit, also when the block raises.
    """

    def __init__(
        self, client: BrokerSandboxClient, info: proto.SandboxInfo, *, owns_client: bool = False
    ) -> None:
        self._client = client
        self._info = info
        self._owns_client = owns_client
        self._killed = False
        self._closed = False
        self._commands = Commands(client.transport, info.router)
        self._files = Files(client.transport, info.router)

    # -------------------------------------------------------------------------------- state

    @property
    def name(self) -> str:
        return self._info.name

    claim_name = name

    @property
    def sandbox_id(self) -> str:
        return self._info.router.sandbox_id

    @property
    def namespace(self) -> str:
        return self._info.namespace

    @property
    def template(self) -> str | None:
        return self._info.template

    @property
    def info(self) -> proto.SandboxInfo:
        """The broker's last reported state (see :meth:`refresh`)."""
        return self._info

    @property
    def client(self) -> BrokerSandboxClient:
        return self._client

    @property
    def is_active(self) -> bool:
        return not (self._killed or self._closed)

    def _check_active(self) -> None:
        if self._killed:
            raise SandboxNotFoundError(
                f"Sandbox {self.name!r} was killed; create a new one with Sandbox.create()."
            )
        if self._closed:
            raise SandboxNotFoundError(
                f"The connection to sandbox {self.name!r} was closed; reattach with "
                f"Sandbox.connect({self.name!r})."
            )

    @property
    def commands(self) -> Commands:
        self._check_active()
        return self._commands

    @property
    def files(self) -> Files:
        self._check_active()
        return self._files

    def refresh(self) -> proto.SandboxInfo:
        """Fetch the current state from the broker."""
        self._info = self._client.get_info(self.name)
        return self._info

    def status(self) -> tuple[str, str]:
        """Upstream-style ``(status, message)``: SandboxReady, SandboxNotReady or
        SandboxNotFound."""
        try:
            info = self.refresh()
        except SandboxNotFoundError:
            return "SandboxNotFound", f"Sandbox {self.name!r} does not exist (any more)."
        if info.ready:
            return "SandboxReady", info.message or ""
        return "SandboxNotReady", info.message or info.phase

    def __repr__(self) -> str:
        state = "killed" if self._killed else self._info.phase
        return f"Sandbox(name={self.name!r}, namespace={self.namespace!r}, {state})"

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
        if self._closed and self._owns_client:
            # close_connection() closed our HTTP client: delete through a short-lived one.
            from ._client import BrokerSandboxClient

            client = BrokerSandboxClient(self._client.connection_config, auth=self._client.auth)
            try:
                client._delete(self.name)
            finally:
                client.close()
        else:
            self._client._delete(self.name)
        self._killed = True
        self._client._forget(self.name)
        logger.info("killed sandbox %s", self.name)
        if self._owns_client:
            self._closed = True
            self._client.close()

    terminate = kill

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.kill()
            return
        try:
            self.kill()
        except Exception as kill_error:
            logger.error("could not kill sandbox %s: %s", self.name, kill_error)
            exc.add_note(
                f"Sandbox {self.name!r} could not be killed ({kill_error}); kill it with "
                f"`agent-sandbox-awx kill {self.name}`."
            )

    # ---------------------------------------------------------------------- constructors

    @classmethod
    def create(
        cls,
        template: str | None = None,
        labels: Mapping[str, str] | None = None,
        *,
        auth: CredentialSource | None = None,
        broker_url: str | None = None,
        ca_cert: str | os.PathLike[str] | None = None,
        config: BrokerConnectionConfig | None = None,
        annotations: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        lifetime_seconds: int | None = None,
        ready_timeout: float | None = None,
        request_timeout: float | None = None,
        allow_insecure_http: bool | None = None,
        idempotency_key: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Sandbox:
        """Create a sandbox through the broker and wait until it is Ready.

        Without arguments everything comes from the environment: ``AGENT_SANDBOX_BROKER_URL``,
        ``AGENT_SANDBOX_CA_BUNDLE``, ``AGENT_SANDBOX_TEMPLATE`` and the credential chain
        (``AGENT_SANDBOX_TOKEN``, ``AGENT_SANDBOX_TOKEN_FILE``, the projected token, plugins).
        Arguments beat the environment. The handle owns its HTTP connections; :meth:`kill`
        (or leaving the ``with`` block) deletes the sandbox and closes them.
        """
        client = _make_client(
            config=config,
            auth=auth,
            environ=environ,
            settings={
                "broker_url": broker_url,
                "ca_cert": os.fspath(ca_cert) if ca_cert is not None else None,
                "request_timeout": request_timeout,
                "allow_insecure_http": allow_insecure_http,
            },
        )
        try:
            handle = client.create_sandbox(
                template=template,
                labels=labels,
                annotations=annotations,
                env=env,
                shutdown_after_seconds=lifetime_seconds,
                sandbox_ready_timeout=ready_timeout,
                idempotency_key=idempotency_key,
            )
        except BaseException:
            client.close()
            raise
        handle._owns_client = True
        return handle

    @classmethod
    def connect(
        cls,
        name: str,
        *,
        auth: CredentialSource | None = None,
        broker_url: str | None = None,
        ca_cert: str | os.PathLike[str] | None = None,
        config: BrokerConnectionConfig | None = None,
        ready_timeout: float = 30,
        environ: Mapping[str, str] | None = None,
    ) -> Sandbox:
        """Reattach to one of my sandboxes by name (waits up to ``ready_timeout`` for Ready)."""
        client = _make_client(
            config=config,
            auth=auth,
            environ=environ,
            settings={
                "broker_url": broker_url,
                "ca_cert": os.fspath(ca_cert) if ca_cert is not None else None,
            },
        )
        try:
            handle = client.get_sandbox(name, resolve_timeout=ready_timeout)
        except BaseException:
            client.close()
            raise
        handle._owns_client = True
        return handle

    @classmethod
    def list(
        cls,
        label_selector: Mapping[str, str] | str | None = None,
        *,
        auth: CredentialSource | None = None,
        broker_url: str | None = None,
        ca_cert: str | os.PathLike[str] | None = None,
        config: BrokerConnectionConfig | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> builtins.list[proto.SandboxInfo]:
        """My sandboxes as the broker reports them (``SandboxInfo``), newest first."""
        client = _make_client(
            config=config,
            auth=auth,
            environ=environ,
            settings={
                "broker_url": broker_url,
                "ca_cert": os.fspath(ca_cert) if ca_cert is not None else None,
            },
        )
        try:
            return client.list_sandboxes(label_selector)
        finally:
            client.close()
