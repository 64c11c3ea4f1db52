"""``BrokerSandboxClient``: upstream ``SandboxClient``'s methods, over the broker."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

import httpx

from . import _flow as flow
from . import _protocol as proto
from ._auth import CredentialSource
from ._base import ClientBase
from ._config import BrokerConnectionConfig
from ._transport import BrokerTransport

if TYPE_CHECKING:
    from ._sandbox import Sandbox

__all__ = ["BrokerSandboxClient"]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")


class BrokerSandboxClient(ClientBase["Sandbox", BrokerTransport, "Sandbox"]):
    """Creates, finds and deletes sandboxes through the identity broker.

    Method names and semantics follow upstream ``SandboxClient`` (``create_sandbox``,
    ``get_sandbox``, ``list_active_sandboxes``, ``list_all_sandboxes``, ``delete_sandbox``,
    ``delete_all``, context manager: sandboxes created by this client are deleted on exit).
    One ``httpx.Client`` (keep-alive) is shared by the client and its sandboxes and closed by
    :meth:`close`. Thread-safe.

    ``connection_config`` defaults to :meth:`BrokerConnectionConfig.from_env` (with
    ``config_overrides`` such as ``broker_url=``/``ca_cert=`` winning); ``auth`` defaults to
    ``DefaultCredentials()``, the zero-config discovery chain. ``cleanup=True``: delete the
    client's sandboxes when the interpreter exits.
    """

    def __init__(
        self,
        connection_config: BrokerConnectionConfig | None = None,
        *,
        auth: CredentialSource | None = None,
        cleanup: bool = False,
        environ: Mapping[str, str] | None = None,
        http_transport: httpx.BaseTransport | None = None,
        **config_overrides: Any,
    ) -> None:
        super().__init__(
            connection_config,
            auth=auth,
            environ=environ,
            http_transport=http_transport,
            **config_overrides,
        )
        if cleanup:
            atexit.register(self.delete_all)

    def _new_transport(self, http_transport: httpx.BaseTransport | None) -> BrokerTransport:
        return BrokerTransport(self.connection_config, self.auth, http_transport=http_transport)

    # ---------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the HTTP connections (sandboxes keep running)."""
        self._mark_closed()
        self._transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.delete_all()
        finally:
            self.close()

    # ------------------------------------------------------------------------ broker calls

    def whoami(self) -> dict[str, Any]:
        """The identity the broker verified for the current token (``GET /v1/whoami``)."""
        return self._transport.run(flow.whoami())

    def healthz(self) -> httpx.Response:
        """``GET /v1/healthz`` without a token; the read response (for its ``Date`` header)."""
        return self._transport.send(proto.healthz(), authenticate=False)

    def list_sandboxes(
        self, label_selector: Mapping[str, str] | str | None = None
    ) -> list[proto.SandboxInfo]:
        """My sandboxes as the broker reports them, newest first."""
        return self._transport.run(flow.list_sandboxes(label_selector))

    def get_info(self, name: str) -> proto.SandboxInfo:
        """The current state of sandbox ``name`` (no waiting)."""
        return self._transport.run(flow.get_info(name))

    def wait_ready(
        self, info: proto.SandboxInfo, ready_timeout: float, *, creating: bool = False
    ) -> proto.SandboxInfo:
        """Long-poll the broker until ``info`` is Ready; raise on Failed or at the timeout."""
        timeout = self.connection_config.request_timeout
        return self._transport.run(flow.wait_ready(info, ready_timeout, timeout, creating=creating))

    def _delete(self, name: str) -> bool:
        """Delete ``name``; ``False`` if it was already gone (404)."""
        return self._transport.run(flow.delete(name))

    # ----------------------------------------------------------------- upstream-compatible API

    def _create(self, plan: flow.CreatePlan) -> Sandbox:
        from ._sandbox import Sandbox

        return self._register(Sandbox(self, self._transport.run(flow.create(plan))))

    def get_sandbox(
        self, claim_name: str, namespace: str | None = None, resolve_timeout: float = 30
    ) -> Sandbox:
        """Attach to one of my sandboxes by name, waiting up to ``resolve_timeout`` for Ready."""
        from ._sandbox import Sandbox

        del namespace  # decided by the broker
        existing = self._existing(claim_name)
        if existing is not None:
            existing.refresh()
            return existing
        info = self.wait_ready(self.get_info(claim_name), float(resolve_timeout))
        return self._register(Sandbox(self, info))

    def list_active_sandboxes(self) -> list[tuple[str, str]]:
        """``(namespace, name)`` of the live handles this client created or attached to."""
        return self._active()

    def list_all_sandboxes(
        self, namespace: str | None = None, label_selector: Mapping[str, str] | str | None = None
    ) -> list[str]:
        """Names of all my sandboxes at the broker (optionally in ``namespace`` only)."""
        infos = self.list_sandboxes(label_selector)
        return [i.name for i in infos if namespace is None or i.namespace == namespace]

    def delete_sandbox(self, claim_name: str, namespace: str | None = None) -> None:
        """Delete a sandbox; a sandbox that is already gone is not an error."""
        del namespace
        handle = self._pop(claim_name)
        if handle is not None:
            handle.kill()
        else:
            self._delete(claim_name)

    def delete_all(self) -> None:
        """Delete every sandbox this client created or attached to. Raises the first error
        after trying all of them."""
        errors: list[Exception] = []
        for name in self._names_to_delete():
            try:
                self.delete_sandbox(name)
            except Exception as exc:
                logger.error("could not delete sandbox %s: %s", name, exc)
                errors.append(exc)
        if errors:
            raise errors[0]
