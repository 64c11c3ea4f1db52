"""The registry of broker dialects (adding one is one module plus one line here), and finding
out which one a broker speaks when none is pinned.

Detection is one unauthenticated ``GET /v1/healthz``. Only an answer that identifies a dialect
is remembered (per broker URL, for the life of the process, in a thread-safe map): the v1
broker's health answer, ``2xx`` with the JSON ``{"api_version": "v1"}``. An answer that does
not decide is a guess for the client that probed, never remembered: another ``2xx`` is ``v1``,
any other answer below ``500`` (``404`` from a broker that serves only ``/rpc``, but also a
proxy's ``403`` or a ``404`` while the broker's route is not there yet) is ``rpc``; the guess
is remembered once a control-plane answer of that dialect confirms it
(:meth:`BrokerDialect.confirm`: a ``2xx`` that parses), so a transient answer costs at most
the next client one more probe. A ``3xx`` is an error (never followed, never a dialect);
``408``/``429`` (busy) are retried or raised; a ``5xx`` is retried, then raised. One probe per
broker runs at a time (:func:`probe_lock`: one ``threading.Lock`` per broker for threads, one
``asyncio.Lock`` per event loop and broker for tasks, both kept here); the callers that waited
take its answer (:func:`answered_since`), so concurrent first uses cost one extra round trip,
however many there are.

What this module remembers is the process's; the dialect one client speaks is its
:class:`BrokerDialect`, the one owner of it (shared by the client and its transport).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from ..._driver import Steps
from ...errors import ConfigurationError
from ._dialect import Dialect
from ._dialect_rpc import RpcDialect
from ._dialect_v1 import V1Dialect
from ._protocol import Call, Reply, RequestSpec

L = TypeVar("L")
logger = logging.getLogger("k8s_agent_sandbox_awx.client")

__all__ = [
    "DEFAULT",
    "DIALECTS",
    "BrokerDialect",
    "Verdict",
    "answered_since",
    "detected",
    "forget_detected",
    "get_dialect",
    "probe",
    "probe_lock",
    "probes_answered",
    "record",
    "remember",
]

DIALECTS: dict[str, Dialect] = {
    V1Dialect.name: V1Dialect(),
    RpcDialect.name: RpcDialect(),
}
DEFAULT = V1Dialect.name

_DETECTED: dict[str, str] = {}
_ANSWERED: dict[str, tuple[int, str]] = {}
"""Per broker URL: how many probes were answered, and the dialect the latest one said (a
guess or not), for the callers that waited for it."""
_PROBE_LOCKS: weakref.WeakKeyDictionary[object, dict[str, Any]] = weakref.WeakKeyDictionary()
"""Per owner (:data:`_THREADS`, or an event loop) and broker URL: the lock of its probes."""
_LOCK = threading.Lock()


class _Threads:
    """The owner of the threads' probe locks (one per broker URL for the whole process)."""


_THREADS = _Threads()


@dataclass(frozen=True)
class Verdict:
    """What one answer to the probe says: the dialect to speak, and whether the answer
    identifies it (``certain``: remembered for the process) or is a guess (this client only,
    until a control-plane answer confirms it)."""

    name: str
    certain: bool


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


@overload
def probe_lock(broker_url: str) -> threading.Lock: ...
@overload
def probe_lock(broker_url: str, loop: object, make: Callable[[], L]) -> L: ...
def probe_lock(
    broker_url: str, loop: object | None = None, make: Callable[[], Any] = threading.Lock
) -> Any:
    """The lock held while ``broker_url`` is probed (one probe per broker at a time): a
    thread's (``threading.Lock``, shared by every thread), or with ``loop`` and ``make`` a
    task's (``asyncio.get_running_loop()``, ``asyncio.Lock``: shared by the tasks of that
    loop, forgotten with it)."""
    with _LOCK:
        locks = _PROBE_LOCKS.setdefault(_THREADS if loop is None else loop, {})
        lock = locks.get(broker_url)
        if lock is None:
            lock = locks[broker_url] = make()
    return lock


def probes_answered(broker_url: str) -> int:
    """How many probes of ``broker_url`` were answered so far (read before waiting for the
    probe lock; see :func:`answered_since`)."""
    with _LOCK:
        return _ANSWERED.get(broker_url, (0, ""))[0]


