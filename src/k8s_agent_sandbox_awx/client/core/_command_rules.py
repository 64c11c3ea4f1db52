"""A command before anything is sent (no I/O): how it becomes an argv, the rules of its
``envs``, ``cwd`` and time limit, and the checked start (:class:`StartPlan`: the ``POST
/commands`` body) and ``commands.run`` arguments (:class:`RunPlan`).

Every rule refuses bad input with a typed error naming it, before a request exists; the start
itself is sent by ``_command_start``, the operations are in ``_command_ops``.
"""

from __future__ import annotations

import math
import posixpath
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..wire import _commands_wire as cw
from ..wire._protocol import new_idempotency_key
from . import _options as opts

__all__ = [
    "RUNTIME_CAP",
    "SANDBOX_WORKDIR",
    "SHELL",
    "SHELL_SCRIPT",
    "RunPlan",
    "StartPlan",
    "check_callbacks",
    "check_cwd",
    "check_envs",
    "check_text",
    "check_timeout",
    "command_argv",
    "plan_run",
]


SHELL_SCRIPT = 'command -v bash >/dev/null 2>&1 && exec bash -c -- "$1"; exec /bin/sh -c -- "$1"'


SHELL = ("/bin/sh", "-c", SHELL_SCRIPT, "sh")
"""How a string command runs (``shell=None`` or ``True``): ``SHELL + (command,)``. ``/bin/sh``
runs :data:`SHELL_SCRIPT`, which replaces itself with ``bash -c COMMAND`` (bash found on the
command's ``PATH``), or with ``/bin/sh -c COMMAND`` where there is no bash. One process decides,
so nothing is retried and the command never runs twice; the command is an argument of the
script (``$1``), never pasted into it, and after ``--``: never read as the shell's options."""


def command_argv(command: str | Sequence[str], shell: bool | None) -> list[str]:
    """The argv a command runs as: a string through bash (:data:`SHELL`: ``bash -c``, or
    ``/bin/sh -c`` where the sandbox has no bash; ``shell=None`` or ``True``) or split with
    shell-like rules (``shell=False``); a list as given (``shell=True`` is refused). Empty
    commands and NUL bytes are refused."""
    if isinstance(command, str):
        if "\0" in command:
            raise ValueError("The command contains a NUL byte (\\0); remove it.")
        check_text("The command", command)
        if not command.strip():
            raise ValueError("The command is empty; pass the command to run, e.g. 'echo hi'.")
        if shell is False:
            return _split_shell_words(command)
        return [*SHELL, command]
    if not isinstance(command, (list, tuple)):
        raise TypeError(
            f"The command must be a str (run through a shell) or a list of str (an argv), "
            f"got {type(command).__name__}."
        )
    if shell:
        raise ValueError(
            "shell=True needs the command as one string; a list is an argv and runs without a "
            "shell. Pass a string, or drop shell=True."
        )
    argv = list(command)
    for index, arg in enumerate(argv):
        if not isinstance(arg, str):
            raise TypeError(f"Argument {index} of the command is {type(arg).__name__}, not str.")
        if "\0" in arg:
            raise ValueError(f"Argument {index} of the command contains a NUL byte; remove it.")
        check_text(f"Argument {index} of the command", arg)
    if not argv or not argv[0]:
        raise ValueError("The command is empty; pass the program and its arguments, e.g. ['ls'].")
    return argv


def check_text(what: str, text: str) -> None:
    """Refuse text that UTF-8, and so the wire, an argv, an environment or a stdin, cannot
    carry: a lone surrogate (``os.fsdecode`` of bytes that are not UTF-8, ``"\\ud800"``),
    before anything is sent. ``what`` names the argument."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} holds a lone surrogate ({text[exc.start : exc.end]!r} at index "
            f"{exc.start}), which UTF-8 cannot carry, so the sandbox could not receive it; pass "
            "valid text (decode bytes with errors='replace', or send them as base64)."
        ) from None


def _split_shell_words(command: str) -> list[str]:
    """``command`` split with shell-like rules (``shell=False``), as a non-empty argv."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ValueError(
            f"With shell=False the command {command!r} is split with shell-like rules, and it "
            f"cannot be split ({exc}); balance its quotes, or pass the argv as a list."
        ) from None
    if not argv or not argv[0]:
        raise ValueError(
            f"With shell=False the command {command!r} splits into an empty program name; pass "
            "the program and its arguments, e.g. 'ls -l'."
        )
    return argv


def check_envs(envs: Mapping[str, str] | None) -> dict[str, str] | None:
    if envs is None:
        return None
    if not isinstance(envs, Mapping):
        raise TypeError(f"envs must be a mapping of str to str, got {type(envs).__name__}.")
    out = {}
    for key, value in envs.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"envs must map str to str; {key!r}: {value!r} is not.")
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise ValueError(
                f"envs has an invalid variable {key!r}: names are non-empty without '=' or NUL, "
                "values without NUL."
            )
        check_text(f"The name of the envs variable {key!r}", key)
        check_text(f"The value of the envs variable {key!r}", value)
        out[key] = value
    return out


SANDBOX_WORKDIR = "/app"
"""The sandbox's working directory: where commands run by default, what a relative file path
and a relative ``cwd`` are relative to."""


