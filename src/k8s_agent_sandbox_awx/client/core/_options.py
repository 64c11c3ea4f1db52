"""The keyword options of the public signatures (those of ``create_sandbox`` and
``commands.run``; ``Sandbox.create``'s and ``connect``'s name the connection settings, in the
shells' ``_base``) and the one table of their other spellings (no I/O).

:data:`SPELLINGS` is the only place that knows the names upstream ``SandboxClient``, the
original package of this name and the SDK's 0.5.0 gave an option: each row says the SDK's name
for it, whose spelling it is and where it means that (a create, a command's run, attaching to
a sandbox). The create paths rename what they accept with it (:func:`sdk_spelling`), and the
error for an unknown keyword suggests from it (:func:`unexpected_keywords`), so the two never
disagree; an error names a keyword as it was given (:data:`Given`).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from ... import errors

__all__ = [
    "ATTACH",
    "CREATE",
    "RUN",
    "SPELLINGS",
    "Given",
    "RunOptions",
    "Spelling",
    "UpstreamCreateOptions",
    "check_options",
    "run_spelling",
    "sdk_spelling",
    "unexpected_keywords",
    "upstream_timeout",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.client")


# --------------------------------------------------------------------------------------------
# The signatures' keyword options


class UpstreamCreateOptions(TypedDict, total=False):
    """Keyword arguments of ``create_sandbox`` after the upstream positional ones (upstream's
    spellings; renamed by :func:`sdk_spelling`)."""

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
    scopes: Sequence[str] | None
    keepalive_ttl_seconds: int | None
    backend: str | None


OutputCallback = Callable[[str], Any]
"""``on_stdout``/``on_stderr``: called with each chunk of text as it is produced (an async
sandbox also awaits what a callback returns, so a coroutine function works)."""


class RunOptions(TypedDict, total=False):
    """Keyword arguments of ``commands.run`` after ``timeout`` (and ``background``)."""

    shell: bool | None
    envs: Mapping[str, str] | None
    env: Mapping[str, str] | None
    """Upstream's spelling of ``envs`` (both accepted; ``envs`` is the SDK's and E2B's)."""
    cwd: str | None
    stdin: bool
    on_stdout: OutputCallback | None
    on_stderr: OutputCallback | None
    raise_on_timeout: bool


# --------------------------------------------------------------------------------------------
# The one table of spellings

CREATE = "create"
"""``Sandbox.create`` and ``create_sandbox``: what to create."""
RUN = "run"
"""``commands.run``: one command."""
ATTACH = "attach"
"""``Sandbox.connect``, ``get_sandbox``: attaching to a sandbox by name."""

_UPSTREAM = "upstream's"
_BOTH = "upstream's and the original package's"
_ORIGINAL = "the original package's"
_E2B = "E2B's"


@dataclass(frozen=True)
class Spelling:
    """Another project's name for one of the SDK's options."""

    sdk: str
    """The SDK's name."""
    origin: str
    """Whose spelling it is, for messages ("upstream's", "the original package's", ...)."""
    where: frozenset[str]
    """The calls where it means :attr:`sdk` (:data:`CREATE`, :data:`RUN`, :data:`ATTACH`):
    only there is it suggested for an unknown keyword."""
    renamed: bool = False
    """Accepted by the create paths and renamed to :attr:`sdk` (:func:`sdk_spelling`)."""


SPELLINGS: dict[str, Spelling] = {
    "env": Spelling("envs", _UPSTREAM, frozenset({CREATE, RUN}), renamed=True),
    "metadata": Spelling("annotations", _E2B, frozenset({CREATE}), renamed=True),
    "warmpool": Spelling("template", _BOTH, frozenset({CREATE}), renamed=True),
    "sandbox_ready_timeout": Spelling("ready_timeout", _BOTH, frozenset({CREATE}), renamed=True),
    "shutdown_after_seconds": Spelling("timeout", _BOTH, frozenset({CREATE}), renamed=True),
    "lifetime_seconds": Spelling("timeout", "the SDK 0.5.0's", frozenset({CREATE}), renamed=True),
    "keepalive_ttl_seconds": Spelling("keepalive", _ORIGINAL, frozenset({CREATE}), renamed=True),
    "resolve_timeout": Spelling("ready_timeout", _UPSTREAM, frozenset({ATTACH, CREATE})),
    "claim_name": Spelling("name", _UPSTREAM, frozenset({ATTACH})),
    "command_timeout": Spelling("timeout", _UPSTREAM, frozenset({RUN})),
}
"""Every other spelling a call accepts or suggests, by that spelling. The calls accept the
``renamed`` ones where they mean the SDK's name (where their signature declares them): the
create paths (:func:`sdk_spelling`) and ``commands.run`` (:func:`run_spelling`: upstream's and
E2B's ``env``); ``BrokerSandboxClient``'s handles accept ``command_timeout`` too
(:func:`upstream_timeout`); anywhere else a spelling is only suggested, where it means the
SDK's name."""

Given = Mapping[str, str]
"""The SDK's name of an option → the keyword it was given as (when that was another
spelling): what its errors name."""