def answered_since(broker_url: str, seen: int) -> Dialect | None:
    """The dialect the latest probe of ``broker_url`` said, if one was answered after
    :func:`probes_answered` was ``seen`` (a caller that waited while another probed takes its
    answer, a guess included, instead of sending its own)."""
    with _LOCK:
        count, name = _ANSWERED.get(broker_url, (0, ""))
    return DIALECTS[name] if count > seen else None


def record(broker_url: str, verdict: Verdict) -> Dialect:
    """Record a probe's answer; remembered for the process only if it is ``certain``."""
    with _LOCK:
        _ANSWERED[broker_url] = (_ANSWERED.get(broker_url, (0, ""))[0] + 1, verdict.name)
        if verdict.certain:
            _DETECTED[broker_url] = verdict.name
    return DIALECTS[verdict.name]


def remember(broker_url: str, name: str) -> Dialect:
    """Remember that ``broker_url`` speaks ``name`` (an answer identified it)."""
    with _LOCK:
        _DETECTED[broker_url] = name
    return DIALECTS[name]


def forget_detected() -> None:
    """Forget every detected dialect (tests)."""
    with _LOCK:
        _DETECTED.clear()
        _ANSWERED.clear()


def _is_v1_health(content: bytes) -> bool:
    """Whether a body is the v1 broker's health answer (``{"api_version": "v1", ...}``)."""
    try:
        obj = json.loads(content)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("api_version") == V1Dialect.name


def _verdict(reply: Reply) -> Verdict:
    """A ``2xx``: v1 (certain if it is the v1 health answer); any other answer that reaches
    here (``4xx`` but busy; a ``3xx`` and a ``5xx`` are errors of the exchange): a guess of
    ``rpc``."""
    if reply.status_code < 300:
        return Verdict(V1Dialect.name, _is_v1_health(reply.content))
    return Verdict(RpcDialect.name, False)


def probe() -> Call[Verdict]:
    """The detection request: which dialect the broker's answer means."""
    what = "find out which protocol the broker speaks"
    spec = RequestSpec("GET", "/v1/healthz", what, retryable=True, probe=True)
    return Call(spec, _verdict)


class BrokerDialect:
    """The dialect one client speaks with its broker: pinned (``broker_protocol``), remembered
    for the broker URL, or found out by :meth:`resolve` (a guess until :meth:`confirm`). The
    one owner of that choice, shared by the client (which builds the requests) and its
    transport (which maps their answers)."""

    def __init__(self, broker_url: str, pinned: str | None = None) -> None:
        self.broker_url = broker_url
        self.known: Dialect | None = get_dialect(pinned) if pinned else detected(broker_url)
        """``None`` until the broker was asked (the requests are then the default's, v1)."""
        self.guess = False
        """The dialect is a guess from the probe: the first control-plane answer of it that
        parses confirms it (then remembered for the broker URL)."""

    @property
    def current(self) -> Dialect:
        """The dialect spoken: the known one, else (not asked yet) the default, v1."""
        return self.known or get_dialect()

    def resolve(self, seen: int) -> Steps[Call[Any], Dialect]:
        """The dialect to speak: the answer of a probe another caller made meanwhile (one
        answered since :func:`probes_answered` was ``seen``), else the one remembered for the
        broker URL, else one probe (remembered only if its answer identifies the dialect)."""
        url = self.broker_url
        known = answered_since(url, seen) or detected(url)
        if known is None:
            verdict = yield probe()
            known = record(url, verdict)
            how = "" if verdict.certain else " (a guess until a control-plane answer confirms it)"
            logger.info("the broker %s speaks the %r dialect%s", url, known.name, how)
        self.guess = detected(url) is None
        self.known = known
        return known

    def confirm(self, spec: RequestSpec, status: int) -> None:
        """A control-plane answer of the guessed dialect parsed: the broker speaks it."""
        if self.guess and status < 300 and not (spec.probe or spec.data_plane):
            self.guess = False
            remember(self.broker_url, self.current.name)

    def note(self, spec: RequestSpec, exc: Exception) -> None:
        """A ``404``/``405`` under a guessed dialect: the guess may be wrong; say how to pin."""
        status = getattr(exc, "status_code", None)
        if self.guess and status in (404, 405) and not (spec.probe or spec.data_plane):
            exc.add_note(
                f"The broker's dialect ({self.current.name!r}) was guessed from its answer to "
                "GET /v1/healthz, which was not the v1 broker's health answer; if the broker "
                "speaks the other dialect (v1 or rpc), set AGENT_SANDBOX_BROKER_PROTOCOL (or "
                "broker_protocol=) to it."
            )
