"""Hook specifications for credential provider plugins.

A plugin is a module (or object) registered under the entry-point group
``k8s_agent_sandbox_awx.providers`` that implements these hooks with
:data:`k8s_agent_sandbox_awx.hookimpl`. See ``docs/writing-plugins.md``.

The specifications are defined with the credential framework (``credentials/_hookspecs.py``);
this module is where plugin authors import them from.
"""

from __future__ import annotations

from .credentials._hookspecs import (
    ENTRY_POINT_GROUP,
    PROJECT_NAME,
    agent_sandbox_get_credential,
    agent_sandbox_get_credential_async,
    agent_sandbox_provider_info,
    hookimpl,
    hookspec,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "agent_sandbox_get_credential",
    "agent_sandbox_get_credential_async",
    "agent_sandbox_provider_info",
    "hookimpl",
    "hookspec",
]
