"""``BrokerSandboxClient``: upstream ``SandboxClient``'s methods, over the broker."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import httpx

from . import _protocol as proto
from ._auth import CredentialSource
from ._config import BrokerConnectionConfig
from ._exceptions import (
    BrokerUnavailableError,
    ConfigurationError,
    RequestTimeoutError,
    SandboxFailedError,
    SandboxReadyTimeoutError,
    SandboxTerminatingError,
)
from ._transport import BrokerTransport

if TYPE_CHECKING:
    from ._sandbox import Sandbox

__all__ = ["BrokerSandboxClient"]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")


def _default_auth(environ: Mapping[str, str] | None) -> CredentialSource:
    from ._chain import DefaultCredentials

    source: CredentialSource = DefaultCredentials(environ)
    return source


class BrokerSandboxClient:
    """Creates, finds and deletes sandboxes through the identity broker.

    Method names and semantics follow upstream ``SandboxClient`` (``create_sandbox``,
    ``get_sandbox``, ``list_active_sandboxes``, ``list_all_sandboxes``, ``delete_sandbox``,
    ``delete_all``, context manager: sandboxes created by this client are deleted on exit).
    One ``httpx.Client`` (keep-alive) is shared by the client and its sandboxes and closed by
    :meth:`close`. Thread-safe.

    ``connection_config`` defaults to :meth:`BrokerConnectionConfig.from_env` (with
    ``config_overrides`` such as ``broker_url=``/``ca_cert=`` winning); ``auth`` defaults to
    ``DefaultCredentials()``, the zero-config discovery chain.
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
        if connection_config is not None and config_overrides:
            raise ConfigurationError(
                "Pass either connection_config= or individual settings "
                f"({', '.join(sorted(config_overrides))}), not both."
            )
        self.connection_config = connection_config or BrokerConnectionConfig.from_env(
            environ, **config_overrides
        )
        self.auth = auth if auth is not None else _default_auth(environ)
        self._transport = BrokerTransport(
            self.connection_config, self.auth, http_transport=http_transport
        )
        self._lock = threading.RLock()
        self._handles: dict[str, Sandbox] = {}
        self._closed = False
        if cleanup:
            atexit.register(self.delete_all)

    # ---------------------------------------------------------------------------- lifecycle

    @property
    def broker_url(self) -> str:
        return self.connection_config.broker_url

    @property
    def transport(self) -> BrokerTransport:
        return self._transport

    def close(self) -> None:
        """Close the HTTP connections (sandboxes keep running)."""
        with self._lock:
            self._closed = True
        self._transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.delete_all()
        finally:
            self.close()

    # ------------------------------------------------------------------------ broker calls

    def whoami(self) -> dict[str, Any]:
        """The identity the broker verified for the current token (``GET /v1/whoami``)."""
        spec = proto.whoami()
        result = proto.parse_json(self._transport.send(spec).content, spec.what)
        if not isinstance(result, dict):
            raise proto._protocol_error(spec.what, "expected a JSON object")
        return result

    def healthz(self) -> httpx.Response:
        """``GET /v1/healthz`` without a token; the read response (for its ``Date`` header)."""
        return self._transport.send(proto.healthz(), authenticate=False)

    def list_sandboxes(
        self, label_selector: Mapping[str, str] | str | None = None
    ) -> list[proto.SandboxInfo]:
        """My sandboxes as the broker reports them, newest first."""
        spec = proto.list_sandboxes(label_selector)
        return proto.parse_sandbox_list(
            proto.parse_json(self._transport.send(spec).content, spec.what)
        )

    def get_info(self, name: str) -> proto.SandboxInfo:
        """The current state of sandbox ``name`` (no waiting)."""
        spec = proto.get(name)
        return proto.parse_sandbox(proto.parse_json(self._transport.send(spec).content, spec.what))

    def wait_ready(
        self, info: proto.SandboxInfo, ready_timeout: float, *, creating: bool = False
    ) -> proto.SandboxInfo:
        """Long-poll the broker until ``info`` is Ready; raise on Failed or at the timeout.

        ``creating``: the caller deletes the claim on failure (the messages say so)."""
        deleted = "; its claim is deleted" if creating else ""
        deadline = time.monotonic() + ready_timeout
        request_timeout = self.connection_config.request_timeout
        while True:
            if info.phase == "Ready" or info.ready:
                return info
            if info.phase == "Terminating":
                raise SandboxTerminatingError(
                    f"Sandbox {info.name!r} is being deleted (Terminating) and will not become "
                    "ready; create a new one with Sandbox.create().",
                    name=info.name,
                )
            if info.phase == "Failed":
                raise SandboxFailedError(
                    f"Sandbox {info.name!r} is {info.phase} and will not become ready{deleted} "
                    f"(reason: {info.reason or 'none given'}; {info.message or 'no message'}). "
                    "Check the template and your policy (`agent-sandbox-awx whoami`), then "
                    "create a new sandbox.",
                    name=info.name,
                    reason=info.reason,
                    detail=info.message,
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxReadyTimeoutError(
                    f"Sandbox {info.name!r} did not become ready within {ready_timeout:g}s "
                    f"(phase {info.phase}){deleted}. Pass a larger ready_timeout= "
                    "(or sandbox_ready_timeout=), or ask the broker's operator why the template "
                    "starts slowly.",
                    name=info.name,
                    ready_timeout=ready_timeout,
                    phase=info.phase,
                )
            spec = proto.get(info.name, wait_ready=remaining, request_timeout=request_timeout)
            response = self._transport.send(spec)
            info = proto.parse_sandbox(proto.parse_json(response.content, spec.what), spec.what)

    def _delete(self, name: str) -> bool:
        """Delete ``name``; ``False`` if it was already gone (404)."""
        response = self._transport.send(proto.delete(name))
        return response.status_code != 404

    # ----------------------------------------------------------------- upstream-compatible API

    def create_sandbox(
        self,
        warmpool: str | None = None,
        namespace: str | None = None,
        sandbox_ready_timeout: float | None = None,
        labels: Mapping[str, str] | None = None,
        *,
        template: str | None = None,
        annotations: Mapping[str, str] | None = None,
        shutdown_after_seconds: int | None = None,
        env: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        claim_name: str | None = None,
        adopt_existing: bool = False,
        volume_claim_templates: Any = None,
        pod_labels: Mapping[str, str] | None = None,
        pod_annotations: Mapping[str, str] | None = None,
    ) -> Sandbox:
        """Create a sandbox, wait until it is Ready and return its handle.

        ``template`` (or upstream's ``warmpool``) names the template; neither: the config's
        template (``AGENT_SANDBOX_TEMPLATE``), else the broker policy's default. ``namespace`` is
        decided by the broker (the argument is accepted for compatibility and ignored).
        ``shutdown_after_seconds`` is the sandbox's lifetime. If anything fails after the claim
        was created (ready timeout, Failed phase, Ctrl-C), the claim is deleted before raising.
        """
        from ._sandbox import Sandbox

        unsupported = {
            "claim_name": claim_name,
            "adopt_existing": adopt_existing or None,
            "volume_claim_templates": volume_claim_templates,
            "pod_labels": pod_labels,
            "pod_annotations": pod_annotations,
        }
        given = sorted(k for k, v in unsupported.items() if v)
        if given:
            raise ConfigurationError(
                f"{', '.join(given)} cannot be used through the broker: it names claims and "
                "builds their spec itself. Use labels=/annotations=/env= instead."
            )
        if template and warmpool and template != warmpool:
            raise ConfigurationError(
                f"template={template!r} and warmpool={warmpool!r} differ; pass only template=."
            )
        if namespace is not None:
            logger.debug("namespace=%r ignored: the broker's policy decides it", namespace)
        chosen = template or warmpool or self.connection_config.template
        ready_timeout = (
            self.connection_config.ready_timeout
            if sandbox_ready_timeout is None
            else float(sandbox_ready_timeout)
        )
        spec = proto.create(
            idempotency_key=idempotency_key or proto.new_idempotency_key(),
            template=chosen,
            labels=labels,
            annotations=annotations,
            lifetime_seconds=shutdown_after_seconds,
            env=env,
        )
        try:
            response = self._transport.send(spec)
        except (KeyboardInterrupt, RequestTimeoutError, BrokerUnavailableError) as exc:
            # The broker may have created the sandbox without us seeing the answer: replay the
            # create with the same Idempotency-Key (which returns that sandbox) and delete it.
            self._abandon_create(spec, exc)
            raise
        info = proto.parse_sandbox(proto.parse_json(response.content, spec.what), spec.what)
        logger.info("created sandbox %s (template %s)", info.name, info.template)
        try:
            info = self.wait_ready(info, ready_timeout, creating=True)
            sandbox = Sandbox(self, info)
        except BaseException as exc:
            self._rollback(info.name, exc)
            raise
        with self._lock:
            self._handles[info.name] = sandbox
        return sandbox

    def _abandon_create(self, spec: proto.RequestSpec, exc: BaseException) -> None:
        try:
            response = self._transport.send(spec)
            name = proto.parse_sandbox(proto.parse_json(response.content, spec.what)).name
        except Exception as replay_error:
            logger.warning(
                "could not check whether an interrupted create left a sandbox: %s", replay_error
            )
            exc.add_note(
                "The create was interrupted and the broker could not be asked whether it created "
                "a sandbox; check with `agent-sandbox-awx ls` and kill any leftover."
            )
            return
        self._rollback(name, exc)

    def _rollback(self, name: str, exc: BaseException) -> None:
        try:
            self._delete(name)
            logger.info("deleted sandbox %s after a failed create", name)
        except Exception as cleanup_error:
            logger.error(
                "could not delete sandbox %s after a failed create: %s", name, cleanup_error
            )
            exc.add_note(
                f"The sandbox {name!r} could not be deleted ({cleanup_error}); delete it with "
                f"`agent-sandbox-awx kill {name}`."
            )

    def get_sandbox(
        self, claim_name: str, namespace: str | None = None, resolve_timeout: float = 30
    ) -> Sandbox:
        """Attach to one of my sandboxes by name, waiting up to ``resolve_timeout`` for Ready."""
        from ._sandbox import Sandbox

        del namespace  # decided by the broker
        with self._lock:
            existing = self._handles.get(claim_name)
        if existing is not None and existing.is_active:
            existing.refresh()
            return existing
        info = self.wait_ready(self.get_info(claim_name), float(resolve_timeout))
        sandbox = Sandbox(self, info)
        with self._lock:
            self._handles[claim_name] = sandbox
        return sandbox

    def list_active_sandboxes(self) -> list[tuple[str, str]]:
        """``(namespace, name)`` of the live handles this client created or attached to."""
        with self._lock:
            for name, handle in list(self._handles.items()):
                if not handle.is_active:
                    del self._handles[name]
            return [(h.namespace, name) for name, h in self._handles.items()]

    def list_all_sandboxes(
        self, namespace: str | None = None, label_selector: Mapping[str, str] | str | None = None
    ) -> list[str]:
        """Names of all my sandboxes at the broker (optionally in ``namespace`` only)."""
        return [
            info.name
            for info in self.list_sandboxes(label_selector)
            if namespace is None or info.namespace == namespace
        ]

    def delete_sandbox(self, claim_name: str, namespace: str | None = None) -> None:
        """Delete a sandbox; a sandbox that is already gone is not an error."""
        del namespace
        with self._lock:
            handle = self._handles.pop(claim_name, None)
        if handle is not None:
            handle.kill()
        else:
            self._delete(claim_name)

    def delete_all(self) -> None:
        """Delete every sandbox this client created or attached to. Raises the first error
        after trying all of them."""
        with self._lock:
            if self._closed:
                return
            names = list(self._handles)
        errors: list[Exception] = []
        for name in names:
            try:
                self.delete_sandbox(name)
            except Exception as exc:
                logger.error("could not delete sandbox %s: %s", name, exc)
                errors.append(exc)
        if errors:
            raise errors[0]

    def _forget(self, name: str) -> None:
        with self._lock:
            self._handles.pop(name, None)
