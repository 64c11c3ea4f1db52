"""What :func:`._chain.explain` reports: each provider's decision (:class:`ProviderDecision`),
the whole report (:class:`Explanation`, ``str()`` for humans) and the record a discovery fills
in while it consults the providers (:class:`Record`). Never a token: a decision's detail names
sources, and the claims are decoded without the signature."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from ._credential import Credential
from ._credential_errors import CredentialError, MalformedTokenError
from ._jwt import DecodedToken, decode_token
from ._plugins import PluginProblem, ProviderEntry

__all__ = ["Explanation", "ProviderDecision", "Record", "Status", "selected_detail"]

logger = logging.getLogger("k8s_agent_sandbox_awx.credentials")

Status = Literal["selected", "not here", "shadowed", "error", "failed to load", "timed out"]


class Record:
    """What :meth:`DefaultCredentials.explain` learns from each provider during discovery."""

    def __init__(self) -> None:
        self.decisions: list[ProviderDecision] = []
        self.selected: str | None = None
        self.claims: dict[str, dict[str, Any]] | None = None
        self.error: CredentialError | None = None
        self.stopped_by = ""
        """The provider discovery would have stopped at (selected, or broken)."""

    def add(
        self, name: str, status: Status, detail: str, error: CredentialError | None = None
    ) -> None:
        self.decisions.append(ProviderDecision(name, status, detail, error))

    def broken(self, provider: ProviderEntry, exc: CredentialError) -> None:
        """The provider raised: discovery stops here (or already stopped before it)."""
        described = f"{type(exc).__name__}: {exc}"
        if self.stopped_by:
            self.add(
                provider.name,
                "shadowed",
                f"present but broken, not consulted after {self.stopped_by!r}: {described}",
                exc,
            )
            return
        self.stopped_by, self.error = provider.name, exc
        self.add(provider.name, "error", described, exc)

    def shadowed(self, provider: ProviderEntry, result: object) -> None:
        source = result.source if isinstance(result, Credential) else ""
        detail = f"also present ({source or provider.origin}); {self.stopped_by!r} comes first"
        self.add(provider.name, "shadowed", detail)
        logger.debug("credential provider %r is shadowed: %s", provider.name, detail)

    def rejected(self, provider: ProviderEntry, exc: CredentialError, result: object) -> None:
        """The provider's credential failed the checks (expired, wrong audience...)."""
        self.stopped_by, self.error = provider.name, exc
        self.claims = claims_for_diagnosis(result)
        self.add(provider.name, "error", f"{type(exc).__name__}: {exc}", exc)

    def winner(
        self, provider: ProviderEntry, credential: Credential, decoded: DecodedToken | None
    ) -> None:
        self.stopped_by = self.selected = provider.name
        self.claims = decoded.claims() if decoded is not None else None
        self.add(provider.name, "selected", selected_detail(credential, decoded))

    def finish(self, problems: Iterable[PluginProblem], no_credentials: CredentialError) -> None:
        for problem in problems:
            status: Status = "failed to load" if problem.status == "failed to load" else "not here"
            origin = f" ({problem.origin})" if problem.origin else ""
            self.add(problem.name, status, problem.detail + origin)
        if self.selected is None and self.error is None:
            self.error = no_credentials


def claims_for_diagnosis(result: object) -> dict[str, dict[str, Any]] | None:
    if not isinstance(result, Credential) or not isinstance(result.token, str):
        return None
    try:
        decoded = decode_token(result.token.strip())
    except MalformedTokenError:
        return None
    return decoded.claims() if decoded is not None else None


def selected_detail(credential: Credential, decoded: DecodedToken | None) -> str:
    how = (
        "file-backed: re-read on every request"
        if credential.file_backed
        else "cached until shortly before exp"
    )
    kind = "JWT" if decoded is not None else "opaque token (not a JWT: no audience check)"
    return f"{credential.source or credential.provider}; {kind}; {how}"


@dataclass(frozen=True)
class ProviderDecision:
    """What one provider did: ``status`` is selected / not here / shadowed / error /
    failed to load; ``detail`` says why (never a token)."""

    name: str
    status: Status
    detail: str = ""
    error: CredentialError | None = field(default=None, compare=False, repr=False)
    """The typed error behind an ``error`` decision (for tools such as ``doctor``)."""


@dataclass(frozen=True)
class Explanation:
    """The result of :func:`explain`. ``str()`` renders a report for humans."""

    audience: str
    decisions: list[ProviderDecision] = field(default_factory=list)
    selected: str | None = None
    claims: dict[str, dict[str, Any]] | None = None
    """The selected token's decoded ``{"header": ..., "payload": ...}`` (never the signature)."""
    error: CredentialError | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "audience": self.audience,
            "selected": self.selected,
            "decisions": [
                {"name": d.name, "status": d.status, "detail": d.detail} for d in self.decisions
            ],
            "claims": self.claims,
            "error": None
            if self.error is None
            else {"type": type(self.error).__name__, "message": str(self.error)},
        }

    def __str__(self) -> str:
        lines = [f"Credentials for {self.audience}:"]
        width = max((len(d.name) for d in self.decisions), default=0)
        for d in self.decisions:
            lines.append(f"  {d.name:<{width}}  {d.status:<14}  {d.detail}")
        if self.selected is not None:
            lines.append(f"Selected: {self.selected}")
        if self.claims is not None:
            lines.append("Token claims (decoded, not verified; signature omitted):")
            for part in ("header", "payload"):
                for name, value in sorted(self.claims.get(part, {}).items()):
                    lines.append(f"  {part}.{name} = {value!r}")
        if self.error is not None:
            lines.append(f"Error: {type(self.error).__name__}:")
            lines += [f"  {line}" for line in str(self.error).splitlines()]
        return "\n".join(lines)