def check_options(
    what: str,
    options: Mapping[str, Any],
    kind: Any,
    named: tuple[str, ...] = (),
    *,
    where: str | None = None,
) -> None:
    """Refuse keyword arguments ``kind`` (a TypedDict) does not declare, as Python would for
    an explicit signature; ``named``: the function's named parameters (accepted too, so they
    are listed and suggested); ``where``: the kind of call (:data:`CREATE`, ...), for the
    suggestions."""
    known = kind.__required_keys__ | kind.__optional_keys__
    unknown = sorted(set(options) - known)
    if unknown:
        raise unexpected_keywords(what, unknown, {*known, *named}, where)


def _suggestion(name: str, accepted: list[str], where: str | None) -> str | None:
    """The accepted name ``name`` was meant as: the SDK's name of a spelling that means it
    here; where the SDK's name is not accepted, the spelling of it that is; else the closest."""
    spelling = SPELLINGS.get(name)
    if spelling is not None and where in spelling.where and spelling.sdk in accepted:
        return spelling.sdk
    same = [old for old, s in SPELLINGS.items() if s.sdk == name and where in s.where]
    same = [old for old in same if old in accepted]
    if same:
        return same[0]
    close = difflib.get_close_matches(name, accepted, n=1)
    return close[0] if close else None


def unexpected_keywords(
    what: str, unknown: Iterable[str], known: Iterable[str], where: str | None = None
) -> TypeError:
    """The TypeError for misspelt keyword arguments: each with the accepted name it was likely
    meant as (``templte`` -> did you mean 'template'?), then every accepted name."""
    accepted = sorted(known)
    names = []
    for name in unknown:
        meant = _suggestion(name, accepted, where)
        names.append(f"{name!r} (did you mean {meant!r}?)" if meant else repr(name))
    plural = "s" if len(names) > 1 else ""
    return TypeError(
        f"{what} got unexpected keyword argument{plural} {', '.join(names)}; "
        f"it accepts {', '.join(accepted)}."
    )


def _shown(name: str, value: Any) -> str:
    """``name=value`` for a message; a mapping's contents are never shown (an environment
    variable or an annotation may hold a secret)."""
    return f"{name}={{...}}" if isinstance(value, Mapping) else f"{name}={value!r}"


def _conflict(sdk: str, values: list[tuple[str, Any]]) -> errors.ConfigurationError:
    """Two spellings of ``sdk`` given different values: names each as given."""
    shown = [_shown(name, value) for name, value in values]
    listed = ", ".join(shown[:-1]) + f" and {shown[-1]}"
    other = next(name for name, _ in values if name != sdk)
    return errors.ConfigurationError(
        f"{listed} differ; pass only {sdk}= ({other}= is {SPELLINGS[other].origin} name for it)."
    )


def _renamed(given: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``given`` with the ``renamed`` spellings that mean an SDK option ``where`` renamed to
    the SDK's names (``None`` values dropped), and which keyword each renamed option was given
    as; the same option given in two spellings with different values is an error naming both."""
    out: dict[str, Any] = {}
    spelt: dict[str, list[tuple[str, Any]]] = {}
    for name, value in given.items():
        spelling = SPELLINGS.get(name)
        renamed = spelling is not None and spelling.renamed and where in spelling.where
        sdk = spelling.sdk if spelling is not None and renamed else name
        if value is not None:
            spelt.setdefault(sdk, []).append((name, value))
    names: dict[str, str] = {}
    for sdk, values in spelt.items():
        values.sort(key=lambda item: item[0] != sdk)  # the SDK's own name first
        first = values[0][1]
        if any(value is not first and value != first for _, value in values):  # NaN is itself
            raise _conflict(sdk, values)
        out[sdk] = values[0][1]
        if values[0][0] != sdk:
            names[sdk] = values[0][0]
    return out, names


def sdk_spelling(given: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A create's ``given`` options with the other spellings it accepts renamed to the SDK's
    (:func:`_renamed`), and which keyword each renamed option was given as; ``backend`` must be
    ``kubernetes`` and ``namespace`` is the broker's to decide (both dropped)."""
    out, names = _renamed(given, CREATE)
    backend = out.pop("backend", "kubernetes")
    if backend != "kubernetes":
        raise errors.ConfigurationError(
            f"backend={backend!r} is not supported: this SDK creates sandboxes on the broker's "
            "Kubernetes backend only; leave backend= out."
        )
    namespace = out.pop("namespace", None)
    if namespace is not None:
        logger.debug("namespace=%r: the broker's policy decides the namespace", namespace)
    return out, names


def run_spelling(options: RunOptions) -> RunOptions:
    """``commands.run``'s options with the other spellings it accepts (``env`` for ``envs``)
    renamed to the SDK's; both given with different values is a ``TypeError`` naming both."""
    try:
        out, _ = _renamed(options, RUN)
    except errors.ConfigurationError as exc:
        raise TypeError(f"commands.run(): {exc}") from None
    renamed: RunOptions = {**out}  # type: ignore[typeddict-item]
    return renamed


# --------------------------------------------------------------------------------------------
# Upstream's spellings of commands.run (the handles BrokerSandboxClient returns)


def upstream_timeout(timeout: float | None, command_timeout: float | None) -> float | None:
    """Upstream ``commands.run``'s two limits as the SDK's one: ``command_timeout`` (the
    command's limit) wins if given."""
    return timeout if command_timeout is None else command_timeout
