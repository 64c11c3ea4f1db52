"""Hook specifications for provider plugins (public as ``k8s_agent_sandbox_awx.hookspecs``).

A plugin is a module (or object) registered under the entry-point group
``k8s_agent_sandbox_awx.providers`` that implements these hooks with
:data:`k8s_agent_sandbox_awx.hookimpl`. See ``docs/writing-plugins.md``.
"""

from __future__ import annotations

import pluggy

from ._credential import Credential, CredentialRequest, ProviderInfo

PROJECT_NAME = "k8s_agent_sandbox_awx"
ENTRY_POINT_GROUP = "k8s_agent_sandbox_awx.providers"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def agent_sandbox_provider_info() -> ProviderInfo:  # type: ignore[empty-body]
    """Describe this plugin's provider: its priority and a hint for users.

    Called once, when the plugin is loaded. Optional: without it a provider has priority 0
    and no hint.
    """


@hookspec
def agent_sandbox_get_credential(request: CredentialRequest) -> Credential | None:
    """Return a credential for ``request.audience``, or ``None`` when this provider does not apply.

    - Not here (the environment this provider serves is absent): ``return request.not_here("why")``.
    - Here: return a :class:`Credential` whose ``provider`` is this plugin's name.
    - Here but broken (variable set but empty, endpoint failing, malformed token): raise a
      :class:`~k8s_agent_sandbox_awx.CredentialSourceError`. That stops discovery with the error;
      the host never falls through to another identity.

    The host calls each provider individually in its own documented order; it never relies on
    pluggy's registration order. Answer within ``request.timeout`` seconds (give it to your HTTP
    client, and raise when your platform's endpoint is too slow): a little later the host stops
    waiting and, during discovery, skips this provider with a warning.
    """


@hookspec
async def agent_sandbox_get_credential_async(
    request: CredentialRequest,
) -> Credential | None:
    """The async variant of :func:`agent_sandbox_get_credential`, implemented as an ``async def``.

    Same answers (``None`` via ``request.not_here``, a :class:`Credential`, or a raised
    :class:`~k8s_agent_sandbox_awx.CredentialSourceError`). A plugin implements either hook or
    both:

    - the async path (``aget_credential``) awaits this hook when the plugin has it, and
      otherwise runs the sync hook in a helper thread so that a blocking fetch never blocks
      the event loop;
    - the sync path (``get_credential``, ``explain``) calls the sync hook when the plugin has
      it, and otherwise runs this hook to completion on a fresh event loop in a helper thread.
    """
