"""What the CLI shows in a CI job (issue 30): a CI log is kept and shared, so the claims that
name a person (``user_email``, ...) are not printed, and what only a developer's machine has
(the local sandboxes' isolation) is left out; the claims a broker policy matches on in that CI
are named instead. Standard library only."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["PERSONAL_CLAIMS", "ci_name", "ci_note", "claim_text"]

PERSONAL_CLAIMS = frozenset(
    {"user_email", "user_login", "user_name", "user_id", "email", "name", "preferred_username",
     "actor", "actor_id", "triggering_actor"}
)  # fmt: skip
"""Claims that name a person (GitLab's ``user_*``, GitHub's ``actor``, OIDC's ``email``)."""

_POLICY_CLAIMS = {
    "GitLab CI": ("project_path", "ref", "ref_type", "ref_protected", "pipeline_source",
                  "environment"),
    "GitHub Actions": ("repository", "ref", "ref_type", "workflow_ref", "environment",
                       "event_name"),
}  # fmt: skip


def ci_name(environ: Mapping[str, str] | None = None) -> str | None:
    """``"GitLab CI"``, ``"GitHub Actions"``, ``"CI"`` (another one), or ``None``: not in CI."""
    env = os.environ if environ is None else environ
    if env.get("GITLAB_CI") == "true":
        return "GitLab CI"
    if env.get("GITHUB_ACTIONS") == "true":
        return "GitHub Actions"
    return "CI" if env.get("CI", "").lower() in ("true", "1") else None


def claim_text(part: str, key: str, value: Any) -> str:
    """One decoded claim as a line: a personal one is not shown in a CI log."""
    if part == "payload" and key in PERSONAL_CLAIMS and ci_name():
        return f"{part}.{key} = <not shown in a CI log>"
    return f"{part}.{key} = {value!r}"


def ci_note(payload: Mapping[str, Any]) -> str | None:
    """In CI, the line that says what matters there: the claims a policy matches on."""
    name = ci_name()
    if name is None:
        return None
    keys = _POLICY_CLAIMS.get(name, ())
    shown = ", ".join(f"{k}={payload[k]!r}" for k in keys if k in payload) or "see the claims"
    return (
        f"in {name}: the broker's policies match this job by sub={payload.get('sub')!r} and "
        f"{shown}; claims that name a person are not shown in a CI log"
    )
