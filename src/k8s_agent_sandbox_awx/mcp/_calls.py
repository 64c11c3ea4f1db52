"""What each tool does (with ``AsyncSandbox``), and how any failure becomes a tool result.

:func:`call_tool` checks the arguments (``_tools``), runs the tool and returns a
:class:`ToolResult`: the structured result and its JSON text, or, for a failure of any kind,
``is_error`` with the SDK's message (what went wrong and what to do), redacted. Nothing here
raises but cancellation: an agent's mistake is never a protocol error.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .._upstream import SandboxError, SandboxNotFoundError
from ..client._async_client import AsyncSandbox
from ..client.wire._code import Execution, Result
from ..client.wire._protocol import redact_answer
from ..errors import FileAPIUnsupportedError
from . import _bounds as bounds
from ._sessions import Sandboxes, Session, SessionEnded
from ._tools import ArgumentError, check_arguments, tool

__all__ = ["Call", "ToolError", "ToolResult", "call_tool"]

logger = logging.getLogger("k8s_agent_sandbox_awx.mcp")

RUN_TIMEOUT = 60.0
"""run_command's time limit without ``timeout_seconds`` (the SDK's ``commands.run`` default,
and the tool-call time limit Codex gives an MCP server unless configured)."""


class ToolError(Exception):
    """A tool cannot do what was asked: the message says why and what to do instead."""


@dataclass
class ToolResult:
    """What a tool call returns: ``text`` blocks, ``images`` (base64 data, MIME type) and the
    ``structured`` result (its JSON is the first text block), or an error (``is_error``)."""

    text: list[str] = field(default_factory=list)
    structured: dict[str, Any] | None = None
    images: list[tuple[str, str]] = field(default_factory=list)
    is_error: bool = False

    @classmethod
    def of(cls, structured: dict[str, Any], *, is_error: bool = False) -> ToolResult:
        return cls([json.dumps(structured, ensure_ascii=False)], structured, is_error=is_error)

    @classmethod
    def error(cls, message: str) -> ToolResult:
        return cls([redact_answer(message)], is_error=True)


@dataclass
class Call:
    """What a tool works with: the server's sandboxes, the caller's MCP session, the limits."""

    sandboxes: Sandboxes
    session: Session
    max_output_chars: int = bounds.DEFAULT_MAX_OUTPUT_CHARS

    async def sandbox(self, name: str | None) -> AsyncSandbox:
        if name is None:
            return await self.session.default()
        return await self.sandboxes.get(name)


Handler = Callable[[Call, dict[str, Any]], Awaitable[ToolResult]]


async def call_tool(call: Call, name: str, arguments: Mapping[str, Any] | None) -> ToolResult:
    """Run tool ``name`` with ``arguments``; every failure is an error result (see module)."""
    sandbox_name = (arguments or {}).get("sandbox")
    try:
        spec = tool(name)
        checked = check_arguments(spec, arguments)
        return await HANDLERS[spec.name](call, checked)
    except (ArgumentError, ToolError) as exc:
        return ToolResult.error(str(exc))
    except SessionEnded as exc:
        return ToolResult.error(f"{name}: {exc}.")
    except SandboxNotFoundError as exc:
        return ToolResult.error(_gone(call, sandbox_name, exc))
    except SandboxError as exc:
        return ToolResult.error(_described(exc))
    except (TypeError, ValueError) as exc:  # the SDK's checks of a value (a cwd, a path)
        return ToolResult.error(f"{name}: {type(exc).__name__}: {exc}")
    except Exception as exc:
        logger.exception("tool %s failed unexpectedly", name)
        return ToolResult.error(
            f"{name} failed unexpectedly ({type(exc).__name__}: {exc}); the server's log has "
            "the details. Try again; if it persists, report it."
        )


def _described(exc: BaseException) -> str:
    """The SDK's message of ``exc`` with its type and notes (what it left behind, ...)."""
    notes = "".join(f"\n{note}" for note in getattr(exc, "__notes__", ()))
    return f"{type(exc).__name__}: {exc}{notes}"


