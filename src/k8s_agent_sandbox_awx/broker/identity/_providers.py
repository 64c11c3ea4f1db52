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
    "spelled_twice",
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


def spelled_twice(claims: Mapping[str, Any]) -> str | None:
    """The dotted name of a claim ``claims`` holds under two spellings with different values,
    else ``None``: ``{"kubernetes.io.namespace": "a", "kubernetes.io": {"namespace": "b"}}``
    holds ``kubernetes.io.namespace`` twice (a key with dots, and the nested claim). A policy
    that matched one spelling while the attributes read the other would admit the caller by one
    value and place its sandboxes by another, so the verifier refuses such a token.

    One walk of the claims: each claim is keyed by a hash chained over its name's dot-separated
    parts (both spellings give the same chain), and only claims whose chains meet are compared
    (their names and their values as :func:`claim_text`)."""
    seen: dict[int, list[tuple[int, Any]]] = {}
    names: list[tuple[int, str]] = [(-1, "")]  # node -> (its parent node, its key)
    stack: list[tuple[Mapping[str, Any], int, int]] = [(claims, 0, 0)]
    while stack:
        mapping, chain, parent = stack.pop()
        for key, value in mapping.items():
            node_chain = chain
            for part in str(key).split("."):
                node_chain = hash((node_chain, part))
            names.append((parent, str(key)))
            node = len(names) - 1
            seen.setdefault(node_chain, []).append((node, value))
            if isinstance(value, Mapping):
                stack.append((value, node_chain, node))
    for group in seen.values():
        if len(group) > 1:
            doubled = _different(group, names)
            if doubled is not None:
                return doubled
    return None


def _different(group: list[tuple[int, Any]], names: list[tuple[int, str]]) -> str | None:
    """The name of the claims in ``group`` (nodes whose chains met) when two of them are one
    name and differ in value."""

    def spelled(node: int) -> str:
        keys: list[str] = []
        while node > 0:
            node, key = names[node]
            keys.append(key)
        return ".".join(reversed(keys))

    by_name: dict[str, str] = {}
    for node, value in group:
        name = spelled(node)
        try:
            text = claim_text(value)
        except RecursionError:  # too deep to compare: not the same value
            return name
        if by_name.setdefault(name, text) != text:
            return name
    return None


def claim_text(value: Any) -> str:
    """A claim as text: a string as it is, anything else as its compact JSON (``true``,
    ``42``, ``["a","b"]``)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


_KUBERNETES_ATTRIBUTES: Final = (
    ("namespace", "kubernetes.io.namespace"),
    ("service_account", "kubernetes.io.serviceaccount.name"),
    ("pod", "kubernetes.io.pod.name"),
)


def kubernetes_attributes(claims: Mapping[str, Any]) -> dict[str, Any]:
    """A projected ServiceAccount token's ``kubernetes.io`` claim: ``namespace``,
    ``service_account`` and (for a pod-bound token) ``pod``, each read by :func:`claim_at`,
    as a policy's ``claims`` read them (``{caller.namespace}`` is the namespace a policy's
    ``kubernetes.io.namespace`` matched)."""
    attributes: dict[str, Any] = {}
    for attribute, name in _KUBERNETES_ATTRIBUTES:
        value = claim_at(claims, name)  # the lookup policies use: one value for both
        if isinstance(value, str):
            attributes[attribute] = value
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
