"""Every error the SDK raises, in one public module: ``from k8s_agent_sandbox_awx import errors``.

``SandboxError`` (upstream's base class) is the root of all of them. The broker client's errors
are defined here; the credential framework's (``CredentialError`` and its subclasses) are
defined with the framework and re-exported here. Every broker client error subclasses an
upstream ``k8s_agent_sandbox`` exception, so code written against the upstream client keeps
catching what it caught before (``SandboxRequestError``, ``SandboxNotFoundError``, ...).
Messages say what failed and what to do; they never contain a token or an ``Authorization``
header. Credential errors reach the caller as raised (never wrapped).

An error whose next step names a setting carries it structured (issue 30): ``exc.fix`` (the
step, naming the setting abstractly) and ``exc.what`` (what failed). ``str(exc)`` spells the
setting as Python does (``timeout=300``); the CLI shows the same error with its flags
(``--timeout 300``), the environment's variables where the value came from there.
"""

from __future__ import annotations

from typing import Any

from ._fix import Fix, attach
from ._upstream import (
    ExecutionResult,
    SandboxClaimFailedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxNotReadyError,
    SandboxRequestError,
    SandboxTemplateNotFoundError,
    SandboxWarmPoolNotFoundError,
)
from .credentials._credential_errors import (
    AudienceMismatchError,
    CredentialError,
    CredentialPluginWarning,
    CredentialSourceError,
    EmptyCredentialError,
    ForbiddenTokenSourceError,
    MalformedTokenError,
    NoCredentialsError,
    TokenExpiredError,
    UnreadableCredentialError,
)

__all__ = [
    "AudienceMismatchError",
    "BrokerAuthenticationError",
    "BrokerConflictError",
    "BrokerError",
    "BrokerNotFoundError",
    "BrokerPermissionError",
    "BrokerProtocolError",
    "BrokerQuotaError",
    "BrokerRedirectError",
    "BrokerTLSError",
    "BrokerTemplateNotFoundError",
    "BrokerUnavailableError",
    "BrokerWarmPoolNotFoundError",
    "CodeContextBusyError",
    "CodeContextError",
    "CodeContextLimitError",
    "CodeContextNotFoundError",
    "CodeTimeoutError",
    "CommandOutputLostError",
    "CommandTimeoutError",
    "CommandWaitTimeoutError",
    "ConfigurationError",
    "CredentialError",
    "CredentialPluginWarning",
    "CredentialSourceError",
    "EmptyCredentialError",
    "FileAPIUnsupportedError",
    "ForbiddenTokenSourceError",
    "InvalidSettingError",
    "LifetimeExceedsPolicyError",
    "MalformedTokenError",
    "NoCredentialsError",
    "PortNotAllowedError",
    "PortNotListeningError",
    "RequestTimeoutError",
    "ReservedMetadataError",
    "SandboxError",
    "SandboxFailedError",
    "SandboxFileError",
    "SandboxFileExistsError",
    "SandboxFileLimitError",
    "SandboxFileNotFoundError",
    "SandboxPathError",
    "SandboxReadyTimeoutError",
    "SandboxTerminatingError",
    "StdinTooLargeError",
    "TokenExpiredError",
    "UnreadableCredentialError",
    "UnsupportedByRuntimeError",
    "UnsupportedOperationError",
]


class ConfigurationError(SandboxError):
    """The client configuration is invalid or incomplete (a URL, a variable, an argument).
    ``fix``: the next step, naming the setting (``None``: the message says it)."""

    def __init__(self, *args: Any, fix: Fix | None = None) -> None:
        super().__init__(*args)
        attach(self, fix)


class InvalidSettingError(ConfigurationError, ValueError):
    """A connection setting has a value ``BrokerConnectionConfig`` refuses (a timeout that is
    not a number > 0, a setting of the wrong type, ...); also a ``ValueError``, as the
    validation error it replaces. ``setting``: the setting's name (the first, if several)."""

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    # The first __new__ in the MRO may belong to a base of another layout (RuntimeError's for
    # an error that is also a TimeoutError, an OSError): use the first one that accepts cls.
    news = (vars(base)["__new__"] for base in cls.__mro__ if "__new__" in vars(base))
    for new in news:  # BaseException's, at the latest, accepts it
        try:
            error = new(cls, *args)
            break
        except TypeError:
            continue
    error.args = args
    error.__dict__.update(state)
    return error


