"""The sync shell: ``BrokerSandboxClient`` (upstream ``SandboxClient``'s methods) and the
``Sandbox`` handle users hold (``with Sandbox.create() as sb: sb.commands.run(...)``)."""

from __future__ import annotations

import atexit
import builtins
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NoReturn, Self, Unpack, overload

import httpx

from .._upstream import ExecutionResult, SandboxNotFoundError
from ..credentials._auth import CredentialSource
from ._base import (
    ClassOrInstanceMethod,
    ClientBase,
    ConnectOptions,
    ExcType,
    SandboxBase,
    SandboxCreateOptions,
    Traceback,
    create_spec,
    data_target,
    kill_name,
    make_client,
    timeout_seconds,
)
from ._code import Code, RunsCode
from ._commands import CommandHandle, Commands
from ._deleted import mark_deleted
from ._files import Files
from ._ports import Ports
from ._pty import Pty
from .core import _flow as flow
from .core import _options as opts
from .http._config import BrokerConnectionConfig
from .http._transport import BrokerTransport
from .wire import _protocol as proto
from .wire._dialect import Dialect, Lifetime
from .wire._dialects import probe_lock, probes_answered

__all__ = ["BrokerSandbox", "BrokerSandboxClient", "Sandbox", "SandboxInfo", "UpstreamSandbox"]

SandboxInfo = proto.SandboxInfo

logger = logging.getLogger("k8s_agent_sandbox_awx.client")


