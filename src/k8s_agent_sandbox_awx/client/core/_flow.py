"""The operations of the client, written once for the sync and the async API.

An operation that has steps (create → wait until Ready → roll back on failure) is a generator
that yields :class:`Call`s and receives their parsed answers; the transports run it with the one
driver (``_driver``): ``transport.run(op)``. An exception raised while a call is performed (a
broker error, Ctrl-C, an ``asyncio`` cancellation) is thrown back into the generator, so the
cleanup decisions live here; a cleanup call is marked ``cleanup=True`` so that the async
transport completes it even while the task is being cancelled. An operation of one request is
just a :class:`Call` (``transport.call(...)``): the dialect's. Also here: what to create
(:class:`SandboxSpec`), from the keyword options in any of their spellings (``_options``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ... import errors
from ..wire import _protocol as proto
from ..wire._dialect import REPLAY_CREATE, CreateRequest, Dialect
from ._options import (
    CREATE,
    Given,
    UpstreamCreateOptions,
    check_options,
    sdk_spelling,
)
from ._steps import Call, Op

__all__ = [
    "Call",
    "SandboxSpec",
    "create",
    "wait_ready",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Control plane: the operations with steps


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
    dialect: Dialect,
    info: proto.SandboxInfo,
    ready_timeout: float,
    request_timeout: float,
    *,
    creating: bool = False,
    poll_interval: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
) -> Op[proto.SandboxInfo]:
    """Wait (the dialect's long-poll or status poll) until ``info`` is Ready; raise on Failed or
    at the timeout. ``creating``: the caller deletes the claim on failure (the messages say so);
    ``poll_interval``: the longest pause between two status polls (a polling dialect)."""
    deadline = clock() + ready_timeout
    poll = 0
    while not check_phase(info, ready_timeout, deadline - clock(), creating=creating):
        info = yield dialect.wait_ready(
            info.name, deadline - clock(), request_timeout, poll=poll, poll_interval=poll_interval
        )
        poll += 1
    return info


class CreateDefaults(Protocol):
    """What a create takes from the client's configuration (``BrokerConnectionConfig``)."""

    @property
    def template(self) -> str | None: ...
    @property
    def ready_timeout(self) -> float: ...
    @property
    def request_timeout(self) -> float: ...
    @property
    def poll_interval(self) -> float: ...
    @property
    def sandbox_timeout(self) -> int: ...
    @property
    def model_fields_set(self) -> set[str]:
        """The settings given (a keyword or a variable), not defaulted."""
        ...


@dataclass(frozen=True)
class CreatePlan:
    dialect: Dialect
    spec: proto.RequestSpec
    ready_timeout: float
    request_timeout: float
    keepalive: int | None = None
    poll_interval: float = 2.0


@dataclass(frozen=True)
class SandboxSpec:
    """What to create, in the SDK's vocabulary (``Sandbox.create``'s names)."""

    template: str | None = None
    labels: Mapping[str, str] | None = None
    annotations: Mapping[str, str] | None = None
    """``annotations=`` (E2B's ``metadata=``)."""
    envs: Mapping[str, str] | None = None
    """``envs=`` (upstream's ``env=``): the sandbox's environment variables."""
    lifetime_seconds: int | None = None
    """``timeout=``: the sandbox's lifetime (``None``: the config's ``sandbox_timeout``)."""
    ready_timeout: float | None = None
    idempotency_key: str | None = None
    keepalive: int | None = None
    pod_labels: Mapping[str, str] | None = None
    pod_annotations: Mapping[str, str] | None = None
    scopes: Sequence[str] | None = None


def _sandbox_spec(options: Mapping[str, Any], given: Given) -> SandboxSpec:
    """The spec from options in the SDK's names (``given``: the keywords they were given as),
    checked as far as it can be before the broker's dialect is known (before anything is
    sent, also a detection probe)."""
    options = {**options}
    lifetime = options.pop("timeout", None)
    options["lifetime_seconds"] = _seconds(given.get("timeout", "timeout"), lifetime)
    keepalive = options.get("keepalive")
    options["keepalive"] = _seconds(given.get("keepalive", "keepalive"), keepalive, allow_zero=True)
    names = [f.name for f in dataclasses.fields(SandboxSpec)]
    spec = SandboxSpec(**{name: options.get(name) for name in names})
    for name in ("labels", "annotations", "envs", "pod_labels", "pod_annotations"):
        value = proto.str_mapping(given.get(name, name), getattr(spec, name))
        if name != "envs":
            proto.check_reserved_metadata(given.get(name, name), name, value)
    spec = dataclasses.replace(spec, scopes=proto.scope_names(spec.scopes))
    ready_timeout(spec, None)
    return spec


def ready_timeout(spec: SandboxSpec, config: CreateDefaults | None) -> float:
    """The ready timeout: the spec's, else the config's (checked: a number >= 0)."""
    given = spec.ready_timeout
    if given is None:
        return config.ready_timeout if config is not None else 0.0
    value = float(given)
    if not value >= 0:  # also NaN, which no comparison ever ends
        raise ValueError(
            f"ready_timeout (sandbox_ready_timeout=) must be a number of seconds >= 0, got "
            f"{given}; pass, e.g., 180."
        )
    return value


def spec_from_create(
    template: str | None, labels: Mapping[str, str] | None, options: Mapping[str, Any]
) -> SandboxSpec:
    """``Sandbox.create``'s arguments (the original package's spellings too; its keywords
    checked by the shell against its signature)."""
    return _sandbox_spec(*sdk_spelling({"template": template, "labels": labels, **options}))


def _seconds(name: str, value: Any, *, allow_zero: bool = False) -> int | None:
    """A whole number of seconds for ``name=`` (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}= must be a whole number of seconds, e.g. 300; got {value!r}.")
    if not math.isfinite(value):  # before int(): NaN and infinity have no int
        raise ValueError(
            f"{name}= must be a finite whole number of seconds, e.g. 300; got {value!r}."
        )
    if value != int(value):
        raise TypeError(f"{name}= must be a whole number of seconds, e.g. 300; got {value!r}.")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}= must be a positive number of seconds, got {value!r}.")
    return int(value)


def sandbox_timeout(spec_seconds: int | None, config: CreateDefaults) -> int | None:
    """The lifetime a create asks for: ``timeout=``, else ``AGENT_SANDBOX_TTL_SECONDS`` (or the
    original package's ``SANDBOX_TTL_SECONDS``; 300 s by default, cut at the policy's cap by a
    broker that knows :func:`lifetime_is_default`'s mark; 0: none, the policy's maximum)."""
    if spec_seconds is not None:
        return spec_seconds
    return config.sandbox_timeout or None


def lifetime_is_default(spec_seconds: int | None, config: CreateDefaults) -> bool:
    """Whether a create's lifetime is the SDK's default (300 s): the caller gave no
    ``timeout=`` and no ``AGENT_SANDBOX_TTL_SECONDS`` (nor ``sandbox_timeout=``). Only that one
    is marked for the broker to cut at its policy's cap (``Prefer: clamp-lifetime``); a
    lifetime the caller chose past the cap stays a refusal."""
    return spec_seconds is None and "sandbox_timeout" not in config.model_fields_set


def spec_from_upstream(
    warmpool: str | None,
    namespace: str | None,
    sandbox_ready_timeout: float | None,
    labels: Mapping[str, str] | None,
    options: UpstreamCreateOptions,
) -> SandboxSpec:
    """``create_sandbox``'s arguments, upstream ``SandboxClient``'s spellings (mapped by
    :func:`sdk_spelling`); what the broker decides itself (claim names, adoption, volumes) is
    refused."""
    check_options(
        "create_sandbox()",
        options,
        UpstreamCreateOptions,
        ("warmpool", "namespace", "sandbox_ready_timeout", "labels"),
        where=CREATE,
    )
    unsupported = ("claim_name", "adopt_existing", "volume_claim_templates")
    given = sorted(k for k in unsupported if options.get(k))
    if given:
        raise errors.ConfigurationError(
            f"{', '.join(given)} cannot be used through the broker: it names claims and "
            "builds their spec itself. Use labels=/annotations=/env= instead."
        )
    positional: dict[str, Any] = {"warmpool": warmpool, "namespace": namespace, "labels": labels}
    positional["sandbox_ready_timeout"] = sandbox_ready_timeout
    return _sandbox_spec(*sdk_spelling({**positional, **options}))


def plan_create(config: CreateDefaults, dialect: Dialect, spec: SandboxSpec) -> CreatePlan:
    """Check what to create and build its request (before anything is sent but a detection
    probe)."""
    request = CreateRequest(
        idempotency_key=spec.idempotency_key or proto.new_idempotency_key(),
        template=spec.template or config.template,
        labels=spec.labels or {},
        annotations=spec.annotations or {},
        lifetime_seconds=sandbox_timeout(spec.lifetime_seconds, config),
        lifetime_is_default=lifetime_is_default(spec.lifetime_seconds, config),
        env=spec.envs or {},
        pod_labels=spec.pod_labels or {},
        pod_annotations=spec.pod_annotations or {},
        scopes=tuple(spec.scopes) if spec.scopes is not None else None,
    )
    return CreatePlan(
        dialect,
        dialect.create(request),
        ready_timeout(spec, config),
        config.request_timeout,
        spec.keepalive,
        config.poll_interval,
    )


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
    dialect, spec = plan.dialect, plan.spec
    try:
        reply = yield Call(spec, proto.raw)
    except BaseException as exc:
        if not _outcome_unknown(exc):
            raise
        # The broker may have created the sandbox without us seeing the answer: replay the
        # create with the same Idempotency-Key (which returns that sandbox) and delete it.
        yield from _abandon_create(plan, exc)
        raise
    try:
        info = dialect.parse_created(reply, spec)
    except errors.BrokerProtocolError as exc:
        name = dialect.created_name(reply.content)
        if name is not None:  # a sandbox was made although its answer is unusable
            yield from _rollback(dialect, name, exc)
        raise
    logger.info("created sandbox %s (template %s)", info.name, info.template)
    try:
        return (
            yield from wait_ready(
                dialect,
                info,
                plan.ready_timeout,
                plan.request_timeout,
                creating=True,
                poll_interval=plan.poll_interval,
            )
        )
    except BaseException as exc:
        yield from _rollback(dialect, info.name, exc)
        raise


def _abandon_create(plan: CreatePlan, exc: BaseException) -> Op[None]:
    dialect, spec = plan.dialect, plan.spec
    if REPLAY_CREATE not in dialect.features:
        exc.add_note(
            f"The create was interrupted after it was sent, and the broker's {dialect.name!r} "
            "dialect cannot replay a create to find out whether it made a sandbox (it has no "
            "idempotency key and no list). A sandbox may exist: it ends at its lifetime "
            "(lifetime_seconds=, or the broker policy's maximum)."
        )
        return
    try:
        reply = yield Call(spec, proto.raw, cleanup=True)
        name = dialect.parse_created(reply, spec).name
    except Exception as replay_error:
        logger.warning(
            "could not check whether an interrupted create left a sandbox: %s", replay_error
        )
        exc.add_note(
            "The create was interrupted and the broker could not be asked whether it created "
            "a sandbox; check with `agent-sandbox-awx ls` and kill any leftover."
        )
        return
    yield from _rollback(dialect, name, exc)


def _rollback(dialect: Dialect, name: str, exc: BaseException) -> Op[None]:
    try:
        yield cleanup(dialect.delete(name, purpose="create_cleanup"))
        logger.info("deleted sandbox %s after a failed create", name)
    except Exception as cleanup_error:
        logger.error("could not delete sandbox %s after a failed create: %s", name, cleanup_error)
        exc.add_note(
            f"The sandbox {name!r} could not be deleted ({cleanup_error}); delete it with "
            f"`agent-sandbox-awx kill {name}`."
        )


def cleanup(call: Call[T]) -> Call[T]:
    """``call`` marked as a cleanup: it completes even while the caller is cancelled."""
    return dataclasses.replace(call, cleanup=True)