class _RebuiltFromState:
    """Pickles (and copies) an error whose ``__init__`` requires keywords: it is rebuilt from its
    ``args`` and attributes without calling ``__init__`` (``BaseException`` would call it with
    the message alone). Errors cross processes pickled: ``concurrent.futures``,
    ``multiprocessing``, pytest-xdist."""

    def __reduce__(self) -> tuple[Any, ...]:
        assert isinstance(self, BaseException)
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class BrokerError(SandboxRequestError):
    """The broker (or a sandbox runtime behind it) answered with an error, or could not be reached.

    ``status_code``: the HTTP status (``None`` when no response arrived); ``code``: the broker's
    machine code (``None`` for errors passed through from the sandbox runtime); ``detail``: the
    human-readable reason from the response body; ``method``/``path``: the request that failed;
    ``request_sent``: whether the request may have reached the broker (``False`` when every
    attempt failed before anything was sent: no connection, or a TLS handshake that failed);
    ``fix``: the next step, naming the setting (``None``: the message says it).
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        code: str | None = None,
        detail: str | None = None,
        method: str | None = None,
        path: str | None = None,
        response: Any = None,
        request_sent: bool = True,
        fix: Fix | None = None,
    ) -> None:
        super().__init__(message, status_code=status_code, response=response)
        attach(self, fix)
        self.code = code
        self.detail = detail
        self.method = method
        self.path = path
        self.request_sent = request_sent


class BrokerAuthenticationError(BrokerError):
    """401: the broker rejected the token (after one re-read of the credential and one retry)."""


class BrokerPermissionError(BrokerError):
    """403: authenticated, but the caller's policy (or the sandbox's owner) forbids the request."""


class BrokerNotFoundError(BrokerError, SandboxNotFoundError):
    """404 ``not_found``: no such sandbox for this caller."""


class BrokerTemplateNotFoundError(BrokerError, SandboxTemplateNotFoundError):
    """404 ``template_not_found``: the broker knows no such template."""


class BrokerConflictError(BrokerError):
    """409: the request conflicts with the sandbox's state or an earlier idempotency key."""


class BrokerQuotaError(BrokerError):
    """429: too many sandboxes (``quota_exceeded``) or requests (``rate_limited``)."""