class BrokerSandboxClient(ClientBase["Sandbox", BrokerTransport]):
    """Creates, finds and deletes sandboxes through the identity broker.

    Method names and semantics follow upstream ``SandboxClient`` (``create_sandbox``,
    ``get_sandbox``, ``list_active_sandboxes``, ``list_all_sandboxes``, ``delete_sandbox``,
    ``delete_all``, context manager: sandboxes created by this client are deleted on exit).
    Its connections are the process's shared pool for its settings (``http/_pool``: the clients
    with the same settings share kept-alive TLS connections); :meth:`close` closes its own open
    answers and stops using the pool, never closing it under other clients. Thread-safe.

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
        return BrokerTransport(
            self.connection_config, self.auth, self._speaking, http_transport=http_transport
        )

    def _use_dialect(self, *, authenticated: bool = True) -> Dialect:
        """The dialect, found out from the broker first if it is not known yet. An
        ``authenticated`` operation fetches its credential before the probe (the credential
        chain and the token's checks need no network): a credential problem is the first error
        a user meets, never hidden behind an unreachable broker; the request then sends it."""
        if self._speaking.known is not None:
            return self._speaking.known
        if authenticated:
            audience = self.connection_config.audience
            self._transport.prime(self.auth.get_credential(audience))
        seen = probes_answered(self.broker_url)
        with probe_lock(self.broker_url):  # other threads wait, then take its answer
            return self._transport.run(self._speaking.resolve(seen))

    # ---------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the HTTP connections (sandboxes keep running)."""
        self._mark_closed()
        for handle in self._live_handles():
            handle._commands._stop_output()  # the threads that follow output use them
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
        return self._transport.call(self._use_dialect().whoami())

    def healthz(self) -> proto.BrokerReply:
        """The broker's health check, without a token: its status, headers (``Date``) and
        body."""
        spec = self._use_dialect(authenticated=False).healthz().spec
        reply = self._transport.send(spec, authenticate=False)
        return proto.BrokerReply(reply.status_code, dict(reply.headers), reply.content)

    def list_sandboxes(
        self, label_selector: Mapping[str, str] | str | None = None
    ) -> list[proto.SandboxInfo]:
        """My sandboxes as the broker reports them, newest first."""
        proto.selector_text(label_selector)  # checked before anything is sent
        return self._transport.call(self._use_dialect().list_sandboxes(label_selector))

    def get_info(self, name: str) -> proto.SandboxInfo:
        """The current state of sandbox ``name`` (no waiting)."""
        return self._transport.call(self._use_dialect().get(name))

    def wait_ready(
        self, info: proto.SandboxInfo, ready_timeout: float, *, creating: bool = False
    ) -> proto.SandboxInfo:
        """Long-poll the broker until ``info`` is Ready; raise on Failed or at the timeout."""
        config = self.connection_config
        op = flow.wait_ready(
            self._use_dialect(),
            info,
            ready_timeout,
            config.request_timeout,
            creating=creating,
            poll_interval=config.poll_interval,
        )
        return self._transport.run(op)

    def delete(self, name: str) -> bool:
        """Delete sandbox ``name`` at the broker; ``False`` if it was already gone. (A handle of
        this client for it stays registered: prefer ``Sandbox.kill()`` or ``delete_sandbox``.)"""
        return self._transport.call(self._use_dialect().delete(name))

    def extend(self, name: str, seconds: int) -> Lifetime:
        """Set sandbox ``name``'s deadline to now + ``seconds`` (later or earlier). Past the
        policy's cap from its creation a v1 broker refuses (``LifetimeExceedsPolicyError``), an
        ``/rpc`` broker cuts it (``Lifetime.capped``); ``Lifetime.info`` is the new state when
        the dialect reports it."""
        return self._transport.call(self._use_dialect().extend(name, timeout_seconds(seconds)))

    # ----------------------------------------------------------------- upstream-compatible API

    def create_sandbox(
        self,
        warmpool: str | None = None,
        namespace: str | None = None,
        sandbox_ready_timeout: float | None = None,
        labels: Mapping[str, str] | None = None,
        **options: Unpack[opts.UpstreamCreateOptions],
    ) -> Sandbox:
        """Create a sandbox, wait until it is Ready and return its handle.

        ``template`` (or upstream's ``warmpool``) names the template; neither: the config's
        template (``AGENT_SANDBOX_TEMPLATE``), else the broker policy's default. ``namespace`` is
        decided by the broker (the argument is accepted for compatibility and ignored).
        Keyword options: ``template``, ``annotations``, ``shutdown_after_seconds`` (the
        sandbox's lifetime), ``env``, ``idempotency_key``. If anything fails after the claim
        was created (ready timeout, Failed phase, Ctrl-C, a cancelled task), the claim is
        deleted before raising.
        """
        spec = flow.spec_from_upstream(warmpool, namespace, sandbox_ready_timeout, labels, options)
        return self._create(spec, upstream=True)

    def _handle(
        self, info: proto.SandboxInfo, *, upstream: bool, keepalive: int | None = None
    ) -> Sandbox:
        return (UpstreamSandbox if upstream else Sandbox)(self, info, keepalive=keepalive)

    def _create(self, spec: flow.SandboxSpec, *, upstream: bool) -> Sandbox:
        plan = flow.plan_create(self.connection_config, self._use_dialect(), spec)
        info = self._transport.run(flow.create(plan))
        return self._register(self._handle(info, upstream=upstream, keepalive=plan.keepalive))

    def _attach(self, name: str, ready_timeout: float, *, upstream: bool) -> Sandbox:
        existing = self._existing(name)
        if existing is not None:
            existing.refresh()
            return existing
        info = self.wait_ready(self.get_info(name), float(ready_timeout))
        return self._register(self._handle(info, upstream=upstream))

    def get_sandbox(
        self, claim_name: str, namespace: str | None = None, resolve_timeout: float = 30
    ) -> Sandbox:
        """Attach to one of my sandboxes by name, waiting up to ``resolve_timeout`` for Ready."""
        del namespace  # decided by the broker
        return self._attach(claim_name, resolve_timeout, upstream=True)

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
            self.delete(claim_name)

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


def _kill_named(cls: type[Sandbox], name: str | Sandbox, **options: Unpack[ConnectOptions]) -> bool:
    """``Sandbox.kill(name)``: delete sandbox ``name`` without a handle (E2B's class
    call); ``True`` if it was deleted, ``False`` if it was already gone. A handle given
    instead of a name is killed (``Sandbox.kill(sandbox)``, the unbound call)."""
    if isinstance(name, Sandbox):
        return name.kill()
    target = kill_name(cls, name)
    client = make_client(BrokerSandboxClient, options, what="kill()", named=("name",))
    mark_deleted(target)  # this process's readers of it end quietly (issue 30)
    try:
        return client.delete(target)
    finally:
        client.close()


class Sandbox(SandboxBase[BrokerSandboxClient, Commands, Files], RunsCode):
    """One sandbox behind the broker.

    Get one with :meth:`create` (waits until Ready), :meth:`connect` (reattach by name) or
    ``BrokerSandboxClient.create_sandbox``. ``commands`` and ``files`` speak the upstream types
    (``ExecutionResult``, ``FileEntry``). :meth:`kill` deletes it (idempotent); used as a context
    manager it is killed on exit, also when the block raises.
    """

    _commands_class: type[Commands] = Commands

    def __init__(
        self,
        client: BrokerSandboxClient,
        info: proto.SandboxInfo,
        *,
        owns_client: bool = False,
        keepalive: int | None = None,
    ) -> None:
        target = data_target(client, info, keepalive)
        transport = client._transport.to(target)  # extends a kept-alive sandbox when due
        commands, files = self._commands_class(transport, target), Files(transport, target)
        super().__init__(client, info, target, commands, files, owns_client)
        self._pty = Pty(transport, target)
        self._code = Code(transport, target)

    @property
    def pty(self) -> Pty:
        """Terminals in the sandbox: ``sandbox.pty.create(cols, rows)`` → a ``PtyHandle``."""
        self._check_active()
        return self._pty

    @property
    def ports(self) -> Ports:
        """The sandbox's own servers on its ports, through the broker: ``client(port)``,
        ``url(port, path)``, ``forward(port)`` and ``get_host(port)`` (docs/client.md,
        "Ports")."""
        self._check_active()
        return Ports(self)

    def get_host(self, port: int) -> NoReturn:
        """E2B's ``sandbox.get_host(port)``: as ``sandbox.ports.get_host``, it always raises
        :class:`~..errors.UnsupportedOperationError` naming what to use instead (a port is
        reached through the broker: ``ports.forward``, ``ports.client``, ``ports.url``)."""
        self.ports.get_host(port)

    def refresh(self) -> proto.SandboxInfo:
        """Fetch the current state from the broker."""
        self._info = self._client.get_info(self.name)
        return self._info

    def get_info(self) -> proto.SandboxInfo:
        """The sandbox's current state from the broker: ``phase``, ``created_at``,
        ``started_at``, ``expires_at`` (when the broker deletes it) and ``seconds_left()``."""
        return self.refresh()

    def is_running(self) -> bool:
        """Whether the sandbox exists and is Ready (``False`` once expired or deleted)."""
        if self._killed:
            return False
        try:
            return self._running(self.refresh())
        except SandboxNotFoundError:
            return False

    def set_timeout(self, seconds: float) -> proto.SandboxInfo:
        """Reset the sandbox's lifetime: the broker deletes it ``seconds`` from now (later or
        earlier than before; at most the policy's cap from its creation, else
        ``errors.LifetimeExceedsPolicyError``). Returns the new state (``expires_at``)."""
        self._check_active()
        return self._extended(self._client.extend(self.name, timeout_seconds(seconds)))

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
        self._commands._stop_output()  # their commands go on; reattach with connect
        if self._owns_client:
            self._client.close()

    def _kill_handle(self) -> bool:
        """Delete the sandbox. Idempotent: ``True`` if this call deleted it, ``False`` if it
        was already gone (or this handle killed it before; under ``/rpc`` a delete cannot
        tell). Called on the class, ``Sandbox.kill(name, **options)`` deletes sandbox ``name``
        (E2B's spelling; the keyword options of :meth:`connect`)."""
        if self._killed:
            return False
        halted = self._commands._halt_output()  # no thread follows output past the sandbox
        if self._needs_own_client_to_kill():
            client = BrokerSandboxClient(self._client.connection_config, auth=self._client.auth)
            try:
                deleted = client.delete(self.name)
            finally:
                client.close()
        else:
            deleted = self._client.delete(self.name)
        self._commands._join_output(halted)
        logger.info("killed sandbox %s", self.name)
        if self._killed_now():
            self._client.close()
        return deleted

    kill = ClassOrInstanceMethod(_kill_handle, _kill_named)

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
        **options: Unpack[SandboxCreateOptions],
    ) -> Sandbox:
        """Create a sandbox through the broker and wait until it is Ready.

        Without arguments everything comes from the environment: ``AGENT_SANDBOX_BROKER_URL``,
        ``AGENT_SANDBOX_CA_BUNDLE``, ``AGENT_SANDBOX_TEMPLATE`` and the credential chain
        (``AGENT_SANDBOX_TOKEN``, ``AGENT_SANDBOX_TOKEN_FILE``, the projected token, plugins).
        Keyword options (they beat the environment): ``auth``, ``broker_url``, ``ca_cert``,
        ``config``, ``environ``, ``annotations`` (E2B's ``metadata``), ``envs`` (upstream's
        ``env``), ``timeout``, ``keepalive``, ``ready_timeout``, ``request_timeout``,
        ``allow_insecure_http``, ``idempotency_key``, ``pod_labels``, ``pod_annotations``,
        ``scopes``; and the original package's
        ``warmpool``, ``namespace``, ``shutdown_after_seconds``, ``sandbox_ready_timeout``,
        ``keepalive_ttl_seconds``, ``token``, ``token_path``, ``backend`` (docs/migrating.md).

        ``timeout``: the sandbox's lifetime in seconds (the broker deletes it then; default
        ``AGENT_SANDBOX_TTL_SECONDS``, else 300, which the broker cuts at a lower policy cap;
        ``lifetime_seconds=`` is its 0.5.0 name); a lifetime given over the policy's cap is
        ``errors.LifetimeExceedsPolicyError``. Move it later with
        :meth:`set_timeout`. ``keepalive``: seconds of an opt-in activity keepalive (default
        ``AGENT_SANDBOX_KEEPALIVE_TTL_SECONDS``, else off): while the handle is used, each
        data-plane request moves the deadline to at least now + ``keepalive`` (at most one
        extension per half window, best effort: a failed extension never fails the request).
        The handle owns its client; :meth:`kill` (or leaving the ``with`` block) deletes the
        sandbox and closes the client (its connections go back to the process's shared pool,
        for the next sandbox with the same settings).
        """
        spec = create_spec(template, labels, options)
        client = make_client(BrokerSandboxClient, options, creating=True)
        return cls._owning(client, lambda: client._create(spec, upstream=False))

    @classmethod
    def connect(
        cls, name: str, *, ready_timeout: float = 30, **options: Unpack[ConnectOptions]
    ) -> Sandbox:
        """Reattach to one of my sandboxes by name (waits up to ``ready_timeout`` for Ready).
        Keyword options: ``auth``, ``broker_url``, ``ca_cert``, ``config``, ``environ``."""
        client = make_client(BrokerSandboxClient, options)
        return cls._owning(client, lambda: client._attach(name, ready_timeout, upstream=False))

    @classmethod
    def list(
        cls,
        label_selector: Mapping[str, str] | str | None = None,
        **options: Unpack[ConnectOptions],
    ) -> builtins.list[proto.SandboxInfo]:
        """My sandboxes as the broker reports them (``SandboxInfo``), newest first.
        Keyword options: ``auth``, ``broker_url``, ``ca_cert``, ``config``, ``environ``."""
        client = make_client(BrokerSandboxClient, options)
        try:
            return client.list_sandboxes(label_selector)
        finally:
            client.close()


