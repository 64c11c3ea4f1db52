"""The facts of one observed request, and the hooks the broker's parts report them through.

The observing layer (:mod:`.observability._access`) opens an :class:`Exchange` for each
request in a context variable; the gate, the front-ends and the shared claims logic add what
they know (who the caller is, the route, the sandbox, a refusal, a decision) by calling the
``note_*`` functions, which do nothing when no request is observed. The layer then writes the
access line, the audit line and the metrics from the one record. Nothing here holds a token:
the gate notes a token's fingerprint (a SHA-256 digest), never the token. This module sits
beside the parts that call it (not in ``observability/``), so that they import nothing of the
layer above them.
"""

from __future__ import annotations

import contextvars
import hashlib
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..identity._policy import Caller

__all__ = [
    "Exchange",
    "current",
    "fingerprint",
    "note_caller",
    "note_decision",
    "note_error",
    "note_rejection",
    "note_route",
    "note_sandbox",
]


@dataclass
class Rejection:
    """A refused token: its reason ``code`` and ``detail`` (the 401's), the ``(issuer,
    subject)`` it proved only if its signature verified (else ``None``), its fingerprint."""

    code: str
    detail: str
    identity: tuple[str, str] | None
    fingerprint: str | None


@dataclass
class Exchange:
    """One request as the observing layer follows it (mutated by the hooks, on the event loop)."""

    request_id: str
    method: str
    plane: str = ""
    """``v1``, ``rpc``, ``data``, ``issuer``, ``metrics`` or ``""`` (no route)."""
    route: str = "unmatched"
    """The route template (never the raw path): ``/v1/sandboxes/{name}``, ``/rpc op=create``."""
    started: float = field(default_factory=time.perf_counter)
    caller: Caller | None = None
    fingerprint: str | None = None
    """The presented token's fingerprint (``sha256:<hex>``) when it has a JWT's shape."""
    rejection: Rejection | None = None
    sandbox: str | None = None
    claim: str | None = None
    port: int | None = None
    """A port request's port (``X-Sandbox-Port``, not the runtime's), else ``None``."""
    error: tuple[str, str] | None = None
    """The broker's own error answer: ``(code, detail)`` (never a forwarded one's)."""
    decision: dict[str, Any] = field(default_factory=dict)
    """What the claims logic decided and on what (namespace, pool, lifetime, quota...)."""


_JWT_SHAPE = re.compile(r"eyJ[A-Za-z0-9_-]*\.eyJ[A-Za-z0-9_-]*\.[A-Za-z0-9_-]{16,}")


def fingerprint(authorization: str | None) -> str | None:
    """``sha256:<hex>`` of the bearer token in ``authorization`` when it has a JWT's shape
    (three base64url segments, the first two JSON objects, a signature of 16 characters or
    more), the form the broker's revocation list keys tokens by.

    Safe to log: a JWT carries a signature's entropy, so its digest can neither be reversed
    nor replayed as a credential; it only lets an operator who holds a token find its lines.
    Anything else (a password pasted by mistake, a truncated token) gets no fingerprint: the
    digest of a low-entropy secret could be guessed."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not _JWT_SHAPE.fullmatch(token):
        return None
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


_CURRENT: contextvars.ContextVar[Exchange | None] = contextvars.ContextVar(
    "k8s_agent_sandbox_awx_exchange", default=None
)


def current() -> Exchange | None:
    """The request being observed (``None``: none, e.g. the local broker without the layer)."""
    return _CURRENT.get()


def open_exchange(exchange: Exchange) -> contextvars.Token[Exchange | None]:
    return _CURRENT.set(exchange)


def close_exchange(token: contextvars.Token[Exchange | None]) -> None:
    _CURRENT.reset(token)


def note_route(route: str, plane: str | None = None) -> None:
    """The request's route template (a bounded set of names, never the raw path)."""
    exchange = _CURRENT.get()
    if exchange is not None:
        exchange.route = route
        if plane is not None:
            exchange.plane = plane


def note_caller(caller: Caller, authorization: str | None) -> None:
    """The gate verified ``caller`` from the token in ``authorization`` (only its
    :func:`fingerprint` is kept)."""
    exchange = _CURRENT.get()
    if exchange is not None:
        exchange.caller = caller
        exchange.fingerprint = fingerprint(authorization)


def note_rejection(
    code: str, detail: str, identity: tuple[str, str] | None, authorization: str | None
) -> None:
    """The gate refused the token in ``authorization`` (``identity``: only what a verified
    signature proved; of the token only its :func:`fingerprint` is kept)."""
    exchange = _CURRENT.get()
    if exchange is not None:
        exchange.fingerprint = fingerprint(authorization)
        exchange.rejection = Rejection(code, detail, identity, exchange.fingerprint)


def note_sandbox(name: str | None = None, *, claim: str | None = None) -> None:
    """The sandbox (and the ``/rpc`` claim) the request is about."""
    exchange = _CURRENT.get()
    if exchange is not None:
        if name is not None:
            exchange.sandbox = name
        if claim is not None:
            exchange.claim = claim


def note_error(code: str, detail: str) -> None:
    """The broker answers the request with its own error ``code`` (``detail``: the why, as the
    logs may have it: ``ApiError.logged``)."""
    exchange = _CURRENT.get()
    if exchange is not None:
        exchange.error = (code, detail)


def note_decision(**facts: Any) -> None:
    """What a decision was made on (claim, namespace, pool, lifetime; a quota's value and how
    many the caller holds); JSON values only, never a secret."""
    exchange = _CURRENT.get()
    if exchange is not None:
        exchange.decision.update(facts)
