"""What to do without a credential, in the terms of where the caller runs (issue 30): a GitLab
CI job (``GITLAB_CI=true``) is shown the ``id_tokens`` YAML for its job, with the broker URL as
its audience, instead of a projected ServiceAccount mount and a provider plugin, which do not
fit a job; a token under another variable (GitLab's common ``GITLAB_OIDC_TOKEN``) is named with
the way to use it. A variable's value is never shown: only its name."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ._providers import TOKEN_ENV, TOKEN_FILE_ENV

__all__ = ["fixes", "tokens_elsewhere"]

_JWT = re.compile(r"eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
_MOST_NAMED = 3


def tokens_elsewhere(environ: Mapping[str, str]) -> list[str]:
    """The names of the variables (ours aside) whose value is a JWT, sorted, at most three."""
    names = sorted(
        name
        for name, value in environ.items()
        if name not in (TOKEN_ENV, TOKEN_FILE_ENV) and _JWT.fullmatch(value.strip())
    )
    return names[:_MOST_NAMED]


def fixes(environ: Mapping[str, str], audience: str, token_path: str) -> list[str]:
    """The lines after "To fix it": for a GitLab CI job, its ``id_tokens``; elsewhere, every
    way a token can come; first, a token found under another name."""
    aud = repr(audience) if audience else "the broker URL"
    lines = [
        f"  - {name} holds a token (a JWT): name the token {TOKEN_ENV} instead, or in Python "
        f'pass auth=OIDCTokenAuth.from_env("{name}")'
        for name in tokens_elsewhere(environ)
    ]
    if environ.get("GITLAB_CI") == "true":
        return [
            "To fix it in this GitLab CI job (GITLAB_CI=true), do one of:",
            *lines,
            f"  - give the job an ID token named {TOKEN_ENV} with the broker URL as its audience"
            ", in .gitlab-ci.yml:",
            "      id_tokens:",
            f"        {TOKEN_ENV}:",
            f"          aud: {audience or 'https://your-broker.example'}",
        ]
    return [
        "To fix it, do one of:",
        *lines,
        f"  - set {TOKEN_ENV} to an OIDC token whose aud is {aud} (GitLab CI: id_tokens)",
        f"  - set {TOKEN_FILE_ENV} to the path of such a token file",
        f"  - mount a projected ServiceAccount token with audience {aud} at {token_path}",
        "  - install a provider plugin for your platform",
        "  - in Python: pass auth= explicitly",
    ]