def _gone(call: Call, name: str | None, exc: SandboxNotFoundError) -> str:
    """A sandbox that is not there: a session's default one is forgotten (the next call makes
    a new one), another is no longer served from the server's handles."""
    default = call.session.default_name
    if name is None and default is not None:
        call.session.forget_default(default)
        return (
            f"{_described(exc)}\nThis session's default sandbox {default} is gone (its "
            "lifetime ended, or it was deleted); what was in it is lost. The next call without "
            "`sandbox` creates a new one."
        )
    if name is not None:
        call.sandboxes.forget(name)
    return f"{_described(exc)}\nlist_sandboxes shows the sandboxes there are."


# ---------------------------------------------------------------------------------- the tools


async def _create_sandbox(call: Call, args: dict[str, Any]) -> ToolResult:
    sandbox = await call.sandboxes.create(
        args.get("template"), args.get("timeout_seconds"), args.get("envs")
    )
    info = sandbox.info
    return ToolResult.of(
        {"sandbox": sandbox.name, "template": info.template, "expires_at": info.expires_at}
    )


async def _run_command(call: Call, args: dict[str, Any]) -> ToolResult:
    timeout = args.get("timeout_seconds", RUN_TIMEOUT)
    background = args.get("background", False)
    if timeout == 0 and not background:
        raise ToolError(
            "run_command: timeout_seconds=0 (no time limit) is for background=true: a "
            "foreground command is waited for, so give it a limit in seconds, or start it with "
            "background=true."
        )
    sandbox = await call.sandbox(args.get("sandbox"))
    options = {key: args[key] for key in ("cwd", "envs") if key in args}
    if background:
        handle = await sandbox.commands.run(
            args["command"], timeout=timeout, background=True, **options
        )
        limit = timeout or None
        return ToolResult.of(
            {"sandbox": sandbox.name, "command_id": handle.command_id, "timeout_seconds": limit}
        )
    result = await sandbox.commands.run(
        args["command"], timeout=timeout, raise_on_timeout=False, **options
    )
    return _command_result(call, sandbox.name, result, timeout)


def _command_result(call: Call, name: str, result: Any, timeout: float) -> ToolResult:
    stdout, out_cut = bounds.cut_middle(result.stdout, call.max_output_chars, "stdout")
    stderr, err_cut = bounds.cut_middle(result.stderr, call.max_output_chars, "stderr")
    structured: dict[str, Any] = {
        "sandbox": name,
        "exit_code": result.exit_code,
        "stdout": stdout,
        "stderr": stderr,
    }
    if out_cut or err_cut or result.output_truncated:
        structured["output_cut"] = True
    timed_out = bool(result.timed_out)
    if timed_out:
        structured["timed_out"] = True
        structured["error"] = (
            f"The command ran longer than timeout_seconds={timeout:g} and was killed (its "
            "output so far is above). Pass a larger timeout_seconds (at most the runtime's "
            "cap), or start it with background=true and read its output from a file."
        )
    return ToolResult.of(structured, is_error=timed_out)


async def _read_file(call: Call, args: dict[str, Any]) -> ToolResult:
    sandbox = await call.sandbox(args.get("sandbox"))
    path, size = await _file_facts(sandbox, args["path"])
    stream = await sandbox.files.read(path, format="stream")
    async with contextlib.aclosing(stream):
        first = await anext(stream, b"")
        kind = bounds.sniff(first)
        if kind == "text":
            return await _page(call, args, first, stream)
        if kind.startswith("image/"):
            return await _image(path, size, kind, first, stream)
    shown = "" if size is None else f", {size:,} bytes"
    return ToolResult(
        [
            f"{path} is a binary file{shown}; its content is not shown. Use run_command to "
            f"inspect it (e.g. `xxd {path} | head`, `file {path}`), or `base64 {path}` to copy "
            "it."
        ]
    )