def check_cwd(cwd: str | None) -> str | None:
    """``cwd`` as the runtime takes it: an absolute path as given, a relative one resolved
    against :data:`SANDBOX_WORKDIR` (``"project"`` -> ``/app/project``), like a file path."""
    if cwd is None:
        return None
    if not isinstance(cwd, str) or not cwd.strip() or "\0" in cwd:
        raise ValueError(
            f"cwd must be a directory inside the sandbox, absolute ('/app/project', "
            f"'/workspace') or relative to {SANDBOX_WORKDIR} ('project'), got {cwd!r}."
        )
    check_text("cwd", cwd)
    if cwd.startswith("/"):
        return cwd
    if any(part == ".." for part in cwd.split("/")):
        raise ValueError(
            f"cwd {cwd!r} is relative to {SANDBOX_WORKDIR} and contains '..'; a relative cwd "
            f"stays inside {SANDBOX_WORKDIR} (as a file path does): give an absolute path "
            "to go elsewhere."
        )
    return posixpath.normpath(f"{SANDBOX_WORKDIR}/{cwd}")


def check_timeout(timeout: float) -> float:
    """A time limit in seconds: finite, above 0, at most the broker's wait."""
    try:
        limit = float(timeout)
    except (TypeError, ValueError):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}.") from None
    return cw.check_command_timeout(limit)


RUNTIME_CAP = "the runtime's cap, 300 s unless it sets another"
"""How the messages name the runtime's largest time limit (``SANDBOX_EXEC_TIMEOUT_SECONDS``)."""


def _run_time_limit(timeout: float | None, background: bool) -> float:
    """``commands.run``'s ``timeout`` as a time limit: ``0`` or ``None`` with
    ``background=True`` is none (``math.inf``: the command runs until it exits, is killed or
    its sandbox ends, as E2B's ``timeout=0``); a foreground run needs one above 0."""
    unlimited = timeout is None or (
        not isinstance(timeout, bool) and isinstance(timeout, int | float) and timeout == 0
    )
    if not unlimited:
        return check_timeout(timeout)  # type: ignore[arg-type]  # None is handled above
    if background:
        return math.inf
    raise ValueError(
        f"commands.run(timeout={timeout!r}) without background=True: a foreground run waits "
        f"for its command, so its time limit must be a number of seconds greater than 0 (at "
        f"most {RUNTIME_CAP}). For a command without a time "
        "limit (a dev server), start it in the background: commands.run(command, "
        "background=True, timeout=0), and wait on or kill its handle."
    )


@dataclass(frozen=True)
class StartPlan:
    """A command checked and ready to start (``POST /commands`` body, or ``/execute``)."""

    argv: list[str]
    timeout: float
    envs: dict[str, str] | None = None
    cwd: str | None = None
    stdin: bool = False
    request_id: str = field(default_factory=new_idempotency_key)

    @classmethod
    def make(
        cls,
        command: str | Sequence[str],
        timeout: float | None,
        *,
        shell: bool | None = None,
        background: bool = False,
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bool = False,
    ) -> StartPlan:
        if stdin and not background:
            raise ValueError(
                "stdin=True needs background=True: only a background command's handle can "
                "send_stdin(); start it with background=True."
            )
        argv = command_argv(command, shell)
        limit, checked_envs, checked_cwd = (
            _run_time_limit(timeout, background),
            check_envs(envs),
            check_cwd(cwd),
        )
        return cls(argv, limit, checked_envs, checked_cwd, stdin)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "command": self.argv,
            "timeout": self.timeout if self.limited else cw.NO_TIME_LIMIT,
            "request_id": self.request_id,
            "stdin": self.stdin,
        }
        if self.envs:
            body["envs"] = self.envs
        if self.cwd is not None:
            body["cwd"] = self.cwd
        return body

    @property
    def limited(self) -> bool:
        """Whether the command has a time limit (``timeout=0`` in the background: none)."""
        return math.isfinite(self.timeout)

    def managed_only(self, background: bool) -> tuple[str, ...]:
        """The start options given that a legacy runtime (``/execute`` only) cannot honour."""
        given = (
            ("background", background),
            ("timeout", not self.limited),
            ("stdin", self.stdin),
            ("envs", bool(self.envs)),
            ("cwd", self.cwd is not None),
        )
        return tuple(name for name, value in given if value)


@dataclass(frozen=True)
class RunPlan:
    """``commands.run``'s arguments, checked."""

    start: StartPlan
    background: bool
    on_stdout: Callable[[str], Any] | None
    on_stderr: Callable[[str], Any] | None
    raise_on_timeout: bool

    @property
    def live(self) -> tuple[str, ...]:
        """The output callbacks given (a legacy runtime cannot stream: see
        :func:`~._command_ops.foreground`)."""
        given = (("on_stdout", self.on_stdout), ("on_stderr", self.on_stderr))
        return tuple(name for name, callback in given if callback is not None)


def plan_run(
    command: Any, timeout: float | None, background: bool, options: opts.RunOptions
) -> RunPlan:
    """Check ``commands.run``'s arguments before anything is sent."""
    if options:  # none given (the usual call): nothing to check or rename
        named = ("command", "timeout", "background")
        opts.check_options("commands.run()", options, opts.RunOptions, named, where=opts.RUN)
        options = opts.run_spelling(options)  # upstream's env= is envs=
    background = bool(background)
    on_stdout, on_stderr = options.get("on_stdout"), options.get("on_stderr")
    check_callbacks(on_stdout, on_stderr)  # with background=True: followed while it runs
    plan = StartPlan.make(
        command,
        timeout,
        shell=options.get("shell"),
        background=background,
        envs=options.get("envs"),
        cwd=options.get("cwd"),
        stdin=bool(options.get("stdin", False)),
    )
    return RunPlan(plan, background, on_stdout, on_stderr, options.get("raise_on_timeout", True))


def check_callbacks(on_stdout: Any, on_stderr: Any) -> None:
    """``on_stdout``/``on_stderr`` are callables (or ``None``)."""
    for name, callback in (("on_stdout", on_stdout), ("on_stderr", on_stderr)):
        if callback is not None and not callable(callback):
            raise TypeError(f"{name} must be callable, got {type(callback).__name__}.")
