"""``[logging]``, ``[audit]`` and ``[metrics]``: what the broker's operators see
(docs/broker/operate.md)."""

from __future__ import annotations

import os
from pathlib import Path

from . import _checks
from ._reader import Table, show
from ._schema import AUDIT_STREAMS, LOG_FORMATS, AuditSettings, LoggingSettings, MetricsSettings

__all__ = ["audit", "logging", "metrics"]

_METRICS_LISTEN = "0.0.0.0:9090"


def logging(table: Table | None, root: Table) -> LoggingSettings:
    if table is None:
        root.ctx.defaulted.add("logging.format")
        return LoggingSettings()
    fmt = table.string("format", "json", example='"json"', choices=LOG_FORMATS)
    table.finish()
    return LoggingSettings(format=fmt or "json")


def audit(table: Table | None, root: Table) -> AuditSettings:
    if table is None:
        root.ctx.defaulted.add("audit.destination")
        return AuditSettings()
    example = '"stdout", "stderr" or "/var/log/agent-sandbox-broker/audit.jsonl"'
    raw = table.string("destination", "stdout", example=example)
    table.finish()
    if not raw or raw in AUDIT_STREAMS:
        return AuditSettings(raw or "stdout")
    path = Path(os.path.normpath(table.ctx.base_dir / Path(raw).expanduser()))
    if table.ctx.check_files:
        why = _unwritable(path)
        if why:
            table.problem(
                "destination",
                f"{show(str(path))} {why}",
                "give the path of a file the broker may append to (its directory must exist), "
                'or destination = "stdout"',
            )
    return AuditSettings(path)


def _unwritable(path: Path) -> str | None:
    """Why the broker cannot append to ``path`` (``None``: it can)."""
    if path.is_dir():
        return "is a directory"
    if path.exists():
        return None if os.access(path, os.W_OK) else "is not writable by this process"
    parent = path.parent
    if not parent.is_dir():
        return f"cannot be made: its directory {str(parent)!r} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be made: its directory {str(parent)!r} is not writable by this process"
    return None


def metrics(table: Table | None, server_port: int | None) -> MetricsSettings | None:
    if table is None:
        return None
    host, port = _checks.listen(table, _METRICS_LISTEN)
    table.finish()
    if port and port == server_port:
        table.problem(
            "listen",
            f"port {port} is the broker's own port (server.listen): the metrics are served "
            "apart from the broker's API",
            f'give the metrics a port of their own, e.g. listen = "{_METRICS_LISTEN}"',
        )
    return MetricsSettings(host, port)