async def _file_facts(sandbox: AsyncSandbox, path: str) -> tuple[str, int | None]:
    """``path`` as the runtime names it and its size (``None``: a runtime without the file
    API, which has no such call); a directory is refused, naming list_files."""
    try:
        info = await sandbox.files.get_info(path)
    except FileAPIUnsupportedError:
        return path, None
    if info.is_dir:
        raise ToolError(
            f"read_file: {info.path} is a directory; list it with list_files (path={info.path})."
        )
    return info.path, info.size


async def _page(call: Call, args: dict[str, Any], first: bytes, stream: Any) -> ToolResult:
    pager = bounds.LinePager(
        args.get("start_line", 1), args.get("line_count"), call.max_output_chars
    )
    pager.feed(first)
    ended = False
    while not pager.full:
        chunk = await anext(stream, None)
        if chunk is None:
            pager.feed(b"", final=True)
            ended = True
            break
        pager.feed(chunk)
    text, note = pager.text(), pager.note(ended)
    if not text and pager.start_line > 1 and ended:
        text = f"[the file has {pager.line - 1} lines; start_line={pager.start_line} is past them]"
    return ToolResult([text] + ([note] if note else []))


async def _image(path: str, size: int | None, mime: str, first: bytes, stream: Any) -> ToolResult:
    if size is not None and size > bounds.MAX_IMAGE_BYTES:
        return ToolResult(
            [
                f"{path} is an image ({mime}, {size:,} bytes) larger than the "
                f"{bounds.MAX_IMAGE_BYTES:,} bytes read_file returns; make a smaller copy "
                "with run_command and read that."
            ]
        )
    data = bytearray(first)
    async for chunk in stream:
        data += chunk
        if len(data) > bounds.MAX_IMAGE_BYTES:
            raise ToolError(
                f"read_file: {path} is an image larger than the {bounds.MAX_IMAGE_BYTES:,} bytes "
                "read_file returns; make a smaller copy with run_command and read that."
            )
    encoded = base64.b64encode(bytes(data)).decode("ascii")
    return ToolResult([f"{path} ({mime}, {len(data):,} bytes)"], images=[(encoded, mime)])


async def _write_file(call: Call, args: dict[str, Any]) -> ToolResult:
    content: str = args["content"]
    if args.get("encoding", "utf-8") == "base64":
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ToolError(
                f"write_file: content is not valid base64 ({exc}); send the bytes base64 "
                "encoded, or send text with encoding='utf-8'."
            ) from None
    else:
        data = content.encode("utf-8", errors="surrogatepass")
    sandbox = await call.sandbox(args.get("sandbox"))
    info = await sandbox.files.write(args["path"], data)
    return ToolResult.of({"sandbox": sandbox.name, "path": info.path, "size": info.size})


async def _list_files(call: Call, args: dict[str, Any]) -> ToolResult:
    sandbox = await call.sandbox(args.get("sandbox"))
    entries = await sandbox.files.list(args.get("path", "."))
    shown = [
        {"name": e.name, "type": e.type, "size": e.size, "modified": _time(e.mod_time)}
        for e in entries[: bounds.MAX_LIST_ENTRIES]
    ]
    structured: dict[str, Any] = {"sandbox": sandbox.name, "entries": shown}
    if len(entries) > len(shown):
        structured["more"] = len(entries) - len(shown)
        structured["note"] = (
            f"{len(entries) - len(shown)} more entries are not shown (at most "
            f"{bounds.MAX_LIST_ENTRIES}); use run_command (find, ls with a pattern) to narrow "
            "it down."
        )
    return ToolResult.of(structured)


