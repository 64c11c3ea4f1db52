"""Kubernetes agent sandboxes without a kubeconfig, through an OIDC identity broker.

The names below are where users start; every error is in :mod:`k8s_agent_sandbox_awx.errors`
(``SandboxError``, the root of all of them, is also here; the other error names stay
importable from the package for compatibility). ``import k8s_agent_sandbox_awx`` is cheap: the
names are imported on first use (PEP 562), so the upstream client and httpx are loaded only
when a sandbox is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # --- broker client --------------------------------------------------------------------
    "Sandbox": ".client._client",
    "SandboxInfo": ".client._client",
    "BrokerSandboxClient": ".client._client",
    "AsyncSandbox": ".client._async_client",
    "AsyncBrokerSandboxClient": ".client._async_client",
    "BrokerConnectionConfig": ".client.http._config",
    "FileInfo": ".client.core._fsapi",
    "WatchEvent": ".client.core._fsapi",
    "SandboxError": ".errors",
    "CommandHandle": ".client._commands",
    "AsyncCommandHandle": ".client._async_commands",
    "CommandEvent": ".client.core._command_output",
    "CommandInfo": ".client.wire._commands_wire",
    "PtyHandle": ".client._pty",
    "AsyncPtyHandle": ".client._async_pty",
    "Execution": ".client.wire._code",
    "ExecutionError": ".client.wire._code",
    "Result": ".client.wire._code",
    "Logs": ".client.wire._code",
    "OutputMessage": ".client.wire._code",
    "CodeContext": ".client.wire._code",
    # --- the original package's names (drop-in migration) ----------------------------------
    "SandboxBrokerConnectionConfig": ".client.http._config",
    "BrokerSandbox": ".client._client",
    # --- credential framework -------------------------------------------------------------
    "DefaultCredentials": ".credentials._chain",
    "explain": ".credentials._chain",
    "Explanation": ".credentials._chain",
    "ProviderDecision": ".credentials._chain",
    "KubernetesAuth": ".credentials._auth",
    "OIDCTokenAuth": ".credentials._auth",
    "CredentialSource": ".credentials._auth",
    "clear_credential_cache": ".credentials._cache",
    "Credential": ".credentials._credential",
    "CredentialRequest": ".credentials._credential",
    "ProviderInfo": ".credentials._credential",
    "hookimpl": ".hookspecs",
    "ENTRY_POINT_GROUP": ".hookspecs",
}

# A literal list, so that type checkers see the re-exports; a test keeps it equal to
# the lazy table above.
__all__ = [
    "ENTRY_POINT_GROUP",
    "AsyncBrokerSandboxClient",
    "AsyncCommandHandle",
    "AsyncPtyHandle",
    "AsyncSandbox",
    "BrokerConnectionConfig",
    "BrokerSandbox",
    "BrokerSandboxClient",
    "CodeContext",
    "CommandEvent",
    "CommandHandle",
    "CommandInfo",
    "Credential",
    "CredentialRequest",
    "CredentialSource",
    "DefaultCredentials",
    "Execution",
    "ExecutionError",
    "Explanation",
    "FileInfo",
    "KubernetesAuth",
    "Logs",
    "OIDCTokenAuth",
    "OutputMessage",
    "ProviderDecision",
    "ProviderInfo",
    "PtyHandle",
    "Result",
    "Sandbox",
    "SandboxBrokerConnectionConfig",
    "SandboxError",
    "SandboxInfo",
    "WatchEvent",
    "__version__",
    "clear_credential_cache",
    "explain",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif name == "errors":
        value = importlib.import_module(".errors", __name__)
    elif name.endswith(("Error", "Warning")):  # an error class by its old top-level name
        errors = importlib.import_module(".errors", __name__)
        if name not in errors.__all__:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(errors, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from . import errors
    from .client._async_client import AsyncBrokerSandboxClient, AsyncSandbox
    from .client._async_commands import AsyncCommandHandle
    from .client._async_pty import AsyncPtyHandle
    from .client._client import BrokerSandbox, BrokerSandboxClient, Sandbox, SandboxInfo
    from .client._commands import CommandHandle
    from .client._pty import PtyHandle
    from .client.core._command_output import CommandEvent
    from .client.core._fsapi import FileInfo, WatchEvent
    from .client.http._config import BrokerConnectionConfig, SandboxBrokerConnectionConfig
    from .client.wire._code import (
        CodeContext,
        Execution,
        ExecutionError,
        Logs,
        OutputMessage,
        Result,
    )
    from .client.wire._commands_wire import CommandInfo
    from .credentials._auth import CredentialSource, KubernetesAuth, OIDCTokenAuth
    from .credentials._cache import clear_credential_cache
    from .credentials._chain import DefaultCredentials, Explanation, ProviderDecision, explain
    from .credentials._credential import Credential, CredentialRequest, ProviderInfo
    from .errors import *  # noqa: F403 - the old top-level error names
    from .errors import SandboxError
    from .hookspecs import ENTRY_POINT_GROUP, hookimpl
