"""The observability of ``agent-sandbox-awx broker serve``, from the configuration:
``[server] access_log`` and ``log_level``, ``[logging] format``, ``[audit] destination`` and
``[metrics] listen`` (docs/broker/operate.md)."""

from __future__ import annotations

from pathlib import Path

from .._app import BrokerApp
from .._app_factory import ConfiguredBroker
from ..config import BrokerConfig
from ..server import ServedApp
from ._lines import FileLines, LineWriter, StreamLines
from ._observer import Observer

__all__ = ["observed", "observer_for"]

_QUIET_LEVELS = ("warning", "error", "critical")
"""Levels at which the access log (its lines are ``info``) is not written."""


def observer_for(config: BrokerConfig) -> Observer:
    """The access log on standard output (unless ``access_log = false`` or the log level is
    above ``info``), the audit log where ``[audit]`` says (always written), the metrics when
    there is a ``[metrics]`` table. Raises ``OSError`` when the audit file cannot be opened."""
    fmt = config.logging.format
    server = config.server
    access = (
        StreamLines("stdout", fmt)
        if server.access_log and server.log_level not in _QUIET_LEVELS
        else None
    )
    destination = config.audit.destination
    audit: LineWriter = (
        FileLines(destination, fmt)
        if isinstance(destination, Path)
        else StreamLines(destination, fmt)
    )
    return Observer(access=access, audit=audit, metrics=config.metrics is not None)


def observed(served: ServedApp, config: BrokerConfig) -> ServedApp:
    """``served`` with the observability of ``config`` around its app (a
    :class:`~.._app.BrokerApp`'s verifier and backend feed the metrics, also of the one a
    :class:`~.._app_factory.ConfiguredBroker` holds), and the metrics app
    for ``[metrics] listen``."""
    observer = observer_for(config)
    app = served.app
    broker = app.app if isinstance(app, ConfiguredBroker) else app  # (its lifespan around it)
    if isinstance(broker, BrokerApp):
        wrapped = observer.wrap_broker(broker, app)
    else:  # e.g. a placeholder app: its requests are still logged
        wrapped = observer.wrap(app, protocols=config.server.protocols)
    metrics = observer.metrics.app if observer.metrics is not None else None
    return ServedApp(wrapped, served.ready, metrics=metrics)
