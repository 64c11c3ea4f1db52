"""What each provider's tokens carry: the claims kept as a caller's attributes, and the
dotted-name lookup that policies and attributes share.

Claim shapes as the platforms document them (Kubernetes projected tokens, GitLab
CI ``id_tokens``, GitHub Actions OIDC, Google's metadata server).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = [
    "DEFAULT_ATTRIBUTES",
    "GITHUB_ACTIONS_ATTRIBUTES",
    "GITLAB_ATTRIBUTES",
    "GOOGLE_ATTRIBUTES",
    "MISSING",
    "attributes_for",
    "claim_at",
    "claim_text",
    "kubernetes_attributes",
]

GITLAB_ATTRIBUTES: Final = (
    "project_path",
    "project_id",
    "namespace_path",
    "ref",
    "ref_type",
    "ref_protected",
    "pipeline_id",
    "job_id",
    "user_login",
)
GITHUB_ACTIONS_ATTRIBUTES: Final = (
    "repository",
    "repository_owner",
    "ref",
    "workflow_ref",
    "job_workflow_ref",
    "environment",
    "run_id",
)
GOOGLE_ATTRIBUTES: Final = ("email", "email_verified", "azp")
DEFAULT_ATTRIBUTES: Final[Mapping[str, tuple[str, ...]]] = {
    "gitlab": GITLAB_ATTRIBUTES,
    "github-actions": GITHUB_ACTIONS_ATTRIBUTES,
    "google": GOOGLE_ATTRIBUTES,
}
"""The top-level claims each provider's callers keep by default (Kubernetes: see
:func:`kubernetes_attributes`; any other provider: none)."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()
"""What :func:`claim_at` answers for a claim the token does not have."""


def claim_at(claims: Mapping[str, Any], name: str) -> Any:
    """The claim ``name``, where dots reach into nested objects: ``kubernetes.io.namespace``
    is ``claims["kubernetes.io"]["namespace"]``. A key that itself holds dots is found by
    trying the longest key first at each level; :data:`MISSING` when there is none."""
    return _lookup(claims, name.split("."))


def _lookup(value: Any, parts: Sequence[str]) -> Any:
    if not parts:
        return value
    if not isinstance(value, Mapping):
        return MISSING
    for cut in range(len(parts), 0, -1):
        key = ".".join(parts[:cut])
        if key in value:
            found = _lookup(value[key], parts[cut:])
            if found is not MISSING:
                return found
    return MISSING


def claim_text(value: Any) -> str:
    """A claim as text: a string as it is, anything else as its compact JSON (``true``,
    ``42``, ``["a","b"]``)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def kubernetes_attributes(claims: Mapping[str, Any]) -> dict[str, Any]:
    """A projected ServiceAccount token's ``kubernetes.io`` claim: ``namespace``,
    ``service_account`` and (for a pod-bound token) ``pod``."""
    info = claims.get("kubernetes.io")
    info = info if isinstance(info, dict) else {}
    attributes: dict[str, Any] = {}
    if isinstance(info.get("namespace"), str):
        attributes["namespace"] = info["namespace"]
    sa = info.get("serviceaccount")
    if isinstance(sa, dict) and isinstance(sa.get("name"), str):
        attributes["service_account"] = sa["name"]
    pod = info.get("pod")
    if isinstance(pod, dict) and isinstance(pod.get("name"), str):
        attributes["pod"] = pod["name"]
    return attributes


def attributes_for(
    provider: str, names: Sequence[str] | None, claims: Mapping[str, Any]
) -> dict[str, Any]:
    """The caller attributes of ``claims``: the provider's defaults when ``names`` is
    ``None``, else exactly ``names``, each the claim of that (dotted) name, or for a
    Kubernetes issuer one of the attributes it derives (``namespace``, ``service_account``,
    ``pod``). Claims the token lacks are left out. Strings, numbers and booleans are kept as
    they are; anything else as its JSON text (attributes are stamped as annotations)."""
    derived = kubernetes_attributes(claims) if provider == "kubernetes" else {}
    if names is None:
        names = tuple(derived) if provider == "kubernetes" else DEFAULT_ATTRIBUTES.get(provider, ())
    attributes: dict[str, Any] = {}
    for name in names:
        value = derived[name] if name in derived else claim_at(claims, name)
        if value is not MISSING:
            attributes[name] = _scalar(value)
    return attributes


def _scalar(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool) else claim_text(value)