def _time(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


async def _list_sandboxes(call: Call, args: dict[str, Any]) -> ToolResult:
    infos = await AsyncSandbox.list(config=call.sandboxes.config)
    default = call.session.default_name
    sandboxes = [
        {
            "sandbox": info.name,
            "phase": info.phase,
            "template": info.template,
            "created_at": info.created_at,
            "expires_at": info.expires_at,
            "seconds_left": _whole(info.seconds_left()),
            "default": info.name == default,
        }
        for info in infos
    ]
    return ToolResult.of({"sandboxes": sandboxes})


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


async def _kill_sandbox(call: Call, args: dict[str, Any]) -> ToolResult:
    name = args.get("sandbox") or call.session.default_name
    if "command_id" in args:
        sandbox = await call.sandbox(args.get("sandbox"))
        result = await sandbox.commands.kill(args["command_id"])
        return ToolResult.of(
            {
                "sandbox": sandbox.name,
                "command_id": args["command_id"],
                "state": result.state,
                "exit_code": result.exit_code,
            }
        )
    if name is None:
        return ToolResult.of(
            {"sandbox": None, "killed": False, "note": "this session has no default sandbox"}
        )
    killed = await call.sandboxes.kill(name)
    call.session.forget_default(name)
    return ToolResult.of({"sandbox": name, "killed": killed})


async def _run_code(call: Call, args: dict[str, Any]) -> ToolResult:
    sandbox = await call.sandbox(args.get("sandbox"))
    language = args.get("language", "python")
    context = await call.sandboxes.code_context(sandbox, args.get("context"), language)
    execution = await sandbox.run_code(
        args["code"],
        language=language,
        context=context,
        timeout=args.get("timeout_seconds", RUN_TIMEOUT),
    )
    return _execution_result(call, sandbox.name, args.get("context"), execution)


def _execution_result(
    call: Call, name: str, context: str | None, execution: Execution
) -> ToolResult:
    """The execution as the tool returns it: its text, output, results and error (each cut
    to the limit), its PNG and JPEG results as image content."""
    limit, images = call.max_output_chars, list[tuple[str, str]]()
    stdout, out_cut = bounds.cut_middle("".join(execution.logs.stdout), limit, "stdout")
    stderr, err_cut = bounds.cut_middle("".join(execution.logs.stderr), limit, "stderr")
    structured: dict[str, Any] = {
        "sandbox": name,
        "context": context or "default",
        "text": _cut(execution.text, limit, "the result"),
        "stdout": stdout,
        "stderr": stderr,
        "results": [_shown(result, limit, images) for result in execution.results],
        "error": None,
        "execution_count": execution.execution_count,
    }
    if execution.error is not None:
        structured["error"] = {
            "name": execution.error.name,
            "value": _cut(execution.error.value, limit, "the error"),
            "traceback": _cut(execution.error.traceback, limit, "the traceback"),
        }
    for flag in ("timed_out", "restarted", "output_truncated"):
        if getattr(execution, flag):
            structured[flag] = True
    if out_cut or err_cut:
        structured["output_cut"] = True
    result = ToolResult.of(structured, is_error=execution.timed_out)
    result.images = images
    return result


def _cut(text: str | None, limit: int, what: str) -> str | None:
    return None if text is None else bounds.cut_middle(text, limit, what)[0]


def _shown(result: Result, limit: int, images: list[tuple[str, str]]) -> dict[str, Any]:
    """One result: its text (and markdown, JSON, or HTML when it has no text) within the
    limit, the formats it has; a PNG or JPEG of at most MAX_IMAGE_BYTES goes to ``images``."""
    shown: dict[str, Any] = {"text": _cut(result.text, limit, "the result")}
    if result.markdown is not None:
        shown["markdown"] = _cut(result.markdown, limit, "the markdown")
    if result.json is not None and len(json.dumps(result.json, default=str)) <= limit:
        shown["json"] = result.json
    if result.text is None and result.html is not None:
        shown["html"] = _cut(result.html, limit, "the HTML")
    for mime, data in (("image/png", result.png), ("image/jpeg", result.jpeg)):
        if data is not None and len(data) * 3 // 4 <= bounds.MAX_IMAGE_BYTES:
            images.append((data, mime))
            shown["image"] = f"{mime} (returned as an image)"
    shown["formats"] = result.formats()
    shown["main"] = result.is_main_result
    return shown


HANDLERS: dict[str, Handler] = {
    "create_sandbox": _create_sandbox,
    "run_command": _run_command,
    "run_code": _run_code,
    "read_file": _read_file,
    "write_file": _write_file,
    "list_files": _list_files,
    "list_sandboxes": _list_sandboxes,
    "kill_sandbox": _kill_sandbox,
}
