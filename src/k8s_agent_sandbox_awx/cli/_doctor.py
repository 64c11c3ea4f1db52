"""``agent-sandbox-awx doctor``: checks of the configuration, the credentials and the broker,
as a structured :class:`DoctorReport` (the CLI prints it; ``--json`` dumps ``to_dict()``).

Every decision reads a typed error or a typed field (``ProviderDecision.error``,
``BrokerTLSError``), never the text of a message.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

from .._local_dev import stopped_dev_at
from .._upstream import SandboxNotFoundError
from ..client._client import BrokerSandboxClient
from ..client.http._config import NO_BROKER_URL_FIX, BrokerConnectionConfig
from ..client.wire._dialect import WHOAMI
from ..client.wire._protocol import redact_answer
from ..credentials._chain import Explanation, explain
from ..credentials._credential_errors import (
    AudienceMismatchError,
    NoCredentialsError,
    TokenExpiredError,
)
from ..credentials._jwt import normalise_url
from ..errors import BrokerAuthenticationError, BrokerTLSError, ConfigurationError, SandboxError
from ._ci import ci_note, claim_text
from ._messages import cli_message

__all__ = ["Check", "DoctorReport", "check_broker", "check_credentials", "run_doctor"]

_CREDENTIAL_HINTS: tuple[tuple[type[Exception], str], ...] = (
    (
        NoCredentialsError,
        "Set AGENT_SANDBOX_TOKEN or AGENT_SANDBOX_TOKEN_FILE, mount a projected service-account "
        "token with the broker URL as audience, or install a provider plugin.",
    ),
    (
        AudienceMismatchError,
        "Issue the token with the broker URL as its audience, or fix the broker URL if it is "
        "mistyped.",
    ),
    (
        TokenExpiredError,
        "Get a fresh token from its source (the kubelet renews projected tokens; CI tokens live "
        "as long as their job), and check this machine's clock.",
    ),
)
_NO_AUDIENCE = (
    "audience check skipped: no usable broker URL (the token's audience must be the broker URL)"
)


@dataclass(frozen=True)
class Check:
    """One check: passed or failed, why, and (on failure) what to do."""

    name: str
    ok: bool
    detail: str
    hint: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.name, "ok": self.ok, "detail": self.detail, "hint": self.hint}


@dataclass
class DoctorReport:
    """The checks in the order they ran, details for humans, and the credential report."""

    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    credentials: dict[str, Any] | None = None
    protocol: str | None = None
    """The broker dialect spoken (``v1`` or ``rpc``), once the broker answered."""
    local_isolation: dict[str, str | None] | None = None
    """The isolation local sandboxes get on this machine (``dev``, ``demo``, ``LocalBroker``):
    ``mode`` (``"bwrap"``, ``"none"``, ``None`` when the one asked for cannot be had) and
    ``detail``; set by the CLI, ``None`` when not looked at."""

    def check(self, name: str, ok: bool, detail: str, hint: str = "") -> bool:
        self.checks.append(Check(name, ok, detail, "" if ok else hint))
        return ok

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "protocol": self.protocol,
            "checks": [c.to_dict() for c in self.checks],
            "credentials": self.credentials,
            "local_isolation": self.local_isolation,
        }

    def __str__(self) -> str:
        lines: list[str] = []
        for c in self.checks:
            lines.append(f"{'PASS' if c.ok else 'FAIL'}  {c.name:<14} {c.detail}")
            if c.hint:
                lines.append(f"      hint: {c.hint}")
        if self.local_isolation is not None:
            mode, detail = self.local_isolation["mode"], self.local_isolation["detail"]
            said = f"isolation {detail}" if mode else f"they cannot start: {detail}"
            lines.append(f"local sandboxes here (dev, demo, LocalBroker): {said}")
        if self.notes:
            lines.append("details:")
            lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def run_doctor(
    config_from: Callable[[], BrokerConnectionConfig] = BrokerConnectionConfig.from_env,
    args: argparse.Namespace | None = None,
) -> DoctorReport:
    """Check the configuration (``config_from()``: by default the environment), the
    credentials and the broker; ``args``: the CLI's options (which settings are flags)."""
    report = DoctorReport()
    try:
        config = config_from()
    except (ConfigurationError, ValueError) as exc:
        unset = getattr(exc, "fix", None) is NO_BROKER_URL_FIX
        said = getattr(exc, "what", "") if unset else cli_message(exc, args)
        report.check("config", False, " ".join(said.split()), _config_hint(unset))
        why = "without a broker URL" if unset else "as the configuration was refused (above)"
        check_credentials(report, None, why)
        report.notes.append(
            f"skipped {why}: audience, reachability, tls, clock skew and authentication"
        )
        return report
    report.check("config", True, f"broker URL {config.broker_url} (the token audience)")
    check_credentials(report, config.audience)
    credentials_ok = report.ok
    try:
        client = BrokerSandboxClient(config)
    except ConfigurationError as exc:  # the CA bundle or client certificate cannot be used
        report.check(
            "tls",
            False,
            _one_line(exc),
            "Point AGENT_SANDBOX_CA_BUNDLE (or --ca-bundle) at the PEM file of the CA that signed "
            "the broker's certificate.",
        )
        return report
    try:
        check_broker(report, client, credentials_ok)
    finally:
        client.close()
    return report


