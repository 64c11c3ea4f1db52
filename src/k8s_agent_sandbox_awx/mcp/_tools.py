"""The tools the MCP server offers: their names, descriptions, JSON schemas and the checking of
the arguments an agent sends (no I/O, no ``mcp`` import).

Each tool is a :class:`ToolSpec` of :class:`Param` values; :meth:`ToolSpec.input_schema` is the
JSON schema ``tools/list`` announces, and :func:`check_arguments` enforces the same rules on a
call, with an :class:`ArgumentError` that names the argument, the rule and the fix (an agent
acts on it; the SDK's JSON-schema messages name none of that).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOLS",
    "ArgumentError",
    "Param",
    "ToolSpec",
    "check_arguments",
    "tool",
]

_TYPES = {
    "string": "a string",
    "integer": "a whole number",
    "number": "a number",
    "boolean": "true or false",
    "env": "an object of string values",
}


class ArgumentError(ValueError):
    """A tool call's arguments break the tool's schema: what is wrong and what to send."""


@dataclass(frozen=True)
class Param:
    """One argument of a tool (its JSON-schema property)."""

    name: str
    kind: str
    """``string``, ``integer``, ``number``, ``boolean`` or ``env`` (an object of strings)."""
    description: str
    required: bool = False
    minimum: float | None = None
    """The smallest value a number may have (inclusive)."""
    positive: bool = False
    """A number must be greater than 0."""
    choices: tuple[str, ...] = ()
    default: Any = None

    def schema(self) -> dict[str, Any]:
        if self.kind == "env":
            prop: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}
        else:
            prop = {"type": self.kind}
        prop["description"] = self.description
        if self.choices:
            prop["enum"] = list(self.choices)
        if self.minimum is not None:
            prop["minimum"] = self.minimum
        if self.positive:
            prop["exclusiveMinimum"] = 0
        if self.default is not None:
            prop["default"] = self.default
        return prop


@dataclass(frozen=True)
class ToolSpec:
    """A tool: its name, what an agent reads about it, its arguments and its hints."""

    name: str
    title: str
    description: str
    params: tuple[Param, ...] = ()
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False

    def input_schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {p.name: p.schema() for p in self.params},
            "required": [p.name for p in self.params if p.required],
            "additionalProperties": False,
        }


def check_arguments(spec: ToolSpec, arguments: Mapping[str, Any] | None) -> dict[str, Any]:
    """``arguments`` checked against ``spec`` (a ``null`` value is the same as leaving the
    argument out); raises :class:`ArgumentError` for the first problem."""
    given = {k: v for k, v in (arguments or {}).items() if v is not None}
    known = {p.name: p for p in spec.params}
    unknown = sorted(set(given) - set(known))
    if unknown:
        accepted = ", ".join(sorted(known)) or "no arguments"
        raise ArgumentError(
            f"{spec.name}: unknown argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; it takes {accepted}."
        )
    for param in spec.params:
        if param.required and param.name not in given:
            raise ArgumentError(
                f"{spec.name}: the argument {param.name!r} is required ({param.description})."
            )
    return {name: _checked(spec.name, known[name], value) for name, value in given.items()}


def _checked(tool_name: str, param: Param, value: Any) -> Any:
    where = f"{tool_name}: {param.name}"
    if param.kind == "boolean" and not isinstance(value, bool):
        raise ArgumentError(f"{where} must be true or false, not {value!r}.")
    if param.kind == "string":
        if not isinstance(value, str):
            raise ArgumentError(f"{where} must be a string, not {value!r}.")
        if param.choices and value not in param.choices:
            raise ArgumentError(
                f"{where} must be one of {', '.join(map(repr, param.choices))}, not {value!r}."
            )
    if param.kind in ("integer", "number"):
        return _number(where, param, value)
    if param.kind == "env":
        _env(where, value)
    return value


def _number(where: str, param: Param, given: Any) -> float | int:
    if isinstance(given, bool) or not isinstance(given, int | float) or not math.isfinite(given):
        raise ArgumentError(f"{where} must be {_TYPES[param.kind]}, not {given!r}.")
    value: float | int = given
    if param.kind == "integer":
        if value != int(value):
            raise ArgumentError(f"{where} must be a whole number, not {value!r}.")
        value = int(value)
    if param.positive and value <= 0:
        raise ArgumentError(f"{where} must be greater than 0, not {value!r}.")
    if param.minimum is not None and value < param.minimum:
        raise ArgumentError(f"{where} must be at least {param.minimum:g}, not {value!r}.")
    return value


def _env(where: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise ArgumentError(
            f'{where} must be an object of variable names and string values ({{"DEBUG": "1"}}), '
            f"not {value!r}."
        )
    for key, item in value.items():
        if not isinstance(item, str):
            raise ArgumentError(
                f"{where}: the value of {key!r} must be a string (environment variables are "
                f'text: "{item}"), not {item!r}.'
            )


# ---------------------------------------------------------------------------------- the tools

_SANDBOX = Param(
    "sandbox",
    "string",
    "The sandbox's name (from create_sandbox or list_sandboxes). Leave it out to use this "
    "session's default sandbox: created on first use, deleted when the session ends.",
)
_ENVS = Param(
    "envs",
    "env",
    'Environment variables for it, e.g. {"DEBUG": "1"}.',
)
_PATH_RULE = (
    "relative to /app (the sandbox's working directory), or absolute under /app or /workspace"
)

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "create_sandbox",
        "Create a sandbox",
        "Create a new sandbox: an isolated Linux machine on the team's cluster, reached "
        "through the identity broker under this server's identity and policy. Returns its name; "
        "pass it as `sandbox` to the other tools. You rarely need this: every tool uses this "
        "session's default sandbox when `sandbox` is left out. Create one for separate or "
        "parallel work. It lives `timeout_seconds` (kept alive while the tools use it, within "
        "the policy's cap) and is NOT deleted when the session ends: delete it with "
        "kill_sandbox when you are done.",
        (
            Param(
                "template",
                "string",
                "The template or warm pool to start it from (as the platform team named them; "
                "default: the broker's default template).",
            ),
            Param(
                "timeout_seconds",
                "integer",
                "Its lifetime in seconds from now (default 300, cut at the policy's cap).",
                positive=True,
            ),
            Param("envs", "env", 'Environment variables of every command in it, e.g. {"CI": "1"}.'),
        ),
    ),
    ToolSpec(
        "run_command",
        "Run a shell command",
        "Run a shell command (/bin/sh -c) in a sandbox and return its exit code, stdout and "
        "stderr once it ends. Commands run in /app unless `cwd` says otherwise; files written "
        "there persist between calls in the same sandbox. A long output is cut in the middle "
        "(with a note saying how much): redirect it to a file and use read_file to see all of "
        "it. background=true starts the command and returns its command id at once (for a "
        "server, a watcher, a long build); its output is not returned, so redirect it to a file; "
        "kill_sandbox with command_id stops it.",
        (
            Param("command", "string", "The shell command, e.g. 'pytest -q tests/'.", True),
            _SANDBOX,
            Param("cwd", "string", f"The directory to run it in: {_PATH_RULE} (default /app)."),
            _ENVS,
            Param(
                "timeout_seconds",
                "number",
                "Its time limit in seconds (default 60; at most the runtime's cap, 300 unless "
                "the platform set another); it is killed then. With background=true, 0 means no "
                "time limit.",
                minimum=0,
            ),
            Param(
                "background",
                "boolean",
                "Start it and return its command id without waiting (default false).",
                default=False,
            ),
        ),
    ),
    ToolSpec(
        "run_code",
        "Run code in a persistent interpreter",
        "Run code in a sandbox's interpreter, like a notebook cell: variables, imports and "
        "definitions persist between calls (x = 41, then x + 1 gives 42). Returns what it "
        "printed, the value of its last expression, images it displayed (as images) and, when "
        "the code raised, the error's name, value and traceback (an error in the code is a "
        "result, not a failure of the tool). `context` names an independent interpreter state.",
        (
            Param("code", "string", "The code to run.", True),
            _SANDBOX,
            Param("language", "string", "The language (default python).", default="python"),
            Param(
                "context",
                "string",
                "A name of your choosing for an independent interpreter state in that sandbox "
                "(created on first use; default: the sandbox's default context).",
            ),
            Param(
                "timeout_seconds",
                "number",
                "Its time limit in seconds (default 60); a runaway cell is interrupted.",
                positive=True,
            ),
        ),
    ),
    ToolSpec(
        "read_file",
        "Read a file",
        "Read a text file of a sandbox, from `start_line` on. A long file is cut at the output "
        "limit, with a note naming the line to go on from (call again with that start_line). "
        "An image (PNG, JPEG, GIF, WebP) is returned as an image; other binary files are "
        "described, not shown (use run_command, e.g. `xxd` or `base64`).",
        (
            Param("path", "string", f"The file: {_PATH_RULE}.", True),
            _SANDBOX,
            Param("start_line", "integer", "The first line to return (default 1).", minimum=1),
            Param(
                "line_count",
                "integer",
                "How many lines to return at most (default: up to the output limit).",
                minimum=1,
            ),
        ),
        read_only=True,
        idempotent=True,
    ),
    ToolSpec(
        "write_file",
        "Write a file",
        "Write a file in a sandbox, replacing it atomically if it exists and creating its "
        "parent directories. Returns its path and size.",
        (
            Param("path", "string", f"The file: {_PATH_RULE}.", True),
            Param("content", "string", "The file's content.", True),
            _SANDBOX,
            Param(
                "encoding",
                "string",
                "How `content` is given: utf-8 (text, the default) or base64 (binary data).",
                choices=("utf-8", "base64"),
                default="utf-8",
            ),
        ),
        destructive=True,
        idempotent=True,
    ),
    ToolSpec(
        "list_files",
        "List a directory",
        "List the entries of a directory in a sandbox: name, type (file, directory, symlink), "
        "size in bytes and modification time, sorted by name.",
        (
            Param("path", "string", f"The directory: {_PATH_RULE} (default /app)."),
            _SANDBOX,
        ),
        read_only=True,
        idempotent=True,
    ),
    ToolSpec(
        "list_sandboxes",
        "List my sandboxes",
        "List the sandboxes of this server's identity at the broker, newest first: name, "
        "phase, template, when it expires and whether it is this session's default sandbox.",
        read_only=True,
        idempotent=True,
    ),
    ToolSpec(
        "kill_sandbox",
        "Delete a sandbox (or stop one command)",
        "Delete a sandbox and everything in it (already gone is fine). Leave `sandbox` out to "
        "delete this session's default sandbox (the next tool call without `sandbox` creates a "
        "fresh one). With `command_id`, stop only that background command: the sandbox stays.",
        (
            _SANDBOX,
            Param(
                "command_id",
                "string",
                "A background command's id (from run_command): stop only it.",
            ),
        ),
        destructive=True,
        idempotent=True,
    ),
)

_BY_NAME = {spec.name: spec for spec in TOOLS}


def tool(name: str) -> ToolSpec:
    """The tool ``name``; :class:`ArgumentError` (naming the tools) for an unknown one."""
    spec = _BY_NAME.get(name)
    if spec is None:
        raise ArgumentError(
            f"There is no tool {name!r}; the tools are {', '.join(sorted(_BY_NAME))}."
        )
    return spec
