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
    "sdk_spelling",
    "unexpected_keywords",
    "upstream_envs",
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
    "warmpool": Spelling("template", _BOTH, frozenset({CREATE}), renamed=True),
    "sandbox_ready_timeout": Spelling("ready_timeout", _BOTH, frozenset({CREATE}), renamed=True),
    "shutdown_after_seconds": Spelling("timeout", _BOTH, frozenset({CREATE}), renamed=True),
    "lifetime_seconds": Spelling("timeout", "the SDK 0.5.0's", frozenset({CREATE}), renamed=True),
    "keepalive_ttl_seconds": Spelling("keepalive", _ORIGINAL, frozenset({CREATE}), renamed=True),
    "resolve_timeout": Spelling("ready_timeout", _UPSTREAM, frozenset({ATTACH, CREATE})),
    "claim_name": Spelling("name", _UPSTREAM, frozenset({ATTACH})),
    "command_timeout": Spelling("timeout", _UPSTREAM, frozenset({RUN})),
    "env": Spelling("envs", _UPSTREAM, frozenset({RUN})),
}
"""Every other spelling a call accepts or suggests, by that spelling. The create paths accept
the ``renamed`` ones (where their signature declares them); ``BrokerSandboxClient``'s handles
accept ``command_timeout`` and ``env`` (:func:`upstream_timeout`, :func:`upstream_envs`);
anywhere else a spelling is only suggested, where it means the SDK's name."""

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


def _conflict(sdk: str, values: list[tuple[str, Any]]) -> errors.ConfigurationError:
    """Two spellings of ``sdk`` given different values: names each as given."""
    shown = [f"{name}={value!r}" for name, value in values]
    listed = ", ".join(shown[:-1]) + f" and {shown[-1]}"
    other = next(name for name, _ in values if name != sdk)
    return errors.ConfigurationError(
        f"{listed} differ; pass only {sdk}= ({other}= is {SPELLINGS[other].origin} name for it)."
    )


def sdk_spelling(given: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``given`` with the other spellings the create paths accept renamed to the SDK's
    (``None`` values dropped), and which keyword each renamed option was given as; the same
    option given in two spellings with different values is an error naming both."""
    out: dict[str, Any] = {}
    spelt: dict[str, list[tuple[str, Any]]] = {}
    for name, value in given.items():
        spelling = SPELLINGS.get(name)
        sdk = spelling.sdk if spelling is not None and spelling.renamed else name
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


# --------------------------------------------------------------------------------------------
# Upstream's spellings of commands.run (the handles BrokerSandboxClient returns)


def upstream_envs(options: RunOptions, env: Mapping[str, str] | None) -> None:
    """Upstream ``commands.run``'s ``env=`` is the SDK's ``envs=`` (both given: refused)."""
    if env is None:
        return
    if options.get("envs") is not None:
        raise TypeError("commands.run() got both env= and envs=; pass only envs=.")
    options["envs"] = env


def upstream_timeout(timeout: float, command_timeout: float | None) -> float:
    """Upstream ``commands.run``'s two limits as the SDK's one: ``command_timeout`` (the
    command's limit) wins if given."""
    return timeout if command_timeout is None else command_timeout
