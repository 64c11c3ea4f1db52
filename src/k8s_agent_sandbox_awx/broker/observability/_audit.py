"""The audit log: one line for every control-plane decision, on a stream of its own.

A line (``"log": "audit"``) is written for

- every request that changes a claim (create, delete, extend: ``action``), whatever its
  outcome: ``admitted`` (which claim, namespace, pool, lifetime, the policy that admitted it),
  ``replayed`` (an idempotent create answered with the claim it made before), ``deleted``,
  ``absent`` (``/rpc`` delete of a claim that is not there), ``extended``; ``refused`` (by policy
  or quota: the broker's code and why; a quota's name, value and how many the caller holds),
  ``invalid`` (a request the broker could not act on) or ``failed`` (5xx);
- every token the gate refused (``action: "authenticate"``, ``outcome: "refused"``), on any
  route: the reason code and detail, the token's fingerprint when it has a JWT's shape, and
  its issuer and subject only if its signature verified (a forged token's claims are never
  written as who did it);
- any other request the broker refused as not allowed (its own ``403``/``429``, e.g.
  ``policy_denied`` on ``whoami``, ``not_owner`` on the data plane).

Who: ``issuer``, ``subject``, ``provider`` and the caller's ``attributes`` (the claims the
provider selects, as stamped onto the claim). Never a token, a header or a raw path. The
claim's annotations remain the durable record in the cluster; this is the stream of decisions.
"""

from __future__ import annotations

from typing import Any, Final

from ..common._observed import Exchange
from ..common._route_names import action_of
from ._access import Counts
from ._lines import LineWriter, timestamp

__all__ = ["Audit", "audit_record", "outcome_of"]

MAX_REASON_CHARS: Final = 300

_DONE: Final = {"create": "admitted", "delete": "deleted", "extend": "extended"}


def outcome_of(action: str, exchange: Exchange, status: int) -> str:
    """A decision's outcome (see the module)."""
    if status >= 500 or status == 0:
        return "failed"
    if status >= 400:
        return "refused" if status in (401, 403, 404, 409, 429) else "invalid"
    if exchange.decision.get("replayed"):
        return "replayed"
    if action == "delete" and exchange.sandbox is None:
        return "absent"  # /rpc: 204 for a claim that is not there
    return _DONE[action]


def _cut(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def _who(exchange: Exchange) -> dict[str, Any]:
    caller = exchange.caller
    rejection = exchange.rejection
    if caller is not None:
        who: dict[str, Any] = {
            "issuer": caller.issuer,
            "subject": caller.subject,
            "provider": caller.provider,
            "attributes": dict(caller.attributes),
        }
    elif rejection is not None and rejection.identity is not None:
        who = {"issuer": rejection.identity[0], "subject": rejection.identity[1]}
    else:
        who = {"issuer": None, "subject": None}
    who["token_fingerprint"] = exchange.fingerprint
    return who


def audit_record(exchange: Exchange, counts: Counts) -> dict[str, Any] | None:
    """The audit line for one finished request (``None``: it decided nothing to audit)."""
    status = counts.status
    action = action_of(exchange.method, exchange.route)
    code: str | None
    reason: str | None
    if exchange.rejection is not None:  # refused; failed: its issuer is down (503)
        action, outcome = "authenticate", "failed" if status >= 500 else "refused"
        code, reason = exchange.rejection.code, exchange.rejection.detail
    elif action is not None:
        outcome = outcome_of(action, exchange, status)
        code, reason = exchange.error or (None, None)
    elif status in (403, 429) and exchange.error is not None and exchange.caller is not None:
        action, outcome = "access", "refused"
        code, reason = exchange.error
    else:
        return None
    return {
        "time": timestamp(),
        "log": "audit",
        "request_id": exchange.request_id,
        "action": action,
        "outcome": outcome,
        "route": exchange.route,
        "status": status,
        **_who(exchange),
        "sandbox": exchange.sandbox,
        "claim": exchange.claim,
        **exchange.decision,
        "code": code,
        "reason": _cut(reason) if reason else None,
    }


class Audit:
    """The audit log of one broker, written to ``writer``."""

    def __init__(self, writer: LineWriter) -> None:
        self.writer = writer

    def record(self, exchange: Exchange, counts: Counts, duration: float) -> None:
        line = audit_record(exchange, counts)
        if line is not None:
            self.writer.write(line)
