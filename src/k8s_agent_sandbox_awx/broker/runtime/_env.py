"""The sandbox's environment: a create's ``env`` is the default environment of the commands the
runtime starts, never the runtime's own.

The runtime serves the file API to callers who may not run commands (the ``files`` scope). Had
it their variables in its own environment, they would decide how it runs: ``PYTHONPATH`` (which
``python -P`` still honours) and an uploaded module run their code on the runtime's next lazy
import; ``LD_PRELOAD`` or ``LD_LIBRARY_PATH`` act before any interpreter flag does. So no
runtime is ever started with them (on either backend): the broker keeps them with the sandbox's
claim and hands them to the runtime with each command start, in the :data:`HEADER` header
(:func:`encode`: the base64url of their JSON object, at most :data:`MAX_ENV_BYTES` of JSON, so
that the header passes a router's 16 KiB request head); the runtime merges them into the
environment of the command it starts (:func:`command_environment`: its own environment, then
the sandbox's, then the command's ``envs``). A caller's own header of that name never reaches a
runtime (the broker forwards no ``X-Sandbox-*`` header of a caller's).

:data:`RUNTIME_SETTINGS`: the built-in runtime's own settings (its limits), which the local
backend also gives the runtime it starts when a create names them (none is read by an
interpreter or the loader); on Kubernetes they are the template's.

Standard library only.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "HEADER",
    "MAX_ENV_BYTES",
    "RUNTIME_SETTINGS",
    "command_environment",
    "decode",
    "encode",
    "json_size",
    "runtime_settings",
    "sandbox_environment",
]

HEADER: Final = "X-Sandbox-Env"
"""The header the broker sends the sandbox's environment in, on each command start."""
MAX_ENV_BYTES: Final = 8192
"""The largest ``env`` a create may give: its JSON object (compact, UTF-8) at most this long.
(= ``client.wire._dialect_v1.MAX_ENV_BYTES``: the client cannot import the broker; a test holds
them equal.)"""
RUNTIME_SETTINGS: Final = frozenset(
    {
        "SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES",
        "SANDBOX_COMMAND_LIVE_WINDOW_BYTES",
        "SANDBOX_COMMAND_UNACKED_BYTES",
        "SANDBOX_COMMAND_MAX_RUNNING",
        "SANDBOX_COMMAND_MAX_HANDLES",
        "SANDBOX_COMMAND_RETENTION_SECONDS",
        "SANDBOX_COMMAND_HEARTBEAT_SECONDS",
        "SANDBOX_COMMAND_FOLLOWER_GRACE_SECONDS",
        "SANDBOX_COMMAND_STREAM_START",
        "SANDBOX_COMMAND_PTY",
        "SANDBOX_EXEC_TIMEOUT_SECONDS",
        "SANDBOX_FS_READ_MAX_BYTES",
        "SANDBOX_CODE_MAX_CONTEXTS",
        "SANDBOX_CODE_OUTPUT_LIMIT_BYTES",
        "SANDBOX_CODE_INTERRUPT_GRACE_SECONDS",
    }
)
"""The built-in runtime's settings (docs/local-broker.md, "Sandbox runtimes"): the only names of
a create's ``env`` the local backend puts in a runtime's own environment."""


def runtime_settings(env: Mapping[str, str]) -> dict[str, str]:
    """What of a sandbox's ``env`` a local runtime is started with: the built-in runtime's own
    settings (:data:`RUNTIME_SETTINGS`), nothing else."""
    return {k: v for k, v in env.items() if k in RUNTIME_SETTINGS}


def json_size(env: Mapping[str, str]) -> int:
    """The length of ``env``'s compact JSON object in UTF-8 (what :data:`MAX_ENV_BYTES`
    bounds)."""
    return len(_json(env))


def _json(env: Mapping[str, str]) -> bytes:
    return json.dumps(dict(env), separators=(",", ":"), ensure_ascii=False).encode()


def encode(env: Mapping[str, str]) -> str:
    """The :data:`HEADER` value of ``env``."""
    return base64.urlsafe_b64encode(_json(env)).decode("ascii")


def decode(value: str) -> dict[str, str]:
    """The environment a :data:`HEADER` value carries; ValueError if it is not one."""
    try:
        data = json.loads(base64.urlsafe_b64decode(value.encode("ascii")).decode())
    except (ValueError, UnicodeError, binascii.Error) as exc:
        raise ValueError(f"{HEADER} is not base64url of a JSON object: {exc}") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in data.items()
    ):
        raise ValueError(f"{HEADER} must hold an object of variable names and string values")
    return data


def sandbox_environment(headers: Any) -> dict[str, str]:
    """The sandbox's environment a command start carries (its :data:`HEADER`; none: empty);
    ValueError for a header that is not one."""
    value = headers.get(HEADER)
    return {} if value is None else decode(value)


def command_environment(
    own: Mapping[str, str], sandbox: Mapping[str, str], envs: Mapping[str, str]
) -> dict[str, str]:
    """The environment of a command the runtime starts: the runtime's own (``own``), then the
    sandbox's (``sandbox``: its create's ``env``), then the command's ``envs``."""
    return {**own, **sandbox, **envs}
