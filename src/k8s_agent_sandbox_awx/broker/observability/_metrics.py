"""The broker's Prometheus metrics (``prometheus-client``, the ``[broker]`` extra).

Each broker has its own registry (never the process-wide default), so that several brokers in
one process keep their counts apart. Every label value comes from a small fixed set: route
templates, methods, status codes (a forwarded answer's by its class: a sandbox chooses it), the
broker's error and reason codes, configured issuer names, namespaces (at most
:data:`MAX_NAMESPACES`); never a subject, a sandbox name, a path or anything a caller or a
sandbox chose freely. The
metrics and their labels are listed in docs/broker/operate.md.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from ..common._observed import Exchange
from ..common._route_names import action_of, method_label
from ._access import Counts, Receive, Scope, Send
from ._audit import outcome_of
from ._lines import LineWriter

__all__ = ["PREFIX", "Metrics"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.observability")

PREFIX: Final = "agent_sandbox_broker_"
LATENCY_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
"""Seconds; a stream (an event stream, a watch) counts its whole duration, hence the long end."""

MAX_NAMESPACES: Final = 1000
"""Distinct namespace label values one broker writes; later ones are ``other``."""

_CODE: Final = re.compile(r"[a-z][a-z0-9_]{0,39}")
_NAMESPACE: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _code(value: str | None) -> str:
    """A broker code as a label (``""``: none; anything unexpected: ``other``)."""
    if not value:
        return ""
    return value if _CODE.fullmatch(value) else "other"


def _status(exchange: Exchange, status: int) -> str:
    """A status as a label: the broker's own answers' exactly (a bounded set: the control
    plane's, the broker's errors, ``101`` for a WebSocket it accepted, ``0`` for no answer); an
    answer a sandbox chose (a forwarded one) by its class, ``2xx`` to ``5xx`` (``other`` past
    them): a sandbox's server answers any status, and each would be a series."""
    if exchange.plane != "data" or exchange.error is not None or status in (0, 101):
        return str(status)
    return f"{status // 100}xx" if 100 <= status <= 599 else "other"


