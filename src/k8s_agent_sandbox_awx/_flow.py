"""What the client does, step by step, written once for the sync and the async API.

Each operation is a generator that yields a :class:`Call` (a request to send) and receives the
read response; it returns the operation's result or raises its typed error. The sync client runs
it with :func:`drive`, the async client with ``_async_client.adrive``; only they do I/O. An
exception raised while a call is performed (a broker error, Ctrl-C, an ``asyncio`` cancellation)
is thrown back into the generator, so cleanup decisions (delete the claim a failed create made)
live here too; a cleanup call is marked ``cleanup=True`` so that the async driver completes it
even while the task is being cancelled.
"""

from __future__ import annotations

import difflib
import json
import logging
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypedDict, TypeVar

from . import _exceptions as errors
from . import _protocol as proto
from ._upstream import ExecutionResult, FileEntry

if TYPE_CHECKING:
    import os

    from ._auth import CredentialSource
    from ._config import BrokerConnectionConfig

__all__ = [
    "Call",
    "ConnectOptions",
    "CreateOptions",
    "Op",
    "RunOptions",
    "SandboxCreateOptions",
    "Stepper",
    "drive",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")

T = TypeVar("T")


class Reply(Protocol):
    """What an operation gets back for a call: the read response."""

    @property
    def status_code(self) -> int: ...

    @property
    def content(self) -> bytes: ...


@dataclass(frozen=True)
class Call:
    """Send ``spec``. ``cleanup``: it must complete even while the caller is cancelled."""

    spec: proto.RequestSpec
    cleanup: bool = False


Op = Generator[Call, Reply, T]


class Stepper(Generic[T]):
    """Advances an operation: set ``reply`` or ``error`` with the outcome of the last call,
    then :meth:`advance` returns the next call, or ``None`` when ``result`` is set."""

    def __init__(self, op: Op[T]) -> None:
        self._op = op
        self.reply: Any = None
        self.error: BaseException | None = None
        self.result: T

    def advance(self) -> Call | None:
        error, self.error = self.error, None
        try:
            if error is not None:
                return self._op.throw(error)
            return self._op.send(self.reply)
        except StopIteration as stop:
            self.result = stop.value
            return None
        except (errors.BrokerError, errors.SandboxFailedError) as exc:
            if error is None:
                _redact_sent_token(exc, self.reply)
            raise


def _redact_sent_token(exc: Exception, reply: object) -> None:
    """An error built from a successful ``reply`` (an answer that does not parse, a Failed
    sandbox's reason) may quote it, and so the token its request carried (an opaque one has no
    shape to recognise): replaced in the message and the text attributes, and a cause that
    quotes it is dropped."""
    try:
        header = reply.request.headers.get("Authorization", "")  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # not a response, or one without its request
        return
    token = str(header).partition(" ")[2].strip()
    if not token:
        return
    exc.args = tuple(
        proto.redact_answer(arg, (token,)) if isinstance(arg, str) else arg for arg in exc.args
    )
    for name, value in vars(exc).items():
        if isinstance(value, str):
            setattr(exc, name, proto.redact_answer(value, (token,)))
    if any(c is not None and token in str(c) for c in (exc.__cause__, exc.__context__)):
        exc.__cause__ = exc.__context__ = None


def drive(op: Op[T], perform: Callable[[Call], Reply]) -> T:
    """Run ``op`` synchronously; ``perform`` sends one call."""
    stepper = Stepper(op)
    while (call := stepper.advance()) is not None:
        try:
            stepper.reply = perform(call)
        except BaseException as exc:  # thrown into the operation, which decides
            stepper.error = exc
    return stepper.result


# --------------------------------------------------------------------------------------------
# Options shared by the sync and async signatures


class CreateOptions(TypedDict, total=False):
    """Keyword arguments of ``create_sandbox`` after the upstream positional ones."""

    template: str | None
    annotations: Mapping[str, str] | None
    shutdown_after_seconds: int | None
    env: Mapping[str, str] | None
    idempotency_key: str | None
    claim_name: str | None
    adopt_existing: bool
    volume_claim_templates: Any
    pod_labels: Mapping[str, str] | None
    pod_annotations: Mapping[str, str] | None


class ConnectOptions(TypedDict, total=False):
    """Where the broker is and who I am, for ``Sandbox.create/connect/list``."""

    auth: CredentialSource | None
    broker_url: str | None
    ca_cert: str | os.PathLike[str] | None
    config: BrokerConnectionConfig | None
    environ: Mapping[str, str] | None


class SandboxCreateOptions(ConnectOptions, total=False):
    """Keyword arguments of ``Sandbox.create``."""

    annotations: Mapping[str, str] | None
    env: Mapping[str, str] | None
    lifetime_seconds: int | None
    ready_timeout: float | None
    request_timeout: float | None
    allow_insecure_http: bool | None
    idempotency_key: str | None


class RunOptions(TypedDict, total=False):
    """Keyword arguments of ``commands.run`` after ``timeout``."""

    command_timeout: float | None
    env: dict[str, str] | None
    cwd: str | None
    raise_on_timeout: bool


def check_options(
    what: str, options: Mapping[str, Any], kind: Any, named: tuple[str, ...] = ()
) -> None:
    """Refuse keyword arguments ``kind`` (a TypedDict) does not declare, as Python would for
    an explicit signature; ``named``: the function's named parameters (accepted too, so they
    are listed and suggested)."""
    known = kind.__required_keys__ | kind.__optional_keys__
    unknown = sorted(set(options) - known)
    if unknown:
        raise unexpected_keywords(what, unknown, {*known, *named})


def unexpected_keywords(what: str, unknown: Iterable[str], known: Iterable[str]) -> TypeError:
    """The TypeError for misspelt keyword arguments: each with the closest accepted name
    (``templte`` -> did you mean 'template'?), then every accepted name."""
    accepted = sorted(known)
    names = []
    for name in unknown:
        close = difflib.get_close_matches(name, accepted, n=1)
        names.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    plural = "s" if len(names) > 1 else ""
    return TypeError(
        f"{what} got unexpected keyword argument{plural} {', '.join(names)}; "
        f"it accepts {', '.join(accepted)}."
    )


# --------------------------------------------------------------------------------------------
# Control plane


def _json_object(reply: Reply, spec: proto.RequestSpec) -> dict[str, Any]:
    result = proto.parse_json(reply.content, spec.what)
    if not isinstance(result, dict):
        raise proto._protocol_error(spec.what, "expected a JSON object")
    return result


def whoami() -> Op[dict[str, Any]]:
    spec = proto.whoami()
    result = _json_object((yield Call(spec)), spec)
    for key in ("attributes", "policy"):
        value = result.get(key)
        if value is not None and not isinstance(value, dict):
            raise proto._protocol_error(
                spec.what, f"{key!r} is a {type(value).__name__}, not a JSON object"
            )
    return result


def list_sandboxes(label_selector: Mapping[str, str] | str | None) -> Op[list[proto.SandboxInfo]]:
    spec = proto.list_sandboxes(label_selector)
    reply = yield Call(spec)
    return proto.parse_sandbox_list(proto.parse_json(reply.content, spec.what))


def get_info(name: str) -> Op[proto.SandboxInfo]:
    spec = proto.get(name)
    reply = yield Call(spec)
    return proto.parse_sandbox(proto.parse_json(reply.content, spec.what))


def delete(name: str, *, cleanup: bool = False) -> Op[bool]:
    """Delete ``name``; ``False`` if it was already gone (404)."""
    reply = yield Call(proto.delete(name), cleanup=cleanup)
    return reply.status_code != 404


def check_phase(
    info: proto.SandboxInfo, ready_timeout: float, remaining: float, *, creating: bool
) -> bool:
    """``True`` if ``info`` is Ready; raise if it never will be or the time is up."""
    deleted = "; its claim is deleted" if creating else ""
    if info.phase == "Ready" or info.ready:
        return True
    phase = proto.redact_answer(info.phase)  # the broker's words, quoted in messages
    reason = proto.redact_answer(info.reason) if info.reason else None
    message = proto.redact_answer(info.message) if info.message else None
    if info.phase == "Terminating":
        raise errors.SandboxTerminatingError(
            f"Sandbox {info.name!r} is being deleted (Terminating) and will not become "
            "ready; create a new one with Sandbox.create().",
            name=info.name,
        )
    if info.phase == "Failed":
        raise errors.SandboxFailedError(
            f"Sandbox {info.name!r} is {phase} and will not become ready{deleted} "
            f"(reason: {reason or 'none given'}; {message or 'no message'}). "
            "Check the template and your policy (`agent-sandbox-awx whoami`), then "
            "create a new sandbox.",
            name=info.name,
            reason=reason,
            detail=message,
        )
    if remaining <= 0:
        raise errors.SandboxReadyTimeoutError(
            f"Sandbox {info.name!r} did not become ready within {ready_timeout:g}s "
            f"(phase {phase}){deleted}. Pass a larger ready_timeout= "
            "(or sandbox_ready_timeout=), or ask the broker's operator why the template "
            "starts slowly.",
            name=info.name,
            ready_timeout=ready_timeout,
            phase=phase,
        )
    return False


def wait_ready(
    info: proto.SandboxInfo,
    ready_timeout: float,
    request_timeout: float,
    *,
    creating: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> Op[proto.SandboxInfo]:
    """Long-poll the broker until ``info`` is Ready; raise on Failed or at the timeout.

    ``creating``: the caller deletes the claim on failure (the messages say so)."""
    deadline = clock() + ready_timeout
    while not check_phase(info, ready_timeout, deadline - clock(), creating=creating):
        remaining = deadline - clock()
        spec = proto.get(info.name, wait_ready=remaining, request_timeout=request_timeout)
        reply = yield Call(spec)
        info = proto.parse_sandbox(proto.parse_json(reply.content, spec.what), spec.what)
    return info


@dataclass(frozen=True)
class CreatePlan:
    spec: proto.RequestSpec
    ready_timeout: float
    request_timeout: float


def plan_create(
    config: BrokerConnectionConfig,
    warmpool: str | None,
    namespace: str | None,
    sandbox_ready_timeout: float | None,
    labels: Mapping[str, str] | None,
    options: CreateOptions,
) -> CreatePlan:
    """Check ``create_sandbox``'s arguments and build its request."""
    check_options(
        "create_sandbox()",
        options,
        CreateOptions,
        ("warmpool", "namespace", "sandbox_ready_timeout", "labels"),
    )
    unsupported = ("claim_name", "adopt_existing", "volume_claim_templates", "pod_labels")
    given = sorted(k for k in (*unsupported, "pod_annotations") if options.get(k))
    if given:
        raise errors.ConfigurationError(
            f"{', '.join(given)} cannot be used through the broker: it names claims and "
            "builds their spec itself. Use labels=/annotations=/env= instead."
        )
    template = options.get("template")
    if template and warmpool and template != warmpool:
        raise errors.ConfigurationError(
            f"template={template!r} and warmpool={warmpool!r} differ; pass only template=."
        )
    if namespace is not None:
        logger.debug("namespace=%r ignored: the broker's policy decides it", namespace)
    ready_timeout = (
        config.ready_timeout if sandbox_ready_timeout is None else float(sandbox_ready_timeout)
    )
    if not ready_timeout >= 0:  # also NaN, which no comparison ever ends
        raise ValueError(
            f"sandbox_ready_timeout (ready_timeout=) must be a number of seconds >= 0, got "
            f"{sandbox_ready_timeout}; pass, e.g., 180."
        )
    spec = proto.create(
        idempotency_key=options.get("idempotency_key") or proto.new_idempotency_key(),
        template=template or warmpool or config.template,
        labels=labels,
        annotations=options.get("annotations"),
        lifetime_seconds=options.get("shutdown_after_seconds"),
        env=options.get("env"),
    )
    return CreatePlan(spec, ready_timeout, config.request_timeout)


def _outcome_unknown(exc: BaseException) -> bool:
    """Whether the broker may have created the sandbox although we saw no answer: the create
    was interrupted (Ctrl-C, cancellation) or timed out, or the connection broke, after the
    request may have reached the broker. A request that never left (no connection, a TLS
    certificate that did not verify) cannot have created anything."""
    if not isinstance(exc, Exception):
        return True
    if isinstance(exc, errors.RequestTimeoutError | errors.BrokerUnavailableError):
        return exc.request_sent
    return False


def create(plan: CreatePlan) -> Op[proto.SandboxInfo]:
    """Create a sandbox and wait until it is Ready. If anything fails after the claim was
    created (ready timeout, Failed phase, Ctrl-C, cancellation), it is deleted before raising."""
    spec = plan.spec
    try:
        reply = yield Call(spec)
    except BaseException as exc:
        if not _outcome_unknown(exc):
            raise
        # The broker may have created the sandbox without us seeing the answer: replay the
        # create with the same Idempotency-Key (which returns that sandbox) and delete it.
        yield from _abandon_create(spec, exc)
        raise
    try:
        info = proto.parse_sandbox(proto.parse_json(reply.content, spec.what), spec.what)
    except errors.BrokerProtocolError as exc:
        name = _created_name(reply.content)
        if name is not None:  # a sandbox was made although its answer is unusable
            yield from _rollback(name, exc)
        raise
    logger.info("created sandbox %s (template %s)", info.name, info.template)
    try:
        return (
            yield from wait_ready(info, plan.ready_timeout, plan.request_timeout, creating=True)
        )
    except BaseException as exc:
        yield from _rollback(info.name, exc)
        raise


def _created_name(body: bytes) -> str | None:
    """The sandbox name in a create answer that did not parse as a Sandbox object, if any."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    name = obj.get("name") if isinstance(obj, dict) else None
    return name if isinstance(name, str) and name else None


def _abandon_create(spec: proto.RequestSpec, exc: BaseException) -> Op[None]:
    try:
        reply = yield Call(spec, cleanup=True)
        name = proto.parse_sandbox(proto.parse_json(reply.content, spec.what)).name
    except Exception as replay_error:
        logger.warning(
            "could not check whether an interrupted create left a sandbox: %s", replay_error
        )
        exc.add_note(
            "The create was interrupted and the broker could not be asked whether it created "
            "a sandbox; check with `agent-sandbox-awx ls` and kill any leftover."
        )
        return
    yield from _rollback(name, exc)


def _rollback(name: str, exc: BaseException) -> Op[None]:
    try:
        yield from delete(name, cleanup=True)
        logger.info("deleted sandbox %s after a failed create", name)
    except Exception as cleanup_error:
        logger.error("could not delete sandbox %s after a failed create: %s", name, cleanup_error)
        exc.add_note(
            f"The sandbox {name!r} could not be deleted ({cleanup_error}); delete it with "
            f"`agent-sandbox-awx kill {name}`."
        )


def client_overrides(
    options: ConnectOptions | SandboxCreateOptions,
) -> tuple[BrokerConnectionConfig | None, dict[str, Any]]:
    """The explicit config and the settings that override it (or the environment)."""
    import os

    ca = options.get("ca_cert")
    settings: dict[str, Any] = {
        "broker_url": options.get("broker_url"),
        "ca_cert": os.fspath(ca) if ca is not None else None,
        "request_timeout": options.get("request_timeout"),
        "allow_insecure_http": options.get("allow_insecure_http"),
    }
    overrides = {k: v for k, v in settings.items() if v is not None}
    config = options.get("config")
    if config is not None and overrides:
        data = config.model_dump()
        data.update(overrides)
        if "broker_url" in overrides:
            data.pop("api_url", None)
        return type(config).model_validate(data), {}
    return config, overrides


def sandbox_create_args(
    template: str | None, options: SandboxCreateOptions
) -> tuple[float | None, CreateOptions]:
    """``Sandbox.create``'s options as ``create_sandbox``'s (ready timeout, options)."""
    check_options("create()", options, SandboxCreateOptions, ("template", "labels"))
    return options.get("ready_timeout"), CreateOptions(
        template=template,
        annotations=options.get("annotations"),
        env=options.get("env"),
        shutdown_after_seconds=options.get("lifetime_seconds"),
        idempotency_key=options.get("idempotency_key"),
    )


# --------------------------------------------------------------------------------------------
# Data plane


@dataclass(frozen=True)
class CommandPlan:
    spec: proto.RequestSpec
    limit: float
    raise_on_timeout: bool


def plan_command(
    router: proto.RouterTarget, command: str, timeout: float, options: RunOptions
) -> CommandPlan:
    check_options("commands.run()", options, RunOptions, ("command", "timeout"))
    if options.get("env") or options.get("cwd"):
        raise NotImplementedError(
            "env and cwd are not supported by the legacy python-runtime behind the broker; "
            "set variables at create time (Sandbox.create(env=...)) or prefix the command."
        )
    given = options.get("command_timeout")
    limit = float(given if given is not None else timeout)
    spec = proto.execute(router, command, command_timeout=limit)
    return CommandPlan(spec, limit, options.get("raise_on_timeout", True))


def run_command(router: proto.RouterTarget, plan: CommandPlan) -> Op[ExecutionResult]:
    """``POST /execute`` (never retried); a command over its limit raises
    :class:`errors.CommandTimeoutError` unless ``raise_on_timeout`` is off."""
    limit = plan.limit
    try:
        reply = yield Call(plan.spec)
    except errors.RequestTimeoutError as exc:
        raise errors.CommandTimeoutError(
            f"No answer for the command within its time limit of {limit:g}s plus "
            f"{proto.COMMAND_TIMEOUT_MARGIN:g}s; it may still be running in sandbox "
            f"{router.sandbox_id!r}. Pass a larger timeout= to commands.run.",
            command_timeout=limit,
        ) from exc
    result = proto.parse_execution_result(proto.parse_json(reply.content, "run a command"))
    if result.timed_out and plan.raise_on_timeout:
        raise errors.CommandTimeoutError(
            f"The command ran longer than its time limit of {limit:g}s and was killed "
            f"(exit code {result.exit_code}). Pass a larger timeout= to commands.run, or "
            "raise_on_timeout=False to get the partial output as a result.",
            command_timeout=limit,
            result=result,
        )
    logger.debug("command finished in sandbox %s: exit %s", router.sandbox_id, result.exit_code)
    return result


def file_path(path: str, allow_unsafe_paths: bool) -> str:
    return proto.validate_sandbox_path(path, allow_unsafe=allow_unsafe_paths)


def _with_timeout(spec: proto.RequestSpec, timeout: float | None) -> proto.RequestSpec:
    if timeout is not None:
        spec.read_timeout = float(timeout)
    return spec


def download_spec(
    router: proto.RouterTarget, path: str, timeout: float | None, allow_unsafe_paths: bool
) -> tuple[str, proto.RequestSpec]:
    src = file_path(path, allow_unsafe_paths)
    return src, _with_timeout(proto.download(router, src), timeout)


def read_file(
    router: proto.RouterTarget, path: str, timeout: float | None, allow_unsafe_paths: bool
) -> Op[bytes]:
    reply = yield Call(download_spec(router, path, timeout, allow_unsafe_paths)[1])
    return reply.content


def list_files(router: proto.RouterTarget, path: str, timeout: float | None) -> Op[list[FileEntry]]:
    src = proto.validate_sandbox_path(path, allow_root=True)
    spec = _with_timeout(proto.list_files(router, src), timeout)
    reply = yield Call(spec)
    return proto.parse_file_entries(proto.parse_json(reply.content, spec.what), src)


def file_exists(router: proto.RouterTarget, path: str, timeout: float | None) -> Op[bool]:
    src = proto.validate_sandbox_path(path, allow_root=True)
    spec = _with_timeout(proto.exists(router, src), timeout)
    reply = yield Call(spec)
    return proto.parse_exists(proto.parse_json(reply.content, spec.what), src)
