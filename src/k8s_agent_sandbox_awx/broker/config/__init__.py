"""The broker's configuration file (TOML): its schema, loading with every rule, rendering.

``load_config(path)`` returns a :class:`BrokerConfig` or raises :class:`BrokerConfigError`
listing every problem; ``render_config(config)`` is what ``agent-sandbox-awx broker check``
prints. The keys and rules: docs/broker/configuration.md.
"""

from ._errors import BrokerConfigError, Problem
from ._load import load_config
from ._render import render_config
from ._schema import (
    ALGORITHMS,
    AUDIT_STREAMS,
    CALLER_NAMESPACE,
    LOG_FORMATS,
    PROTOCOLS,
    PROVIDERS,
    AuditSettings,
    BackendConfig,
    BrokerConfig,
    IssuerConfig,
    KubernetesBackendConfig,
    LocalBackendConfig,
    LoggingSettings,
    MetricsSettings,
    PolicyConfig,
    ServerSettings,
)

__all__ = [
    "ALGORITHMS",
    "AUDIT_STREAMS",
    "CALLER_NAMESPACE",
    "LOG_FORMATS",
    "PROTOCOLS",
    "PROVIDERS",
    "AuditSettings",
    "BackendConfig",
    "BrokerConfig",
    "BrokerConfigError",
    "IssuerConfig",
    "KubernetesBackendConfig",
    "LocalBackendConfig",
    "LoggingSettings",
    "MetricsSettings",
    "PolicyConfig",
    "Problem",
    "ServerSettings",
    "load_config",
    "render_config",
]