class _Namespaces:
    """Namespace label values: DNS labels as they are, at most :data:`MAX_NAMESPACES` of them
    per broker (each namespace the policies placed a claim in, or the caller's own with
    ``{caller.namespace}``); anything else, and any namespace past that many, ``other``."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: Any) -> str:
        if not isinstance(value, str) or not value:
            return ""
        if not _NAMESPACE.fullmatch(value):
            return "other"
        with self._lock:
            if value not in self._seen and len(self._seen) >= MAX_NAMESPACES:
                return "other"
            self._seen.add(value)
        return value


MAX_CHILDREN: Final = 10_000
"""Label sets whose series :class:`_Children` keeps at hand (each label comes from a small
set: a broker sees far fewer); past them a series is looked up by ``labels`` every time."""


class _Children:
    """``metric.labels(*values)``, each series looked up once: ``labels`` checks and joins the
    values and takes the metric's lock at every call, for the same few series. The series are
    the metric's own (the same objects ``labels`` returns: what is counted does not change);
    at most :data:`MAX_CHILDREN` kept. A race makes ``labels`` run twice, never two series."""

    def __init__(self) -> None:
        self._series: dict[tuple[Any, ...], Any] = {}

    def __call__(self, metric: Any, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._series.get(key)
        if child is None:
            child = metric.labels(*values)
            if len(self._series) < MAX_CHILDREN:
                self._series[key] = child
        return child


class _State(Collector):
    """What is read at scrape time: the issuers' key-set counters, the upstreams' readiness
    (``backend.upstream_ready()``, where the backend has upstreams), the live sandboxes per
    namespace (``backend.active_by_namespace()``), lines the logs could not write."""

    def __init__(
        self,
        verifier: Any,
        backend: Any,
        writers: Mapping[str, LineWriter],
        namespaces: _Namespaces,
    ) -> None:
        self.verifier = verifier
        self.backend = backend
        self.writers = writers
        self.namespaces = namespaces

    def collect(self) -> Iterable[Metric]:
        yield from self._issuers()
        upstreams = getattr(self.backend, "upstream_ready", None)
        if upstreams is not None:  # the Kubernetes backend's API server and router
            ready = GaugeMetricFamily(
                PREFIX + "upstream_ready",
                "1 when the upstream (kubernetes: the API server; router) serves, else 0",
                labels=["upstream"],
            )
            for name, up in sorted(upstreams().items()):
                ready.add_metric([name], 1 if up else 0)
            yield ready
        if self.backend is not None:
            active = GaugeMetricFamily(
                PREFIX + "active_sandboxes",
                "Live sandboxes (Pending or Ready), all owners, by namespace",
                labels=["namespace"],
            )
            counts: dict[str, int] = {}
            for namespace, count in self.backend.active_by_namespace().items():
                label = self.namespaces(namespace)
                counts[label] = counts.get(label, 0) + count
            for label, count in sorted(counts.items()):
                active.add_metric([label], count)
            yield active
        lost = CounterMetricFamily(
            PREFIX + "log_write_failures",
            "Access or audit lines that could not be written",
            labels=["log"],
        )
        for name, writer in self.writers.items():
            lost.add_metric([name], writer.failures)
        yield lost

    def _issuers(self) -> Iterable[Metric]:
        if self.verifier is None:
            return
        families = {
            name: CounterMetricFamily(PREFIX + metric, text, labels=["issuer"])
            for name, metric, text in (
                ("refreshes", "jwks_refreshes", "Successful JWKS fetches, by issuer"),
                ("failures", "jwks_refresh_failures", "Failed JWKS fetches, by issuer"),
                ("kid_refetches", "jwks_kid_refetches", "JWKS fetches for an unknown kid"),
                ("rate_limited", "jwks_rate_limited", "Unknown kids that waited for a refetch"),
                ("reviews", "tokenreviews", "TokenReview requests sent, by issuer"),
                ("review_failures", "tokenreview_failures", "Failed TokenReview requests"),
            )
        }
        ready = GaugeMetricFamily(
            PREFIX + "issuer_ready",
            "1 when the issuer's keys are loaded (or its API server answered), else 0",
            labels=["issuer", "verification"],
        )
        for issuer, counters in sorted(self.verifier.counters().items()):
            review = counters["verification"] == "tokenreview"
            ready.add_metric([issuer, counters["verification"]], 1 if counters["ready"] else 0)
            for name, value in counters.items():
                key = "review_failures" if review and name == "failures" else name
                if key in families and isinstance(value, int) and not isinstance(value, bool):
                    families[key].add_metric([issuer], value)
        yield ready
        yield from families.values()


class Metrics:
    """The metrics of one broker: ``record`` each finished request; ``verifier`` and
    ``backend`` (either may be ``None``) are read at scrape time; ``writers``: the logs whose
    write failures are counted, by name."""

    def __init__(
        self,
        *,
        verifier: Any = None,
        backend: Any = None,
        writers: Mapping[str, LineWriter] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "Requests, by route template, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            PREFIX + "request_duration_seconds",
            "Request duration until the answer's last byte, by route template",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.endings = Counter(
            PREFIX + "request_endings",
            "How answers ended (complete, client_gone, upstream_broke, error, incomplete)",
            ["end"],
            registry=r,
        )
        self.verification_failures = Counter(
            PREFIX + "token_verification_failures",
            "Refused tokens, by reason code",
            ["reason"],
            registry=r,
        )
        self.created = Counter(
            PREFIX + "claims_created",
            "Create decisions, by namespace and outcome",
            ["namespace", "outcome"],
            registry=r,
        )
        self.deleted = Counter(
            PREFIX + "claims_deleted",
            "Delete decisions, by namespace and outcome",
            ["namespace", "outcome"],
            registry=r,
        )
        self.refusals = Counter(
            PREFIX + "refusals",
            "Requests refused by policy, quota or ownership, by action and the broker's code",
            ["action", "code"],
            registry=r,
        )
        self.data_bytes = Counter(
            PREFIX + "data_plane_bytes",
            "Data-plane body bytes, in (from callers) and out",
            ["direction"],
            registry=r,
        )
        self._namespace, self._children = _Namespaces(), _Children()
        r.register(_State(verifier, backend, writers or {}, self._namespace))

    def record(self, exchange: Exchange, counts: Counts, duration: float) -> None:
        route, status = exchange.route, counts.status
        label = self._children
        label(self.requests, route, method_label(exchange.method), _status(exchange, status)).inc()
        label(self.latency, route).observe(duration)
        label(self.endings, counts.ending()).inc()
        if exchange.rejection is not None:
            label(self.verification_failures, _code(exchange.rejection.code)).inc()
        if exchange.plane == "data":
            label(self.data_bytes, "in").inc(counts.bytes_in)
            label(self.data_bytes, "out").inc(counts.bytes_out)
        action = action_of(exchange.method, route)
        namespace = self._namespace(exchange.decision.get("namespace"))
        if action == "create" and exchange.rejection is None:
            self.created.labels(namespace, outcome_of(action, exchange, status)).inc()
        elif action == "delete" and exchange.rejection is None:
            self.deleted.labels(namespace, outcome_of(action, exchange, status)).inc()
        if status in (403, 429) and exchange.error is not None:
            self.refusals.labels(action or "access", _code(exchange.error[0])).inc()

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format, as now."""
        return generate_latest(self.registry)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """An ASGI app: ``GET /metrics`` (and ``HEAD``); any other path 404, method 405."""
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            status, body, ctype = 404, b"not found: the metrics are at /metrics\n", "text/plain"
        elif scope["method"] not in ("GET", "HEAD"):
            status, body, ctype = 405, b"use GET /metrics\n", "text/plain"
        else:
            status, body, ctype = 200, self.exposition(), CONTENT_TYPE_LATEST
        headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )
