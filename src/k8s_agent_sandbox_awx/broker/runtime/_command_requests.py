"""What a managed-command request says, checked before anything runs: the start's fields
(:func:`checked_start`: the argv, the time limit, the environment, the working directory, the
terminal, stdin), a stdin write's payload, the queries of ``GET /commands`` and of the event
stream; every refusal a :class:`CommandError` naming the field and its rule.

Standard library only (the runtime is forked per sandbox); also the code contexts' checks
(:mod:`._code`).
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import re
from typing import Any

from . import _paths, _pty
from ._command import Limits
from ._env import sandbox_environment
from ._http import Exchange

_ENV_NAME = re.compile(r"^[^=\x00]+$")
INVALID_TEXT = "invalid_text"
"""The code of a refusal of text UTF-8 cannot carry (argv, envs, cwd, stdin data)."""
_REQUEST_FIELDS = frozenset({"command", "timeout", "request_id", "stdin", "envs", "cwd"})
_PTY_FIELDS = _REQUEST_FIELDS | {"pty"}
_STDIN_FIELDS = frozenset({"data", "data_base64", "eof"})


class CommandError(Exception):
    """An error answer: HTTP ``status`` and a JSON body ``{"detail", ...extra}``."""

    def __init__(self, status: int, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.body: dict[str, Any] = {"detail": detail, **extra}


def _host_path_of(cwd: str, base_dir: str) -> str:
    """A command's working directory on this host: ``/app`` and ``/workspace`` (and what is
    below them, ``/app/workspace`` too) are the sandbox's roots, as in the file API (``/app``:
    the base directory, where commands run by default); any other absolute path is the host's
    own (NO ISOLATION: a local command is a host process)."""
    parts = [p for p in cwd.split("/") if p not in ("", ".")]
    if not parts or parts[0] not in ("app", "workspace"):
        return cwd
    try:
        target = _paths.check_path(cwd, base_dir, "cwd")
        # a root replaced (by a link, another directory) is refused, as the file API does
        target.roots.check(target.root, cwd)
    except _paths.FsError as exc:  # its detail names sandbox paths only, never host ones
        raise CommandError(exc.status, f"field 'cwd': {exc.detail}", code=exc.code) from None
    return os.path.join(target.root_dir, *target.parts)


def sandbox_env_of(handler: Exchange) -> dict[str, str]:
    """The sandbox's environment the start carries (see :mod:`._env`), else CommandError 400."""
    try:
        return sandbox_environment(handler.headers)
    except ValueError as exc:
        raise CommandError(400, str(exc)) from None


def checked_argv(argv: Any) -> list[str]:
    if (
        not isinstance(argv, list)
        or not argv
        or not all(isinstance(a, str) for a in argv)
        or not argv[0]
    ):
        raise CommandError(
            400,
            "field 'command' must be a non-empty list of strings (the argv; to use a shell "
            'send ["/bin/bash", "-c", "..."])',
        )
    if any("\x00" in a for a in argv):
        raise CommandError(400, "field 'command' contains a NUL byte, which argv cannot carry")
    checked: list[str] = argv
    for arg in checked:
        check_text("command", arg)
    return checked


NO_TIME_LIMIT = "none"
"""The ``"timeout"`` of a command without a time limit: it runs until it exits, is killed or
the runtime (its sandbox) ends; ``max_running`` still counts it."""


def time_limit(timeout: Any, limits: Limits) -> float:
    if timeout is None:
        timeout = limits.default_timeout
    if timeout == NO_TIME_LIMIT:
        return math.inf
    max_timeout = limits.max_timeout
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= max_timeout
    ):
        raise CommandError(
            400,
            f"field 'timeout' must be a number of seconds above 0 and at most {max_timeout:g} "
            f"(this runtime's SANDBOX_EXEC_TIMEOUT_SECONDS), or {NO_TIME_LIMIT!r} for no time "
            "limit",
        )
    return float(timeout)


def checked_envs(envs: Any) -> dict[str, str]:
    if not isinstance(envs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in envs.items()
    ):
        raise CommandError(400, "field 'envs' must be an object of string values")
    for key, value in envs.items():
        if not _ENV_NAME.match(key) or "\x00" in value:
            raise CommandError(
                400,
                f"field 'envs': {key!r} is not a valid variable (a name is non-empty, without "
                "'=' or NUL; a value without NUL)",
            )
        check_text("envs", key)
        check_text("envs", value)
    return envs


