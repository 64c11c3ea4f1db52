"""The local broker stack: OIDC issuers, the identity broker and local sandboxes on loopback.

Install with the ``[local]`` extra. ``from k8s_agent_sandbox_awx.testing import LocalBroker``::

    with LocalBroker() as broker:
        token = broker.tokens.issue_kubernetes("team-a", "agent")
        ...

``LocalBroker`` owns three parts: ``broker.tokens`` (``Tokens``: issuers and tokens),
``broker.inspect`` (``Inspection``: its state, for assertions) and ``broker.faults``
(``Faults``: failure injection).

For testing a credential provider plugin (standard library only, no extra needed):
``ScriptedEndpoint`` (a scripted HTTP server on 127.0.0.1 standing in for a platform's token
service, with ``Reply`` and ``RecordedRequest``), ``unsigned_jwt`` / ``unverified_claims``,
``call_concurrently``, ``check_cached_then_refreshed``, ``check_entry_point`` and
``SDK_VARIABLES``; see docs/writing-plugins.md.

WARNING: local sandboxes are host processes with NO isolation, or, with bubblewrap installed,
processes in Linux namespaces of their own, which are not a virtual machine (see
``BWRAP_ISOLATION_WARNING`` and docs/local-broker.md, "Isolation"). Use the local broker for
development and tests only, never to run untrusted code.

The names below are imported on first use (PEP 562), so the plugin kit works without the
``[local]`` extra and importing this package loads nothing of the broker.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._messages import EXTRA_HINT, NO_ISOLATION_WARNING

_EXPORTS: dict[str, str] = {
    "LocalBroker": "._broker",
    "Tokens": "._tokens",
    "Inspection": "._inspection",
    "Faults": "._faults",
    "Issuer": "._issuers",
    "Policy": "..broker.identity._policy",
    "Caller": "..broker.identity._policy",
    "caller_namespace": "..broker.identity._policy",
    "RuntimeLauncher": "..broker.backends.local._launcher",
    "SandboxBackend": "..broker.backends.local._launcher",  # RuntimeLauncher's deprecated name
    "SandboxSpec": "..broker.backends.local._launcher",
    "RuntimeHandle": "..broker.backends.local._launcher",
    "RuntimeStartError": "..broker.backends.local._launcher",
    "LocalProcessLauncher": "..broker.backends.local._processes",
    "LocalProcessBackend": "..broker.backends.local._processes",  # deprecated name (issue 27)
    "DEFAULT_RUNTIME_COMMAND": "..broker.backends.local._processes",
    "IsolationUnavailable": "..broker.backends.local._bubblewrap",
    "Isolation": "..broker.backends.local._bubblewrap",
    "local_isolation": "._messages",
    "isolation_warning": "._messages",
    "BWRAP_ISOLATION_WARNING": "._messages",
    "RESERVED_PREFIX": "..broker.identity._policy",
    # for plugin authors' tests (standard library only: no [local] extra needed)
    "ScriptedEndpoint": "._endpoint",
    "Reply": "._endpoint",
    "RecordedRequest": "._endpoint",
    "unsigned_jwt": "._plugin_kit",
    "unverified_claims": "._plugin_kit",
    "call_concurrently": "._plugin_kit",
    "check_cached_then_refreshed": "._plugin_kit",
    "check_entry_point": "._plugin_kit",
    "SDK_VARIABLES": "._plugin_kit",
}

# A literal list, so that type checkers see the re-exports; a test keeps it equal to
# the lazy table above.
__all__ = [
    "BWRAP_ISOLATION_WARNING",
    "DEFAULT_RUNTIME_COMMAND",
    "EXTRA_HINT",
    "NO_ISOLATION_WARNING",
    "RESERVED_PREFIX",
    "SDK_VARIABLES",
    "Caller",
    "Faults",
    "Inspection",
    "Isolation",
    "IsolationUnavailable",
    "Issuer",
    "LocalBroker",
    "LocalProcessBackend",
    "LocalProcessLauncher",
    "Policy",
    "RecordedRequest",
    "Reply",
    "RuntimeHandle",
    "RuntimeLauncher",
    "RuntimeStartError",
    "SandboxBackend",
    "SandboxSpec",
    "ScriptedEndpoint",
    "Tokens",
    "call_concurrently",
    "caller_namespace",
    "check_cached_then_refreshed",
    "check_entry_point",
    "isolation_warning",
    "local_isolation",
    "unsigned_jwt",
    "unverified_claims",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module, __name__), name)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"{EXTRA_HINT} (missing module: {exc.name})") from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover
    from ..broker.backends.local._bubblewrap import Isolation as Isolation
    from ..broker.backends.local._bubblewrap import IsolationUnavailable as IsolationUnavailable
    from ..broker.backends.local._launcher import RuntimeHandle as RuntimeHandle
    from ..broker.backends.local._launcher import RuntimeLauncher as RuntimeLauncher
    from ..broker.backends.local._launcher import RuntimeStartError as RuntimeStartError
    from ..broker.backends.local._launcher import SandboxBackend as SandboxBackend
    from ..broker.backends.local._launcher import SandboxSpec as SandboxSpec
    from ..broker.backends.local._processes import (
        DEFAULT_RUNTIME_COMMAND as DEFAULT_RUNTIME_COMMAND,
    )
    from ..broker.backends.local._processes import LocalProcessBackend as LocalProcessBackend
    from ..broker.backends.local._processes import LocalProcessLauncher as LocalProcessLauncher
    from ..broker.identity._policy import RESERVED_PREFIX as RESERVED_PREFIX
    from ..broker.identity._policy import Caller as Caller
    from ..broker.identity._policy import Policy as Policy
    from ..broker.identity._policy import caller_namespace as caller_namespace
    from ._broker import LocalBroker as LocalBroker
    from ._endpoint import RecordedRequest as RecordedRequest
    from ._endpoint import Reply as Reply
    from ._endpoint import ScriptedEndpoint as ScriptedEndpoint
    from ._faults import Faults as Faults
    from ._inspection import Inspection as Inspection
    from ._issuers import Issuer as Issuer
    from ._messages import BWRAP_ISOLATION_WARNING as BWRAP_ISOLATION_WARNING
    from ._messages import isolation_warning as isolation_warning
    from ._messages import local_isolation as local_isolation
    from ._plugin_kit import SDK_VARIABLES as SDK_VARIABLES
    from ._plugin_kit import call_concurrently as call_concurrently
    from ._plugin_kit import check_cached_then_refreshed as check_cached_then_refreshed
    from ._plugin_kit import check_entry_point as check_entry_point
    from ._plugin_kit import unsigned_jwt as unsigned_jwt
    from ._plugin_kit import unverified_claims as unverified_claims
    from ._tokens import Tokens as Tokens