def _config_hint(unset: bool) -> str:
    """The next step for a configuration refused (its message says what to fix) or missing."""
    if not unset:
        return (
            "Change the setting the message names; the checks that need the broker are "
            "skipped until then."
        )
    return (
        "For a broker on this machine, run `agent-sandbox-awx dev` and export the lines it "
        "prints; for another broker, set AGENT_SANDBOX_BROKER_URL (or --broker-url) to its "
        "https:// URL (and AGENT_SANDBOX_CA_BUNDLE for a private CA)."
    )


# --------------------------------------------------------------------------------------------
# Credentials


def _explain_without_audience() -> Explanation:
    """Every provider's decision when no broker URL is configured: a token that was found is
    reported as selected, its audience unchecked (there is nothing to check it against)."""
    explanation = explain("")
    if not isinstance(explanation.error, AudienceMismatchError):
        return explanation
    decisions = list(explanation.decisions)
    selected = None
    for i, d in enumerate(decisions):
        if d.status == "error" and isinstance(d.error, AudienceMismatchError):
            selected = d.name
            decisions[i] = dataclasses.replace(
                d, status="selected", detail=f"a token was found; {_NO_AUDIENCE}", error=None
            )
    return dataclasses.replace(explanation, decisions=decisions, selected=selected, error=None)


def _credential_hint(error: Exception | None) -> str:
    for kind, hint in _CREDENTIAL_HINTS:
        if isinstance(error, kind):
            return hint
    return "The error names the source and the fix; the details below list every provider."


def check_credentials(
    report: DoctorReport, audience: str | None, why: str = "without a broker URL"
) -> None:
    """The credential checks; ``audience`` ``None`` (no broker URL): the providers' decisions
    and the token's claims and expiry, the audience check skipped with a note."""
    explanation = _explain_without_audience() if audience is None else explain(audience)
    report.credentials = explanation.to_dict()
    if audience is None:
        report.credentials["audience"] = None
    report.notes += [f"provider {d.name}: {d.status}: {d.detail}" for d in explanation.decisions]
    found = explanation.selected is not None and explanation.error is None
    detail = (
        f"selected provider: {explanation.selected}"
        if explanation.selected
        else str(explanation.error)  # the CLI shows no Python class (issue 30)
    )
    if not report.check("credentials", found, detail, _credential_hint(explanation.error)):
        return
    claims = explanation.claims
    if claims is None:
        report.check("token claims", True, "opaque token (not a JWT): no local checks possible")
        return
    for part in ("header", "payload"):
        for key, value in sorted(claims.get(part, {}).items()):
            report.notes.append(claim_text(part, key, value))  # in CI: no personal claims
    report.notes.append("signature = <redacted>")
    payload = claims.get("payload", {})
    if note := ci_note(payload):
        report.notes.append(note)
    _check_audience(report, payload.get("aud"), audience, why)
    _check_expiry(report, payload.get("exp"))


def _check_audience(report: DoctorReport, aud: Any, audience: str | None, why: str) -> None:
    if audience is None:
        report.notes.append(
            f"aud={aud!r}: audience check skipped {why} (the token's audience must be the "
            "broker URL)"
        )
        return
    auds = aud if isinstance(aud, list) else [aud]
    wanted = normalise_url(audience)  # the rule the SDK applies before sending a token
    report.check(
        "audience",
        any(isinstance(a, str) and normalise_url(a) == wanted for a in auds),
        f"aud={aud!r}, broker URL={audience!r}",
        "Request the token with the broker URL as its audience (for a projected token: "
        "serviceAccountToken.audience; for GitLab: id_tokens.<NAME>.aud).",
    )


def _check_expiry(report: DoctorReport, exp: Any) -> None:
    if not isinstance(exp, int | float):
        report.check("expiry", False, "the token has no exp claim", "Use a token with an expiry.")
        return
    left = exp - time.time()
    report.check(
        "expiry",
        left > 0,
        f"expires in {left:.0f}s" if left > 0 else f"expired {-left:.0f}s ago",
        "Refresh the token source; projected tokens are renewed by the kubelet, CI tokens by "
        "re-running the job.",
    )


