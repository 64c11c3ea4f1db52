"""An error's next step, written once and spelled by the surface that shows it (issue 30).

An error knows which setting it is about (``Setting("command_timeout", 300)``), not how the
user spelled it: Python reads ``timeout=300``, the CLI ``--timeout 300``, the environment
``AGENT_SANDBOX_TTL_SECONDS=300``, the broker's configuration ``jwks_url = "..."``. A
:class:`Fix` is the sentence of the next step made of text, settings and :class:`Say` (words
that differ per surface: ``commands.run(..., background=True)`` against ``run --background``).
:func:`attach` gives an exception its fix: ``str(exc)`` is the Python reading (what the SDK's
user sees), :func:`message` the reading of another surface (the CLI's top level uses it).

Standard library only, no I/O: the client, the CLI and the broker all use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, Literal, TypeVar

__all__ = [
    "CLI",
    "CONFIG",
    "ENV",
    "PYTHON",
    "SETTINGS",
    "Fix",
    "Say",
    "Setting",
    "Spelling",
    "Surface",
    "attach",
    "message",
    "sourced",
]

Surface = Literal["python", "cli", "env", "config"]
PYTHON: Final = "python"
CLI: Final = "cli"
ENV: Final = "env"
CONFIG: Final = "config"

_E = TypeVar("_E", bound=BaseException)


@dataclass(frozen=True)
class Spelling:
    """How each surface spells one setting (``None``: that surface has no spelling of it; the
    environment's variable is then the CLI's, and Python's keyword the others')."""

    python: str | None = None
    """The keyword argument (``timeout``; rendered ``timeout=``, ``timeout=300``)."""
    cli: str | None = None
    """The flag (``--timeout``; rendered ``--timeout 300``), or a command's words
    (``extend NAME SECONDS``, rendered as they are)."""
    env: str | None = None
    """The environment variable (``AGENT_SANDBOX_TTL_SECONDS``)."""
    config: str | None = None
    """The broker configuration's key (``jwks_url``, rendered ``jwks_url = "..."``)."""
    switch: bool = False
    """A switch: Python's ``background=True``, the CLI's ``--background`` (no value)."""


SETTINGS: dict[str, Spelling] = {
    "broker_url": Spelling("broker_url", "--broker-url", "AGENT_SANDBOX_BROKER_URL"),
    "ca_bundle": Spelling("ca_cert", "--ca-bundle", "AGENT_SANDBOX_CA_BUNDLE"),
    "allow_insecure_http": Spelling("allow_insecure_http", "--allow-insecure-http", switch=True),
    "lifetime": Spelling("timeout", "--timeout", "AGENT_SANDBOX_TTL_SECONDS"),
    "command_timeout": Spelling("timeout", "--timeout"),
    "background": Spelling("background", "--background", switch=True),
    "cwd": Spelling("cwd"),
    "token": Spelling("auth", None, "AGENT_SANDBOX_TOKEN"),
    "token_file": Spelling("auth", None, "AGENT_SANDBOX_TOKEN_FILE"),
    "jwks_url": Spelling(None, None, None, "jwks_url"),
    "discovery": Spelling(None, None, None, "discovery"),
}
"""Every setting a fix may name, by its abstract name."""

_UNSET: Final[Any] = object()


