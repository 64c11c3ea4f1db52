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
    CALLER_NAMESPACE,
    PROTOCOLS,
    PROVIDERS,
    BackendConfig,
    BrokerConfig,
    IssuerConfig,
    KubernetesBackendConfig,
    LocalBackendConfig,
    PolicyConfig,
    ServerSettings,
)

__all__ = [
    "ALGORITHMS",
    "CALLER_NAMESPACE",
    "PROTOCOLS",
    "PROVIDERS",
    "BackendConfig",
    "BrokerConfig",
    "BrokerConfigError",
    "IssuerConfig",
    "KubernetesBackendConfig",
    "LocalBackendConfig",
    "PolicyConfig",
    "Problem",
    "ServerSettings",
    "load_config",
    "render_config",
]
