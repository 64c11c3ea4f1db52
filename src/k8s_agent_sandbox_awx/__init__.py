"""Kubernetes agent sandboxes without a kubeconfig, through an OIDC identity broker.

``import k8s_agent_sandbox_awx`` is cheap: the public names below are imported on first use
(PEP 562), so the upstream client and httpx are loaded only when a sandbox is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> private module that defines it
_EXPORTS: dict[str, str] = {
    # --- credential framework -------------------------------------------------------------
    "Credential": "._credential",
    "CredentialRequest": "._credential",
    "ProviderInfo": "._credential",
    "hookimpl": ".hookspecs",
    "ENTRY_POINT_GROUP": ".hookspecs",
    "KubernetesAuth": "._auth",
    "OIDCTokenAuth": "._auth",
    "CredentialSource": "._auth",
    "DefaultCredentials": "._chain",
    "explain": "._chain",
    "Explanation": "._chain",
    "ProviderDecision": "._chain",
    "clear_credential_cache": "._cache",
    "CredentialError": "._credential_errors",
    "NoCredentialsError": "._credential_errors",
    "CredentialSourceError": "._credential_errors",
    "EmptyCredentialError": "._credential_errors",
    "UnreadableCredentialError": "._credential_errors",
    "MalformedTokenError": "._credential_errors",
    "TokenExpiredError": "._credential_errors",
    "AudienceMismatchError": "._credential_errors",
    "ForbiddenTokenSourceError": "._credential_errors",
    "CredentialPluginWarning": "._credential_errors",
    # --- broker client (sync) -------------------------------------------------------------
    "Sandbox": "._sandbox",
    "BrokerSandboxClient": "._client",
    "BrokerConnectionConfig": "._config",
    "BrokerError": "._exceptions",
    "BrokerAuthenticationError": "._exceptions",
    "BrokerPermissionError": "._exceptions",
    "BrokerQuotaError": "._exceptions",
    "BrokerUnavailableError": "._exceptions",
    "BrokerProtocolError": "._exceptions",
    "BrokerRedirectError": "._exceptions",
    "BrokerTLSError": "._exceptions",
    "BrokerNotFoundError": "._exceptions",
    "BrokerTemplateNotFoundError": "._exceptions",
    "BrokerConflictError": "._exceptions",
    "SandboxFailedError": "._exceptions",
    "SandboxTerminatingError": "._exceptions",
    "SandboxInfo": "._sandbox",
    "ConfigurationError": "._exceptions",
    "SandboxReadyTimeoutError": "._exceptions",
    "CommandTimeoutError": "._exceptions",
    "RequestTimeoutError": "._exceptions",
    # upstream's base class of every error above (``except SandboxError`` catches them all)
    "SandboxError": "._upstream",
    # --- broker client (async) ------------------------------------------------------------
    "AsyncSandbox": "._async_sandbox",
    "AsyncBrokerSandboxClient": "._async_client",
}

# A literal list, so that type checkers see the re-exports; a test keeps it equal to
# the lazy table above.
__all__ = [
    "ENTRY_POINT_GROUP",
    "AsyncBrokerSandboxClient",
    "AsyncSandbox",
    "AudienceMismatchError",
    "BrokerAuthenticationError",
    "BrokerConflictError",
    "BrokerConnectionConfig",
    "BrokerError",
    "BrokerNotFoundError",
    "BrokerPermissionError",
    "BrokerProtocolError",
    "BrokerQuotaError",
    "BrokerRedirectError",
    "BrokerSandboxClient",
    "BrokerTLSError",
    "BrokerTemplateNotFoundError",
    "BrokerUnavailableError",
    "CommandTimeoutError",
    "ConfigurationError",
    "Credential",
    "CredentialError",
    "CredentialPluginWarning",
    "CredentialRequest",
    "CredentialSource",
    "CredentialSourceError",
    "DefaultCredentials",
    "EmptyCredentialError",
    "Explanation",
    "ForbiddenTokenSourceError",
    "KubernetesAuth",
    "MalformedTokenError",
    "NoCredentialsError",
    "OIDCTokenAuth",
    "ProviderDecision",
    "ProviderInfo",
    "RequestTimeoutError",
    "Sandbox",
    "SandboxError",
    "SandboxFailedError",
    "SandboxInfo",
    "SandboxReadyTimeoutError",
    "SandboxTerminatingError",
    "TokenExpiredError",
    "UnreadableCredentialError",
    "__version__",
    "clear_credential_cache",
    "explain",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ._async_client import AsyncBrokerSandboxClient
    from ._async_sandbox import AsyncSandbox
    from ._auth import CredentialSource, KubernetesAuth, OIDCTokenAuth
    from ._cache import clear_credential_cache
    from ._chain import DefaultCredentials, Explanation, ProviderDecision, explain
    from ._client import BrokerSandboxClient
    from ._config import BrokerConnectionConfig
    from ._credential import Credential, CredentialRequest, ProviderInfo
    from ._credential_errors import (
        AudienceMismatchError,
        CredentialError,
        CredentialPluginWarning,
        CredentialSourceError,
        EmptyCredentialError,
        ForbiddenTokenSourceError,
        MalformedTokenError,
        NoCredentialsError,
        TokenExpiredError,
        UnreadableCredentialError,
    )
    from ._exceptions import (
        BrokerAuthenticationError,
        BrokerConflictError,
        BrokerError,
        BrokerNotFoundError,
        BrokerPermissionError,
        BrokerProtocolError,
        BrokerQuotaError,
        BrokerRedirectError,
        BrokerTemplateNotFoundError,
        BrokerTLSError,
        BrokerUnavailableError,
        CommandTimeoutError,
        ConfigurationError,
        RequestTimeoutError,
        SandboxFailedError,
        SandboxReadyTimeoutError,
        SandboxTerminatingError,
    )
    from ._sandbox import Sandbox, SandboxInfo
    from ._upstream import SandboxError
    from .hookspecs import ENTRY_POINT_GROUP, hookimpl
