"""The sandbox runtime's own error answers, passed through by the broker (no I/O): the refusal
codes of its file API, managed commands and code contexts (the tables), which answers are the
runtime's, and each as its typed error (:func:`runtime_error`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ...errors import (
    BrokerError,
    CodeContextBusyError,
    CodeContextError,
    CodeContextLimitError,
    CodeContextNotFoundError,
    CommandOutputLostError,
    FileAPIUnsupportedError,
    SandboxFileError,
    SandboxFileExistsError,
    SandboxFileLimitError,
    SandboxFileNotFoundError,
    SandboxPathError,
)
from ._files_wire import FILE_API, FILE_API_REQUIREMENT
from ._protocol import RequestSpec, redact_answer
from ._refusals import refusal

__all__ = [
    "CODE_ERRORS",
    "COMMAND_ERRORS",
    "FILE_ERRORS",
    "is_runtime_answer",
    "runtime_error",
]


FILE_ERRORS: dict[str, type[SandboxFileError]] = {
    "path_not_found": SandboxFileNotFoundError,
    "path_exists": SandboxFileExistsError,
    "path_invalid": SandboxPathError,
    "path_outside_root": SandboxPathError,
    "path_is_root": SandboxPathError,
    "symlink_not_followed": SandboxPathError,
    "root_replaced": SandboxPathError,
    "file_too_large": SandboxFileLimitError,
    "too_many_entries": SandboxFileLimitError,
    "invalid_argument": SandboxFileError,
    "not_a_directory": SandboxFileError,
    "is_a_directory": SandboxFileError,
    "not_a_file": SandboxFileError,
    "not_empty": SandboxFileError,
    "cross_root": SandboxFileError,
    "permission_denied": SandboxFileError,
    "not_supported": SandboxFileError,
    "io_error": SandboxFileError,
}
"""The refusal codes of the runtime's file API (docs/broker-api.md, Files) and their error
classes; they share no value with the broker's own codes."""


COMMAND_ERRORS = frozenset({"invalid_text"})
"""The refusal codes of the runtime's managed commands (``invalid_text``: an argv, envs, cwd or
stdin data that UTF-8 cannot carry); they share no value with the broker's own codes."""


CODE_ERRORS: dict[str, type[CodeContextError]] = {
    "context_not_found": CodeContextNotFoundError,
    "context_busy": CodeContextBusyError,
    "too_many_contexts": CodeContextLimitError,
}
"""The refusal codes of the runtime's code contexts (``/code``) and their error classes; with
``execution_not_found`` and ``unsupported_language`` (plain runtime errors) they share no value
with the broker's own codes."""


_CODE_CODES = frozenset({*CODE_ERRORS, "execution_not_found", "unsupported_language"})


def is_runtime_answer(status: int, code: str | None) -> bool:
    """Whether an error answer on the data plane is the sandbox runtime's own (passed through
    by the broker): no ``code`` (a 4xx), or one of the file API's, managed commands' or code
    contexts' codes."""
    return (
        (code is None and 400 <= status < 500)
        or code in FILE_ERRORS
        or code in COMMAND_ERRORS
        or code in _CODE_CODES
    )


def _refused_path(body: bytes) -> str | None:
    """The ``path`` a file API refusal names (the one it concerns: a move's destination)."""
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        return None
    path = obj.get("path") if isinstance(obj, dict) else None
    return redact_answer(path) if isinstance(path, str) else None


def runtime_error(
    status: int, reason: str, spec: RequestSpec, common: Mapping[str, Any], body: bytes = b""
) -> BrokerError:
    """An error answer of the sandbox runtime itself, passed through: a ``410`` with
    ``resume_after`` (command output no longer retained) is a :class:`CommandOutputLostError`
    carrying the cursor to resume from; a file API refusal is its typed error (naming the path
    and the rule); a legacy 404 is a missing file."""
    if status == 410:
        return CommandOutputLostError(
            f"Could not {spec.what}: the sandbox runtime answered 410 ({reason}).",
            resume_after=_resume_after(body),
            **common,
        )
    code = common.get("code")
    if code in CODE_ERRORS:
        return _code_refusal(CODE_ERRORS[code], status, reason, spec, common, body)
    subject = _refused_path(body) or spec.subject
    if spec.path.startswith(FILE_API) and status == 404 and code is None:
        return FileAPIUnsupportedError(
            f"Could not {spec.what}: the sandbox runtime has no {spec.path.split('?')[0]} "
            f"(404 without a code); this needs {FILE_API_REQUIREMENT}. Create the sandbox from "
            "a template with a newer runtime.",
            sandbox_path=subject,
            **common,
        )
    if code in FILE_ERRORS:
        return FILE_ERRORS[code](
            f"Could not {spec.what}: the sandbox runtime refused it ({status} {code}): {reason}.",
            sandbox_path=subject,
            **common,
        )
    if known := refusal(status, reason, spec.what):  # a setting the user chose: say its fix
        return BrokerError(known[0], fix=known[1], **common)
    hint = {
        404: "The path does not exist in the sandbox (or is not a file/directory as needed).",
        403: "The path escapes the sandbox's base directory; use a relative path inside it.",
    }.get(status, "See the runtime's detail.")
    cls = SandboxFileNotFoundError if status == 404 and subject is not None else BrokerError
    return cls(
        f"Could not {spec.what}: the sandbox runtime answered {status} ({reason}). {hint}",
        **common,
    )


def _code_refusal(
    cls: type[CodeContextError],
    status: int,
    reason: str,
    spec: RequestSpec,
    common: Mapping[str, Any],
    body: bytes,
) -> CodeContextError:
    """A code context refusal as its typed error, with what its body names."""
    try:
        obj = json.loads(body) if body else {}
    except ValueError:
        obj = {}
    obj = obj if isinstance(obj, dict) else {}
    context = obj.get("context_id")
    extra: dict[str, Any] = {
        "context_id": redact_answer(context) if isinstance(context, str) else None
    }
    if cls is CodeContextBusyError:
        running = obj.get("execution_id")
        extra["execution_id"] = redact_answer(running) if isinstance(running, str) else None
    elif cls is CodeContextLimitError:
        limit = obj.get("limit")
        extra["limit"] = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
    return cls(
        f"Could not {spec.what}: the sandbox runtime refused it ({status} {common.get('code')}): "
        f"{reason}.",
        **extra,
        **common,
    )


def _resume_after(body: bytes) -> int | None:
    try:
        value = json.loads(body).get("resume_after")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
