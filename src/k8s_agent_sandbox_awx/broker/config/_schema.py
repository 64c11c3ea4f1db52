"""The broker's configuration as plain, checked values (what ``load_config`` returns).

Every value here passed the rules of ``_load`` (see docs/broker/configuration.md): paths are
absolute (``~`` expanded, relative ones against the configuration file's directory), URLs
checked, defaults filled in. Secrets are never held, only the paths of the files that hold them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

PROVIDERS: Final = ("kubernetes", "gitlab", "github-actions", "google")
"""The providers the broker knows (default attributes, ``{caller.namespace}``); any other name
is allowed too."""

ALGORITHMS: Final = (
    *("RS256", "RS384", "RS512", "PS256", "PS384", "PS512"),
    *("ES256", "ES384", "ES512", "EdDSA"),
)
"""The signature algorithms an issuer may be pinned to: asymmetric only (a JWKS publishes public
keys; ``none`` and ``HS*`` are never accepted)."""

PROTOCOLS: Final = ("v1", "rpc")
"""The control-plane dialects the broker can serve."""

LOG_LEVELS: Final = ("critical", "error", "warning", "info", "debug", "trace")

LOG_FORMATS: Final = ("json", "text")
REQUEST_HEAD_SECONDS: Final = 10.0
"""The default of ``[server] request_head_seconds``."""
WEBSOCKET_MAX_PER_CALLER: Final = 16
"""The default of ``[server] websocket_max_per_caller``."""
WEBSOCKET_MAX_MESSAGE_BYTES: Final = 1024 * 1024
"""The default of ``[server] websocket_max_message_bytes`` (``websockets``' own default)."""
"""``[logging] format``: the access, audit and diagnostic lines as JSON objects or as text."""

AUDIT_STREAMS: Final = ("stdout", "stderr")
"""``[audit] destination``: one of these streams, or a file's path."""

CALLER_NAMESPACE: Final = "{caller.namespace}"
"""The one placeholder of a policy's ``namespace``: the caller's own namespace (its
``namespace`` attribute: a Kubernetes ServiceAccount's namespace)."""

RUNTIME_PLACEHOLDERS: Final = frozenset(
    {"python", "host", "port_file", "port", "base_dir", "name", "namespace", "template"}
)
"""The placeholders a local template's runtime command may use (``DEFAULT_RUNTIME_COMMAND``)."""


@dataclass(frozen=True)
class ServerSettings:
    """``[server]``: where and how the broker listens."""

    host: str
    """The address to listen on (``0.0.0.0``, ``::``, ``127.0.0.1``, a host name)."""
    port: int
    """The port (0: one the system picks, for tests)."""
    public_url: str
    """The URL clients use, in the one normal form (the default token audience)."""
    tls_cert_file: Path
    tls_key_file: Path
    tls_reload_seconds: float = 30.0
    protocols: tuple[str, ...] = PROTOCOLS
    shutdown_grace_seconds: float = 30.0
    keep_alive_seconds: float = 30.0
    """An idle connection (nothing of a request sent: before its first request too) is closed
    after this."""
    request_head_seconds: float = REQUEST_HEAD_SECONDS
    """The TLS handshake, and a request's head from its first byte, must complete within this
    (a begun head is then answered 408)."""
    websocket_max_per_caller: int = WEBSOCKET_MAX_PER_CALLER
    """WebSockets one caller (issuer and subject) holds open through this broker at once; one
    more is refused ``429 websocket_limit``."""
    websocket_max_message_bytes: int = WEBSOCKET_MAX_MESSAGE_BYTES
    """The largest WebSocket message relayed, either way (a larger one closes the WebSocket
    with 1009); what the relay holds per WebSocket is a few messages of this size."""
    log_level: str = "info"
    access_log: bool = True

    @property
    def listen(self) -> str:
        """The listen address as written in the file (``[::]:8443`` for IPv6)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class IssuerConfig:
    """One ``[[issuers]]`` table: an issuer whose tokens the broker accepts."""

    name: str
    url: str
    """Exactly the tokens' ``iss``."""
    provider: str
    audiences: tuple[str, ...]
    algorithms: tuple[str, ...] = ("RS256",)
    clock_skew_seconds: float = 30.0
    discovery: bool = True
    """Find the JWKS through ``{url}/.well-known/openid-configuration`` (else ``jwks_url``)."""
    jwks_url: str | None = None
    jwks_cache_seconds: float = 300.0
    jwks_min_refetch_seconds: float = 30.0
    jwks_max_stale_seconds: float | None = None
    """How long the last good keys are kept while refreshes fail; ``None``: 12 x
    ``jwks_cache_seconds``."""
    ca_file: Path | None = None
    token_file: Path | None = None
    verification: Literal["jwks", "tokenreview"] = "jwks"
    attributes: tuple[str, ...] | None = None
    """Claims kept as caller attributes; ``None``: the provider's default."""


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """One ``[[policies]]`` table: a rule (issuer, subject glob, claims) and what it grants.

    The grants are one field each (``warm_pools`` .. ``scopes``); a new knob (issue 23's
    ``ports``) is one more field here and one more line in ``_load._policy``."""

    name: str
    issuer: str
    """The name of an ``[[issuers]]`` table."""
    subject: str = "*"
    claims: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Claim name (dotted: nested) -> the accepted values (fnmatch globs)."""
    warm_pools: tuple[str, ...]
    """The pools allowed (the v1 ``template``s); the first is the default."""
    namespace: str
    """A namespace, or :data:`CALLER_NAMESPACE`."""
    max_sandboxes: int = 5
    max_lifetime_seconds: int = 3600
    scopes: tuple[str, ...] = ("commands", "files")
    ports: tuple[int | str, ...] = ("1024-65535",)
    """The sandbox ports its callers may reach (ports and ``"LOW-HIGH"`` ranges)."""


@dataclass(frozen=True)
class KubernetesBackendConfig:
    """``[backend.kubernetes]``."""

    connection: Literal["in-cluster", "kubeconfig"] = "in-cluster"
    kubeconfig_file: Path | None = None
    context: str | None = None
    ready_timeout_seconds: float = 180.0
    data_plane: Literal["router", "pod"] = "router"
    router_url: str | None = None
    router_token_file: Path | None = None
    router_ca_file: Path | None = None
    runtime_port: int = 8888
    allow_loopback_pod_ips: bool = False
    router_pod_ip: bool = True
    """Send the claim's pod IP to the router (X-Sandbox-Pod-IP)."""
    pod_label_domains: tuple[str, ...] = ("sandbox.users.io",)
    """agent-sandbox's controller's allowed pod label domains (its allowed-label-domains)."""


@dataclass(frozen=True)
class LocalBackendConfig:
    """``[backend.local]``: host processes, as ``agent-sandbox-awx dev`` runs them."""

    templates: Mapping[str, str | tuple[str, ...]] = field(default_factory=lambda: {"python": ""})
    """Template -> its runtime command (``""``: the built-in runtime)."""


@dataclass(frozen=True)
class BackendConfig:
    """``[backend]``: which backend, and its table (the other one is ``None``)."""

    kind: Literal["kubernetes", "local"]
    kubernetes: KubernetesBackendConfig | None = None
    local: LocalBackendConfig | None = None


@dataclass(frozen=True)
class LoggingSettings:
    """``[logging]``: how the broker's lines are written (docs/broker/operate.md)."""

    format: Literal["json", "text"] = "json"


@dataclass(frozen=True)
class AuditSettings:
    """``[audit]``: where the audit lines go: ``"stdout"`` or ``"stderr"`` (each line has
    ``"log": "audit"``), or a file (absolute; appended to, re-opened when rotated)."""

    destination: str | Path = "stdout"


@dataclass(frozen=True)
class MetricsSettings:
    """``[metrics]``: the Prometheus metrics, served over plain HTTP at ``GET /metrics`` on
    their own listen address (never on the broker's port, which every caller reaches)."""

    host: str
    port: int

    @property
    def listen(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class BrokerConfig:
    """The whole configuration file, checked."""

    path: Path
    """The file it was read from (absolute)."""
    server: ServerSettings
    issuers: tuple[IssuerConfig, ...]
    policies: tuple[PolicyConfig, ...]
    backend: BackendConfig
    logging: LoggingSettings = LoggingSettings()
    audit: AuditSettings = AuditSettings()
    metrics: MetricsSettings | None = None
    """``None``: no ``[metrics]`` table, no metrics listener."""
    defaulted: frozenset[str] = frozenset()
    """The dotted keys the file left out, whose defaults were filled in (shown by
    ``broker check``)."""

    def issuer(self, name: str) -> IssuerConfig:
        """The issuer called ``name`` (every policy's ``issuer`` is one)."""
        for issuer in self.issuers:
            if issuer.name == name:
                return issuer
        raise KeyError(name)