@dataclass(frozen=True)
class Setting:
    """One setting, abstractly (a name of :data:`SETTINGS`), with the value to suggest
    (none: the setting alone). ``source="env"``: its value came from the environment, so every
    surface names the variable (what the user set); ``or_env``: the environment's variable
    named too, as the other way to set it (``timeout= (or AGENT_SANDBOX_TTL_SECONDS)``)."""

    name: str
    value: Any = _UNSET
    source: Surface | None = None
    or_env: bool = False

    def __post_init__(self) -> None:
        if self.name not in SETTINGS:
            raise KeyError(f"no setting {self.name!r} in SETTINGS")

    def render(self, surface: Surface) -> str:
        shown = self._render(self.source or surface)
        env = SETTINGS[self.name].env
        if self.or_env and env and env not in shown:
            value = "" if self.value is _UNSET else f"={self.value}"
            return f"{shown} (or {env}{value})"
        return shown

    def _render(self, surface: Surface) -> str:
        spelling = SETTINGS[self.name]
        if surface == CONFIG and spelling.config:
            return self._config(spelling.config)
        if surface == CLI and spelling.cli:
            return self._flag(spelling)
        if surface in (CLI, ENV) and spelling.env:
            return spelling.env if self.value is _UNSET else f"{spelling.env}={self.value}"
        if spelling.python:
            return self._keyword(spelling)
        return spelling.cli or spelling.env or spelling.config or self.name

    def _flag(self, spelling: Spelling) -> str:
        flag = str(spelling.cli)
        if spelling.switch or self.value is _UNSET or " " in flag:
            return flag
        return f"{flag} {self.value:g}" if _number(self.value) else f"{flag} {self.value}"

    def _keyword(self, spelling: Spelling) -> str:
        keyword = str(spelling.python)
        if "(" in keyword:
            return keyword
        if spelling.switch:
            return f"{keyword}=True"
        if self.value is _UNSET:
            return f"{keyword}="
        return f"{keyword}={self.value:g}" if _number(self.value) else f"{keyword}={self.value!r}"

    def _config(self, key: str) -> str:
        if self.value is _UNSET:
            return key
        shown = str(self.value).lower() if isinstance(self.value, bool) else repr(self.value)
        return f"{key} = {shown}".replace("'", '"')


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class Say:
    """Words that differ per surface: ``python`` is also every surface's default."""

    python: str
    cli: str | None = None
    env: str | None = None
    config: str | None = None

    def render(self, surface: Surface) -> str:
        text: str | None = getattr(self, surface)
        return self.python if text is None else text


Part = str | Setting | Say


class Fix:
    """The next step, as text, :class:`Setting` and :class:`Say` parts joined as they are:
    ``Fix("Ask for at most 300 s (", Setting("command_timeout", 300), ").")``."""

    __slots__ = ("parts",)

    def __init__(self, *parts: Part) -> None:
        self.parts: tuple[Part, ...] = parts

    def render(self, surface: Surface, sources: Mapping[str, Surface] | None = None) -> str:
        """The step as ``surface`` says it; ``sources``: where settings were set, by name
        (``{"broker_url": "env"}``: the variable is named, on every surface)."""
        return "".join(_render(part, surface, sources or {}) for part in self.parts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fix) and other.parts == self.parts

    def __hash__(self) -> int:
        return hash(self.parts)

    def __repr__(self) -> str:
        return f"Fix{self.parts!r}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Fix, self.parts)


def _render(part: Part, surface: Surface, sources: Mapping[str, Surface]) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Setting) and part.name in sources and part.source is None:
        part = replace(part, source=sources[part.name], or_env=False)
    return part.render(surface)


def attach(exc: _E, fix: Fix | None, what: str | None = None) -> _E:
    """``exc`` with its next step: ``exc.what`` (what failed: ``what``, else its message),
    ``exc.fix``; its message (``args[0]``, ``str(exc)``) becomes the Python reading. Returns
    ``exc``."""
    if fix is None:
        return exc
    what = str(exc.args[0]) if what is None and exc.args else (what or "")
    exc.what = what  # type: ignore[attr-defined]
    exc.fix = fix  # type: ignore[attr-defined]
    exc.args = (_join(what, fix.render(PYTHON)), *exc.args[1:])
    return exc


def message(
    exc: BaseException, surface: Surface, sources: Mapping[str, Surface] | None = None
) -> str:
    """What ``exc`` says on ``surface``: its fix spelled there (``sources``: where settings
    were set, see :meth:`Fix.render`), or its message as it is."""
    fix, what = getattr(exc, "fix", None), getattr(exc, "what", None)
    if isinstance(fix, Fix) and isinstance(what, str):
        return _join(what, fix.render(surface, sources))
    return str(exc)


def _join(what: str, fix: str) -> str:
    return f"{what} {fix}".strip() if fix else what


def sourced(exc: _E, name: str, source: Surface) -> _E:
    """``exc`` with the setting ``name`` of its fix marked as set in ``source`` (a value from
    the environment: every surface names its variable). Returns ``exc``."""
    fix, what = getattr(exc, "fix", None), getattr(exc, "what", None)
    if not isinstance(fix, Fix) or not isinstance(what, str):
        return exc
    parts = tuple(
        replace(part, source=source, or_env=False)
        if isinstance(part, Setting) and part.name == name
        else part
        for part in fix.parts
    )
    return attach(exc, Fix(*parts), what)
