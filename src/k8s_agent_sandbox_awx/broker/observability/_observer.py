"""An :class:`Observer`: the access log, the audit log and the metrics of one broker, put
around its app."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._app import PROTOCOLS
from ._access import ASGIApp, Observed, Sink
from ._audit import Audit
from ._lines import LineWriter

if TYPE_CHECKING:
    from .._app import BrokerApp
    from ._metrics import Metrics

__all__ = ["Observer"]


class Observer:
    """What one broker's operators see: ``access`` (a line per request; ``None``: none),
    ``audit`` (a line per decision; ``None``: none) and, with ``metrics``, the Prometheus
    metrics (:attr:`metrics`, once :meth:`wrap` made them; they need ``prometheus-client``).

    One observer observes one app: :meth:`wrap` (any ASGI app) or :meth:`wrap_broker` (a
    :class:`~.._app.BrokerApp`, whose verifier and backend the metrics then read)."""

    def __init__(
        self,
        *,
        access: LineWriter | None = None,
        audit: LineWriter | None = None,
        metrics: bool = False,
    ) -> None:
        self.access = access
        self.audit = audit
        self.want_metrics = metrics
        self.metrics: Metrics | None = None
        self._wrapped = False

    def wrap(
        self,
        app: ASGIApp,
        *,
        protocols: tuple[str, ...] = PROTOCOLS,
        verifier: Any = None,
        backend: Any = None,
    ) -> Observed:
        """``app`` observed (``verifier`` and ``backend``: what the metrics read at scrape
        time, ``None``: not shown)."""
        if self._wrapped:
            raise RuntimeError("an Observer observes one app; make one per broker")
        self._wrapped = True
        sinks: list[Sink] = []
        if self.audit is not None:
            sinks.append(Audit(self.audit))
        if self.want_metrics:
            from ._metrics import Metrics  # prometheus-client: only when metrics are wanted

            writers = {n: w for n, w in (("access", self.access), ("audit", self.audit)) if w}
            self.metrics = Metrics(verifier=verifier, backend=backend, writers=writers)
            sinks.append(self.metrics)
        return Observed(app, access=self.access, sinks=tuple(sinks), protocols=protocols)

    def wrap_broker(self, broker: BrokerApp, app: ASGIApp | None = None) -> Observed:
        """``broker`` observed (``app``: what to call instead, a layer around ``broker``)."""
        return self.wrap(
            app or broker,
            protocols=broker.protocols,
            verifier=broker.verifier,
            backend=broker.backend,
        )