# --------------------------------------------------------------------------------------------
# The broker


def check_broker(report: DoctorReport, client: BrokerSandboxClient, credentials_ok: bool) -> None:
    """Reachability, TLS, clock skew and (if the credentials passed) authentication."""
    url = client.broker_url
    asked = _now()
    try:
        reply = client.healthz()
    except BrokerTLSError as exc:
        report.check("reachability", True, f"{url} answered the TLS handshake")
        report.check(
            "tls",
            False,
            _one_line(exc),
            "Set AGENT_SANDBOX_CA_BUNDLE (or --ca-bundle) to the CA that signed the broker's "
            "certificate.",
        )
        return
    except SandboxError as exc:
        dev = stopped_dev_at(url, client.connection_config.ca_cert)  # a stopped `dev`'s URL
        report.check(
            "reachability",
            False,
            _one_line(exc),
            "Start `agent-sandbox-awx dev` again, as the message says."
            if dev
            else "Check the broker URL, DNS, proxies and that the broker is running.",
        )
        return
    spec = client.dialect.healthz().spec
    report.check("reachability", True, f"{spec.method} {url}{spec.path} -> {reply.status_code}")
    how = "pinned by broker_protocol" if client.connection_config.broker_protocol else "found out"
    report.check("protocol", True, f"the broker speaks the {client.dialect.name!r} dialect ({how})")
    report.protocol = client.dialect.name
    if url.startswith("https://"):
        ca = client.connection_config.ca_cert or "the system trust store"
        report.check("tls", True, f"certificate verified against {ca}")
    else:
        report.check("tls", False, "plain http:// (loopback only)", "Use https:// outside tests.")
    _check_clock(report, reply.headers.get("date"), asked, _now())
    if credentials_ok:
        _check_authentication(report, client)


def _now() -> float:
    return time.time()


def _check_clock(report: DoctorReport, date: str | None, asked: float, answered: float) -> None:
    """The broker dated its answer between ``asked`` and ``answered`` (this machine's clock), in
    whole seconds (a Date of 12:00:00 is any time up to 12:00:01): the skew is how far outside
    that its Date is, so that a slow answer is not counted as skew, nor the second cut off."""
    if not date:
        report.check("clock skew", False, "the broker sent no Date header", "Upgrade the broker.")
        return
    broker_time = None
    with contextlib.suppress(TypeError, ValueError):
        broker_time = parsedate_to_datetime(date)
    if broker_time is None or broker_time.tzinfo is None:
        report.check(
            "clock skew",
            False,
            f"the broker's Date header {redact_answer(date)!r} is not an HTTP date with a time "
            "zone",
            "Check that the broker URL points at an agent-sandbox broker, and compare the "
            "clocks by hand.",
        )
        return
    dated = broker_time.timestamp()
    skew = asked - (dated + 1) if asked > dated + 1 else min(0.0, answered - dated)
    report.check(
        "clock skew",
        abs(skew) <= 60,
        f"{skew:+.1f}s against the broker's Date header",
        "Synchronise this machine's clock (NTP); tokens are rejected when clocks disagree.",
    )


def _check_authentication(report: DoctorReport, client: BrokerSandboxClient) -> None:
    if WHOAMI not in client.dialect.features:
        _check_token_accepted(report, client)
        return
    try:
        who = client.whoami()
    except SandboxError as exc:
        report.check(
            "authentication",
            False,
            _one_line(exc),
            "See the hint above; `agent-sandbox-awx whoami` repeats this check.",
        )
        return
    report.check(
        "authentication",
        True,
        f"the broker verified {who.get('subject')} (provider {who.get('provider')})",
    )


def _check_token_accepted(report: DoctorReport, client: BrokerSandboxClient) -> None:
    """Authentication for a dialect without whoami: the status of a claim that does not exist
    (``404`` means the broker accepted the token; nothing is created)."""
    try:
        client.get_info("broker-doctor-probe")
    except SandboxNotFoundError:
        report.check(
            "authentication",
            True,
            f"the broker accepted the token (the {client.dialect.name!r} dialect cannot say "
            "who you are)",
        )
    except (BrokerAuthenticationError, SandboxError) as exc:
        report.check(
            "authentication",
            False,
            _one_line(exc),
            "See the hint above; check the token's audience and issuer with the details below.",
        )
    else:
        report.check("authentication", True, "the broker accepted the token")
