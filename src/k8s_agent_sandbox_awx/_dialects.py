"""The registry of broker dialects (adding one is one module plus one line here), and finding
out which one a broker speaks when none is pinned.

Detection is one unauthenticated ``GET /v1/healthz``: a 2xx answer is ``v1``, any other answer
below 500 (``404`` from a broker that serves only ``/rpc``) is ``rpc``, but ``408`` and ``429``
(busy: retried or raised, never remembered). The result is remembered
per broker URL for the life of the process (a thread-safe map); one probe per broker runs at a
time (:func:`probe_lock` for threads; the async client holds an ``asyncio.Lock`` per event loop
and broker), and the callers that waited find the answer remembered, so each broker costs one
extra round trip per process.
"""

from __future__ import annotations

import threading

from ._dialect import Dialect
from ._dialect_rpc import RpcDialect
from ._dialect_v1 import V1Dialect
from ._protocol import Call, Reply, RequestSpec
from .errors import ConfigurationError

__all__ = [
    "DEFAULT",
    "DIALECTS",
    "detected",
    "forget_detected",
    "get_dialect",
    "probe",
    "probe_lock",
    "remember",
]

DIALECTS: dict[str, Dialect] = {
    V1Dialect.name: V1Dialect(),
    RpcDialect.name: RpcDialect(),
}
DEFAULT = V1Dialect.name

_DETECTED: dict[str, str] = {}
_PROBE_LOCKS: dict[str, threading.Lock] = {}
_LOCK = threading.Lock()


def get_dialect(name: str | None = None) -> Dialect:
    """The dialect called ``name`` (default: v1)."""
    dialect = DIALECTS.get((name or DEFAULT).strip().lower())
    if dialect is None:
        raise ConfigurationError(
            f"Unknown broker protocol {name!r} (broker_protocol= or "
            f"AGENT_SANDBOX_BROKER_PROTOCOL); use one of {', '.join(sorted(DIALECTS))}, or "
            "leave it unset to find out from the broker."
        )
    return dialect


def detected(broker_url: str) -> Dialect | None:
    """The dialect found out earlier in this process for ``broker_url``, if any."""
    with _LOCK:
        name = _DETECTED.get(broker_url)
    return None if name is None else DIALECTS[name]


def probe_lock(broker_url: str) -> threading.Lock:
    """The lock a thread holds while it probes ``broker_url`` (one probe per broker at a time)."""
    with _LOCK:
        return _PROBE_LOCKS.setdefault(broker_url, threading.Lock())


def remember(broker_url: str, name: str) -> Dialect:
    with _LOCK:
        _DETECTED[broker_url] = name
    return DIALECTS[name]


def forget_detected() -> None:
    """Forget every detected dialect (tests)."""
    with _LOCK:
        _DETECTED.clear()


def _dialect_of(reply: Reply) -> str:
    return V1Dialect.name if reply.status_code < 300 else RpcDialect.name


def probe() -> Call[str]:
    """The detection request: which dialect the broker's answer means."""
    what = "find out which protocol the broker speaks"
    spec = RequestSpec("GET", "/v1/healthz", what, retryable=True, probe=True)
    return Call(spec, _dialect_of)
