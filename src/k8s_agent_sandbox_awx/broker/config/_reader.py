"""Reading one TOML table with rules: typed getters that collect problems instead of raising.

A getter that finds a problem records it (key, rule, fix) and returns a stand-in value, so that
the loader goes on and finds every other problem; the configuration is only built when there is
none. The keys a table's getters asked for are its known keys: any other key is a problem
(a "did you mean" from difflib; an inline secret refused naming the ``*_file`` key to use).
Values of unknown keys and secret-looking values are never shown in a message.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ..._urls import masked_url
from ._errors import Problem

REQUIRED: Final[Any] = object()
"""A getter's ``default`` for a key the file must give."""

SECRET_WORDS: Final = frozenset(
    {"token", "password", "passwd", "secret", "key", "credential", "credentials", "jwt"}
    | {"bearer", "apikey", "privatekey", "pem", "passphrase"}
)
"""A key with one of these words (split at ``_`` and ``-``) looks like an inline secret."""

_JWT_LIKE = re.compile(r"^\s*eyJ[A-Za-z0-9_-]*\.[A-Za-z0-9_-]*\.")
_TYPE_NAMES: Final = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a float",
    list: "an array",
    dict: "a table",
}


def _bound(value: float) -> str:
    """A bound as written in a file: ``67108864``, not ``6.71089e+07``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def type_name(value: object) -> str:
    """What TOML calls the type of ``value`` (``a string``, ``an array``, ...)."""
    return _TYPE_NAMES.get(type(value), "a date or time")


def show(value: object) -> str:
    """A (non-secret) value for a message, at most 80 characters; a URL in it (a string with
    ``://``, alone or in a list) without its user info, query and fragment (``masked_url``)."""
    text = repr(_masked(value))
    return text if len(text) <= 80 else text[:77] + "..."


def _masked(value: object) -> object:
    if isinstance(value, str):
        return masked_url(value) if "://" in value else value
    if isinstance(value, list | tuple):
        return type(value)(_masked(v) for v in value)
    return value


def looks_secret(value: str) -> bool:
    """A JWT or PEM text, or several lines: the secret itself, where a path belongs."""
    return bool(_JWT_LIKE.match(value)) or "-----BEGIN" in value or "\n" in value


def secret_like_key(name: str) -> bool:
    return not name.endswith("_file") and bool(SECRET_WORDS & set(re.split(r"[_\-.]", name)))


@dataclass
class Context:
    """What every table of one file shares: where relative paths start, the problems found."""

    path: Path
    check_files: bool = True
    problems: list[Problem] = field(default_factory=list)
    defaulted: set[str] = field(default_factory=set)
    bad: set[str] = field(default_factory=set)
    """Keys that already have a problem (cross-checks skip them: one problem per mistake)."""

    @property
    def base_dir(self) -> Path:
        return self.path.parent


class Table:
    """One TOML table (``data``) at dotted position ``prefix`` (``""``: the file itself)."""

    def __init__(self, ctx: Context, data: dict[str, Any], prefix: str, title: str) -> None:
        self.ctx = ctx
        self.data = data
        self.prefix = prefix
        self.title = title
        """How messages name the table: ``[server]``, ``an [[issuers]] table``."""
        self.context = ""
        """Appended to its keys in messages once known: the table's name."""
        self.known: list[str] = []

    # -- problems ---------------------------------------------------------------------------
    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def problem(self, name: str, rule: str, fix: str, *, context: str = "") -> None:
        """Record a problem at key ``name`` (``context``: the table's name, if not this one's)."""
        key = self.key(name) if name else self.prefix
        self.ctx.bad.add(key)
        context = context or self.context
        where = f"{key} ({context})" if context and key else key
        self.ctx.problems.append(Problem(where, rule, fix))

    def ok(self, name: str) -> bool:
        """Whether ``name`` was given (or defaulted) without a problem."""
        return self.key(name) not in self.ctx.bad

    def given(self, name: str) -> bool:
        return name in self.data

    # -- getters ----------------------------------------------------------------------------
    def _raw(self, name: str, default: Any, fix_missing: str) -> tuple[bool, Any]:
        """``(present, value)``; a missing required key is a problem."""
        if name not in self.known:
            self.known.append(name)
        if name in self.data:
            return True, self.data[name]
        if default is REQUIRED:
            self.problem(name, f"{self.title} has no {name!r}, which is required", fix_missing)
        else:
            self.ctx.defaulted.add(self.key(name))
        return False, default

    def _wrong_type(self, name: str, value: object, wanted: str, example: str) -> None:
        self.problem(name, f"must be {wanted}, not {type_name(value)}", f"write it as {example}")

    def string(
        self,
        name: str,
        default: Any = REQUIRED,
        *,
        example: str,
        choices: Iterable[str] | None = None,
    ) -> Any:
        """A string (``choices``: one of them); the stand-in for a bad one is ``""``."""
        present, value = self._raw(name, default, f"add {name} = {example}")
        if not present:
            return "" if value is REQUIRED else value
        if not isinstance(value, str):
            self._wrong_type(name, value, "a string", f"{name} = {example}")
            return ""
        options = tuple(choices or ())
        if options and value not in options:
            hint = difflib.get_close_matches(value, options, n=1)
            near = f"did you mean {hint[0]!r}? " if hint else ""
            self.problem(
                name,
                f"{show(value)} is not one of {', '.join(map(repr, options))}",
                f"{near}set {name} to one of them",
            )
            return ""
        return value

    def number(
        self,
        name: str,
        default: Any,
        *,
        minimum: float = 0.0,
        above: bool = False,
        maximum: float | None = None,
        integer: bool = False,
    ) -> Any:
        """A finite number within bounds (``above``: strictly above ``minimum``); ``integer``:
        a whole number. A ``*_seconds`` key takes integer or float seconds."""
        what = "a whole number" if integer else "a number"
        present, value = self._raw(name, default, f"add {name} = <{what}>")
        if not present:
            return value
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not is_number or (integer and not isinstance(value, int)):
            unit = " of seconds" if name.endswith("_seconds") else ""
            self._wrong_type(name, value, what + unit, f"{name} = {default!r}")
            return default
        low_ok = value > minimum if above else value >= minimum
        if not math.isfinite(value) or not low_ok or (maximum is not None and value > maximum):
            bound = f"> {_bound(minimum)}" if above else f">= {_bound(minimum)}"
            bound += f" and <= {_bound(maximum)}" if maximum is not None else ""
            self.problem(name, f"{show(value)} is out of range", f"give {what} {bound}")
            return default
        return value if integer else float(value)

    def boolean(self, name: str, default: bool) -> bool:
        present, value = self._raw(name, default, "")
        if present and not isinstance(value, bool):
            self._wrong_type(name, value, "a boolean", f"{name} = true or {name} = false")
            return default
        return bool(value)

    def strings(
        self,
        name: str,
        default: Any,
        *,
        example: str,
        item: Callable[[str], str | None] | None = None,
        allow_empty: bool = False,
    ) -> Any:
        """A non-empty (``allow_empty``: or empty) array of distinct strings; ``item`` says what
        is wrong with one (``None``: nothing). The stand-in for a bad array is ``()``."""
        present, value = self._raw(name, default, f"add {name} = {example}")
        if not present:
            return () if value is REQUIRED else value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self._wrong_type(name, value, "an array of strings", f"{name} = {example}")
            return ()
        if not value and not allow_empty:
            self.problem(name, "is empty", f"list at least one, e.g. {name} = {example}")
            return ()
        doubles = sorted({v for v in value if value.count(v) > 1})
        wrong = [(v, why) for v in value if item and (why := item(v))]
        if doubles:
            self.problem(name, f"lists {show(doubles[0])} twice", "list each value once")
        elif wrong:
            self.problem(name, f"{show(wrong[0][0])} {wrong[0][1]}", f"e.g. {name} = {example}")
        return () if doubles or wrong else tuple(value)

    def path(self, name: str, *, required: bool = False, what: str = "file") -> Path | None:
        """A file's path: ``~`` expanded, relative to the configuration's directory; with
        ``check_files`` it must be a readable file (its content is not read)."""
        present, value = self._raw(name, REQUIRED if required else None, f'add {name} = "/path"')
        if not present:
            return None
        if not isinstance(value, str) or not value.strip():
            self._wrong_type(name, value, "a file's path (a non-empty string)", f'{name} = "/path"')
            return None
        if looks_secret(value):
            self.problem(
                name,
                "looks like the secret itself (a token, a PEM block, several lines), not a "
                "file's path; its value is not shown",
                f"write the secret to a file (readable by the broker only) and give {name} as "
                "that file's path",
            )
            return None
        path = Path(os.path.normpath(self.ctx.base_dir / Path(value).expanduser()))
        if self.ctx.check_files:
            self._check_file(name, path, what)
        return path

    def _check_file(self, name: str, path: Path, what: str) -> None:
        fix = (
            f"give {name} as the path of an existing {what} (a relative path starts at "
            f"{self.ctx.base_dir})"
        )
        if not path.exists():
            self.problem(name, f"{str(path)!r} does not exist", fix)
        elif not path.is_file():
            self.problem(name, f"{str(path)!r} is not a file", fix)
        elif not os.access(path, os.R_OK):
            self.problem(
                name,
                f"{str(path)!r} is not readable by this process (uid {os.getuid()})",
                "make it readable by the broker's user, or run the broker as a user that can "
                "read it",
            )

    def mapping(self, name: str, default: Any, *, example: str) -> Any:
        """An inline table of any keys (``claims``, ``templates``); entries checked by the
        caller. The stand-in for a bad one is ``{}``."""
        present, value = self._raw(name, default, f"add {name} = {example}")
        if present and not isinstance(value, dict):
            self._wrong_type(name, value, "a table", f"{name} = {example}")
            return {}
        return value

    def table(self, name: str, *, title: str) -> Table | None:
        """The sub-table ``name`` (``None`` when absent or not a table)."""
        present, value = self._raw(name, None, "")
        if not present:
            self.ctx.defaulted.discard(self.key(name))  # an absent table is not a default
            return None
        if not isinstance(value, dict):
            self._wrong_type(name, value, "a table", f"[{self.key(name)}]")
            return None
        return Table(self.ctx, value, self.key(name), title)

    def tables(self, name: str) -> list[Table]:
        """The array of tables ``name`` (``[[name]]``): required and not empty."""
        present, value = self._raw(name, REQUIRED, f"add a [[{name}]] table")
        if not present:
            return []
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            self._wrong_type(name, value, "an array of tables", f"[[{name}]] tables")
            return []
        if not value:
            self.problem(name, "is empty", f"add a [[{name}]] table")
        return [
            Table(self.ctx, v, f"{self.key(name)}[{i}]", f"an [[{name}]] table")
            for i, v in enumerate(value)
        ]

    # -- unknown keys -----------------------------------------------------------------------
    def finish(self) -> None:
        """Every key no getter asked for is a problem (its value is never shown)."""
        for name in self.data:
            if name not in self.known:
                self._unknown(name)

    def _unknown(self, name: str) -> None:
        files = [k for k in self.known if k.endswith("_file")]
        where = f"is not a key of {self.title}"
        if f"{name}_file" in self.known:
            self.problem(
                name,
                f"{where}: secrets, keys and certificates are given by file path, never inline",
                f'put the value in a file and write {name}_file = "/path/to/that/file"',
            )
        elif secret_like_key(name):
            use = f"one of this table's file keys: {', '.join(files)}" if files else ""
            self.problem(
                name,
                f"{where}, and it looks like an inline secret: secrets are never written in the "
                "configuration (its value is not shown)",
                f"remove it; give secrets by file path with {use}"
                if use
                else "remove it (this table takes no secret)",
            )
        else:
            hint = difflib.get_close_matches(name, self.known, n=1, cutoff=0.6)
            fix = (
                f"did you mean {hint[0]!r}?"
                if hint
                else f"remove it; the keys of {self.title} are: {', '.join(self.known)}"
            )
            self.problem(name, where, fix)