# --------------------------------------------------------------------------------------------
# Upstream's spellings, only on the handles BrokerSandboxClient returns


class UpstreamCommands(Commands):
    """``commands`` of a handle from ``BrokerSandboxClient``: upstream's ``command_timeout``
    (it wins over ``timeout``; see ``opts.upstream_timeout``) and ``env`` (``envs``) too."""

    @overload
    def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,
        command_timeout: float | None = None,
        *,
        background: Literal[True],
        **options: Unpack[opts.RunOptions],
    ) -> CommandHandle: ...

    @overload
    def run(
        self,
        command: str | Sequence[str],
        timeout: float = 60,
        command_timeout: float | None = None,
        *,
        background: Literal[False] = False,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult: ...

    @overload
    def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,
        command_timeout: float | None = None,
        *,
        background: bool,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | CommandHandle: ...

    def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = 60,
        command_timeout: float | None = None,
        *,
        background: bool = False,
        **options: Unpack[opts.RunOptions],
    ) -> ExecutionResult | CommandHandle:
        limit = opts.upstream_timeout(timeout, command_timeout)
        return super().run(command, limit, background=background, **options)


class UpstreamSandbox(Sandbox):
    """The handle ``BrokerSandboxClient`` returns: a :class:`Sandbox` with upstream
    ``Sandbox``'s spellings too (``claim_name``, ``terminate()``, ``command_timeout=``)."""

    _commands_class = UpstreamCommands

    @property
    def claim_name(self) -> str:
        return self.name

    def terminate(self) -> None:
        self.kill()


BrokerSandbox = Sandbox
"""The original package's name for :class:`Sandbox` (every handle is one)."""