def check_text(name: str, text: str) -> None:
    """Refuse text UTF-8 cannot carry (a lone surrogate: JSON can escape one, ``"\\ud800"``),
    before anything is registered or started: ``400`` with code ``invalid_text``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise CommandError(
            400,
            f"field {name!r} holds text that is not valid Unicode (a lone surrogate, "
            f"{bad!r}), which UTF-8, and so an argv, an environment or a stdin, cannot carry; "
            "send valid text (decode bytes with errors='replace', or send them as base64)",
            code=INVALID_TEXT,
        ) from None


def working_directory(cwd: Any, base_dir: str) -> str:
    if cwd is None:
        return base_dir
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\x00" in cwd:
        raise CommandError(400, f"field 'cwd' must be an absolute path, not {cwd!r}")
    check_text("cwd", cwd)
    host = _host_path_of(cwd, base_dir)
    if not os.path.isdir(host):  # named as sent: a sandbox path, never the host's
        raise CommandError(400, f"field 'cwd': {cwd!r} is not an existing directory")
    return host


def checked_start(body: dict[str, Any], limits: Limits, base_dir: str) -> dict[str, Any]:
    """The start request ``body``, checked field by field (CommandError 400 naming the
    field and the rule) for a runtime of these ``limits`` whose commands run in ``base_dir``."""
    fields = _PTY_FIELDS if limits.pty else _REQUEST_FIELDS
    unknown = sorted(set(body) - fields)
    if unknown:
        raise CommandError(400, f"unknown field(s) {unknown}: the fields are {sorted(fields)}")
    argv = checked_argv(body.get("command"))
    pty = pty_size(body)
    timeout = (
        math.inf
        if pty is not None and body.get("timeout") is None
        else time_limit(body.get("timeout"), limits)
    )
    request_id = body.get("request_id")
    if request_id is not None and (
        not isinstance(request_id, str) or not 0 < len(request_id) <= 255
    ):
        raise CommandError(400, "field 'request_id' must be a string of 1 to 255 characters")
    stdin = body.get("stdin", pty is not None)
    if not isinstance(stdin, bool):
        raise CommandError(400, "field 'stdin' must be true or false")
    return {
        "command": argv,
        "timeout": timeout,
        "request_id": request_id,
        "stdin": stdin,
        "envs": checked_envs(body.get("envs") or {}),
        "cwd": working_directory(body.get("cwd"), base_dir),
        "pty": pty,
    }


def pty_size(body: dict[str, Any]) -> tuple[int, int] | None:
    """The start's ``pty`` size, ``None`` for a command on pipes."""
    if body.get("pty") is None:
        return None
    try:
        size = _pty.parse_size(body["pty"], "pty", defaults=True)
    except ValueError as exc:
        raise CommandError(400, str(exc)) from None
    if body.get("stdin") is False:
        raise CommandError(
            400,
            "field 'stdin' cannot be false with 'pty': a terminal's input is always open "
            "(POST /commands/{id}/stdin); leave 'stdin' out",
        )
    return size


def stdin_payload(body: dict[str, Any], pty: bool) -> tuple[bytes, bool]:
    """The bytes a stdin write carries (``data``, UTF-8, or ``data_base64``) and its ``eof``."""
    unknown = sorted(set(body) - _STDIN_FIELDS)
    if unknown:
        raise CommandError(
            400, f"unknown field(s) {unknown}: the fields are 'data' or 'data_base64', and 'eof'"
        )
    eof = body.get("eof", False)
    if not isinstance(eof, bool):
        raise CommandError(400, "field 'eof' must be true or false")
    if eof and pty:
        raise CommandError(
            400,
            "field 'eof' cannot end a terminal's input: send Ctrl-D (\\u0004) to end what a "
            "program reads from it, or kill the command",
        )
    if "data" in body and "data_base64" in body:
        raise CommandError(400, "give 'data' (text) or 'data_base64' (bytes), not both")
    if "data_base64" in body:
        encoded = body["data_base64"]
        try:
            if not isinstance(encoded, str):
                raise ValueError("not a string")
            return base64.b64decode(encoded, validate=True), eof
        except (ValueError, binascii.Error):
            raise CommandError(400, "field 'data_base64' must be a base64 string") from None
    data = body.get("data", "")
    if not isinstance(data, str):
        raise CommandError(400, "field 'data' must be a string")
    check_text("data", data)
    return data.encode(), eof


def request_id_query(query: dict[str, list[str]]) -> str | None:
    """The ``request_id`` a ``GET /commands`` asks for (``None``: every command)."""
    values = query.get("request_id")
    if values is None:
        return None
    if not 0 < len(values[-1]) <= 255:
        raise CommandError(400, "query 'request_id' must be a string of 1 to 255 characters")
    return values[-1]


def query_number(
    query: dict[str, list[str]], name: str, default: float, kind: type[int] | type[float]
) -> Any:
    values = query.get(name)
    if not values:
        return default
    try:
        return kind(values[-1])
    except ValueError:
        raise CommandError(400, f"query {name!r}={values[-1]!r} is not a number") from None