class PortNotAllowedError(BrokerPermissionError):
    """403 ``port_not_allowed``: the caller's policy does not allow the port (``port``; the
    detail names the ports it allows)."""

    def __init__(self, message: str, *, port: int | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.port = port


class LifetimeExceedsPolicyError(BrokerPermissionError):
    """403 ``lifetime_exceeds_policy``: the lifetime asked for (at create or with
    ``set_timeout``) ends past the policy's cap, counted from the sandbox's creation."""


class ReservedMetadataError(BrokerPermissionError, ValueError):
    """``reserved_metadata``: a create's label or annotation key is under a reserved prefix
    (``prefix``): the broker's own ``broker.agent-sandbox-awx.io/`` (its attribution stamps)
    or upstream's ``agents.x-k8s.io/`` (what upstream's controller reads, e.g.
    ``agents.x-k8s.io/sandbox-name``), subdomains included. Refused by the SDK before anything
    is sent (``status_code`` ``None``, ``request_sent`` ``False``; ``key``: the key, ``field``:
    ``labels``, ``annotations``, ``pod_labels`` or ``pod_annotations``), or the broker's own
    ``403 reserved_metadata``. Also a ``ValueError``, as the check it replaces."""

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        field: str | None = None,
        prefix: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("code", "reserved_metadata")
        super().__init__(message, **kwargs)
        self.key = key
        self.field = field
        self.prefix = prefix


class SandboxFileError(BrokerError):
    """A file operation the sandbox runtime refused. ``path``: the sandbox path it names;
    ``code``: the rule (the runtime's code, e.g. ``not_empty``, ``cross_root``,
    ``is_a_directory``); ``detail``: the runtime's reason."""

    def __init__(self, message: str, *, sandbox_path: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.sandbox_path = sandbox_path


class SandboxFileNotFoundError(SandboxFileError):
    """``path_not_found``: the path (or a directory on its way) does not exist."""


class SandboxFileExistsError(SandboxFileError):
    """``path_exists``: the destination exists (a move without ``overwrite``, ``make_dir`` over
    a file)."""


class SandboxPathError(SandboxFileError):
    """The path breaks the runtime's path rules: ``path_invalid``, ``path_outside_root``,
    ``path_is_root``, ``symlink_not_followed``; or its root (``/app``, ``/workspace``) is no
    longer the directory it was when the sandbox started (``root_replaced``: a command removed
    it or put a link or another directory in its place)."""


class SandboxFileLimitError(SandboxFileError):
    """Over a limit of the runtime: ``file_too_large`` (``read`` of more than its read limit),
    ``too_many_entries`` (a listing or watch of a huge directory)."""


class FileAPIUnsupportedError(SandboxFileError):
    """The sandbox runtime lacks the file API (``/fs/*``: deployed runtimes since v0.4.0) that
    the operation needs; only ``read``, ``write``, ``list`` and ``exists`` work without it."""


class BrokerUnavailableError(BrokerError):
    """The broker or the sandbox could not be reached (502/503/504, connection errors)."""


class PortNotListeningError(BrokerUnavailableError):
    """502 ``port_not_listening``: nothing listens on the port in the sandbox (``port``;
    ``sandbox``: its name). Start the server first (``commands.run(..., background=True)``)."""

    def __init__(
        self, message: str, *, port: int | None = None, sandbox: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.port = port
        self.sandbox = sandbox


class BrokerTLSError(BrokerError):
    """The broker's TLS certificate did not verify (wrong or missing CA bundle, a clock outside
    the certificate's validity, another host name). Nothing was sent, and it is not retried:
    retrying cannot help."""


class BrokerProtocolError(BrokerError):
    """The response does not follow the broker API (unexpected status, body or content type)."""


class BrokerRedirectError(BrokerError):
    """The server answered with a redirect. Redirects are never followed: the ``Authorization``
    header must not reach another origin, and a broker never redirects."""

    def __init__(self, message: str, *, location: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.location = location


class RequestTimeoutError(BrokerError):
    """A request to the broker took longer than the request timeout."""

    def __init__(self, message: str, *, timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.timeout = timeout


class CommandTimeoutError(_RebuiltFromState, SandboxError):
    """A command ran longer than its time limit and was killed by the sandbox runtime.

    ``result`` is the runtime's :class:`ExecutionResult` (``timed_out=True``, output up to the
    limit) when one arrived, ``None`` when the answer itself never came back in time.
    """

    def __init__(
        self,
        message: str,
        *,
        command_timeout: float,
        result: ExecutionResult | None = None,
    ) -> None:
        super().__init__(message)
        self.command_timeout = command_timeout
        self.result = result


class CommandWaitTimeoutError(_RebuiltFromState, SandboxError, TimeoutError):
    """``handle.wait(timeout=...)`` returned before the background command ended. The command
    keeps running (``handle.kill()`` stops it); ``command_id`` names it."""

    def __init__(self, message: str, *, command_id: str, timeout: float) -> None:
        super().__init__(message)
        self.command_id = command_id
        self.timeout = timeout


class CommandOutputLostError(BrokerError):
    """``410`` from the runtime: events a reader asked for are no longer retained (output beyond
    the runtime's cap that no reader followed). ``resume_after``: the cursor to go on from."""

    def __init__(self, message: str, *, resume_after: int | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.resume_after = resume_after


class StdinTooLargeError(BrokerError, ValueError):
    """``send_stdin`` data over the sandbox runtime's limit per request: refused before sending
    when the limit is known (``request_sent`` is then ``False``), or by the runtime or the
    broker (``413``, or a ``400`` naming the size; nothing was written). ``limit``: the largest
    request body in bytes (``None``: the answer did not say); ``size``: the body that was too
    large (the data JSON-encoded). Send the data in chunks: the message says how large. Also a
    ``ValueError``."""

    def __init__(
        self, message: str, *, limit: int | None = None, size: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.limit = limit
        self.size = size


class CodeContextError(BrokerError):
    """The sandbox runtime refused a ``run_code`` request about a code context (the base of
    the three below). ``context_id``: the context it names."""

    def __init__(self, message: str, *, context_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.context_id = context_id


class CodeContextNotFoundError(CodeContextError):
    """``404 context_not_found``: no such code context in the sandbox (removed, or created in
    another sandbox)."""


class CodeContextBusyError(CodeContextError):
    """``409 context_busy``: the context runs another execution (``execution_id``); a context
    runs one at a time. Nothing was run."""

    def __init__(self, message: str, *, execution_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.execution_id = execution_id


class CodeContextLimitError(CodeContextError):
    """``429 too_many_contexts``: the sandbox has as many code contexts as its runtime allows
    (``limit``, ``SANDBOX_CODE_MAX_CONTEXTS``; 8 on the local runtime, the default one
    included)."""

    def __init__(self, message: str, *, limit: int | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.limit = limit


class CodeTimeoutError(_RebuiltFromState, SandboxError, TimeoutError):
    """``run_code`` got no end of its execution within the execution's time limit and the
    margin after it (the runtime ends a runaway execution itself, and says so in its result:
    this means that the answer did not come back). The execution was interrupted.
    ``execution_id`` names it, ``timeout`` is its limit in seconds."""

    def __init__(self, message: str, *, execution_id: str, timeout: float) -> None:
        super().__init__(message)
        self.execution_id = execution_id
        self.timeout = timeout


class UnsupportedByRuntimeError(SandboxError, NotImplementedError):
    """The sandbox's runtime is too old for what was asked: ``on_stdout``, ``on_stderr``,
    ``envs``, ``cwd``, ``background`` and ``stdin`` of ``commands.run`` need the managed-command
    endpoints (``POST /commands``), ``run_code`` and the code contexts need ``/code``. Raised
    before the command runs. ``options``: the names of the options (or operations) asked for
    that the runtime cannot honour."""

    def __init__(self, message: str, *, options: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.options = options


class SandboxReadyTimeoutError(_RebuiltFromState, SandboxNotReadyError):
    """The sandbox did not become Ready within the ready timeout (``create`` deletes it)."""

    def __init__(
        self, message: str, *, name: str, ready_timeout: float, phase: str | None = None
    ) -> None:
        super().__init__(message)
        self.name = name
        self.ready_timeout = ready_timeout
        self.phase = phase


class SandboxFailedError(_RebuiltFromState, SandboxClaimFailedError):
    """The sandbox reached the terminal ``Failed`` phase (``create`` deletes it)."""

    def __init__(
        self, message: str, *, name: str, reason: str | None = None, detail: str | None = None
    ) -> None:
        super().__init__(message)
        self.name = name
        self.reason = reason
        self.detail = detail


class BrokerWarmPoolNotFoundError(SandboxFailedError, SandboxWarmPoolNotFoundError):
    """The warm pool a create named does not exist (``/rpc`` dialect; ``create`` deletes the
    claim). Also an upstream ``SandboxWarmPoolNotFoundError`` and a :class:`SandboxFailedError`."""


class UnsupportedOperationError(_RebuiltFromState, ConfigurationError, NotImplementedError):
    """The broker's dialect (or this SDK) has no such operation, e.g. ``list`` under ``/rpc``.

    ``dialect``: the dialect's name; ``operation``: what was asked for. Raised before anything
    is sent."""

    def __init__(self, message: str, *, dialect: str, operation: str) -> None:
        super().__init__(message)
        self.dialect = dialect
        self.operation = operation


class SandboxTerminatingError(_RebuiltFromState, SandboxNotFoundError):
    """The sandbox is being deleted (phase ``Terminating``); it will not be usable again."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name
