"""``agent-sandbox-awx broker check`` and ``broker serve`` (dispatched here by the CLI).

``check`` needs nothing beyond the core (the standard library reads TOML); ``serve`` needs the
``[broker]`` extra, imported only then. Exit codes: 0 (checked / stopped by a signal), 2 (the
configuration or its TLS files cannot be used), 1 (anything else, e.g. the address is taken).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..broker.config import BrokerConfig

PROG = "agent-sandbox-awx"
BROKER_EXTRA = (
    'python3 -m pip install -e ".[broker]" in a clone of the k8s-agent-sandbox-awx repository'
)


def _error(message: str) -> None:
    first, *rest = message.splitlines() or [""]
    print(f"{PROG}: error: {first}", file=sys.stderr)
    for line in rest:
        print(line, file=sys.stderr)  # already indented: one problem per line


def broker_main(command: str, config_path: str) -> int:
    """Run ``broker check`` or ``broker serve`` with the configuration file ``config_path``."""
    from ..broker.config import BrokerConfigError, load_config, render_config

    try:
        config = load_config(config_path)
    except BrokerConfigError as exc:
        _error(str(exc))
        return 2
    if command == "check":
        sys.stdout.write(render_config(config))
        print(f"# {config.path}: OK", file=sys.stderr)
        return 0
    return _serve(config)


def serving_line(url: str, config: BrokerConfig) -> str:
    """What ``broker serve`` prints on standard output once it listens (operate.md quotes it)."""
    policies = len(config.policies)
    return (
        f"{PROG} broker: serving {url} ({config.server.public_url}) for "
        f"{len(config.issuers)} issuer(s), {policies} polic{'y' if policies == 1 else 'ies'}, "
        f"backend {config.backend.kind}; SIGTERM or Ctrl-C stops it"
    )


def _about(config: BrokerConfig) -> dict[str, str]:
    """The facts of the broker's start-up message beside its addresses (none of them secret)."""
    about = {"public_url": config.server.public_url} if config.server.public_url else {}
    return {**about, "backend": config.backend.kind, "config": str(config.path)}


def _serve(config: BrokerConfig) -> int:
    try:
        from ..broker._app_factory import app_factory
        from ..broker.observability._serve import observed
        from ..broker.server import ListenError, TLSFilesError, serve
    except ImportError as exc:
        _error(
            f"`{PROG} broker serve` needs the [broker] extra ({exc.name or exc} could not be "
            f"imported): install it: {BROKER_EXTRA}"
        )
        return 1
    settings = config.server

    def started(url: str) -> None:
        print(serving_line(url, config), flush=True)

    def metrics_started(url: str) -> None:
        print(f"{PROG} broker: metrics at {url}/metrics (plain HTTP)", flush=True)

    try:
        served = observed(app_factory(config), config)
    except OSError as exc:  # the audit file
        _error(f"{config.path}: audit.destination: cannot open it: {exc.strerror or exc}")
        return 2
    try:
        serve(
            served,
            settings,
            on_started=started,
            metrics=config.metrics,
            on_metrics_started=metrics_started,
            log_format=config.logging.format,
            about=_about(config),
        )
    except TLSFilesError as exc:
        _error(f"{config.path}: server.tls_cert_file, server.tls_key_file: {exc}")
        return 2
    except ListenError as exc:
        _error(f"{config.path}: {exc}")
        return 1
    print(f"{PROG} broker: stopped", file=sys.stderr, flush=True)
    return 0
