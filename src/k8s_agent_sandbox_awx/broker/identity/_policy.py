"""Verified callers and the per-provider policy the local broker applies."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._ports import DEFAULT_PORTS, PortRanges, parse_ports

RESERVED_PREFIX = "broker.agent-sandbox-awx.io/"
"""Metadata keys under this prefix are the broker's attribution stamps; clients cannot set them."""

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

SCOPES = ("commands", "files")
"""The data-plane action scopes of the local broker: ``commands`` (``POST /execute``, the
managed ``commands`` endpoints and ``run_code``'s ``code/``) and ``files`` (``/upload``,
``/download``, ``/list``,
``/exists`` and the ``fs/`` endpoints). A ``/rpc`` create may request a subset; see
docs/local-broker.md."""


_SCOPE_ROUTES = {
    **dict.fromkeys(("execute", "commands", "code"), "commands"),
    **dict.fromkeys(("upload", "download", "list", "exists", "fs"), "files"),
}


def required_scope(path: str) -> str | None:
    """The scope a data-plane request to ``path`` needs (``None``: none, e.g. ``GET /``).

    Decided by the path's first segment, ignoring case (a server that routes without case
    still needs the scope). ``path`` is the broker's checked target (see ``_target``): in
    normal form, so no dot segment, encoding or ``//`` can make it another route downstream."""
    first = path[1:].partition("/")[0]
    return _SCOPE_ROUTES.get(first.lower())


@dataclass(frozen=True)
class Caller:
    """A caller as the broker verified it from its token."""

    provider: str
    issuer: str
    subject: str
    audience: str
    expires_at: int
    attributes: Mapping[str, Any] = field(default_factory=dict)
    claims: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The verified token's claims (what policy rules match on; never shown or stamped)."""

    @property
    def key(self) -> tuple[str, str]:
        """The identity that owns sandboxes: (issuer, subject)."""
        return (self.issuer, self.subject)


NamespaceRule = str | Callable[[Caller], str]


def caller_namespace(caller: Caller) -> str:
    """Namespace rule: the caller's own namespace (the ``namespace`` attribute, Kubernetes)."""
    namespace = caller.attributes.get("namespace")
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(
            f"caller {caller.subject!r} has no 'namespace' attribute for the caller-namespace rule"
        )
    return namespace


@dataclass(frozen=True)
class Policy:
    """What one provider's callers may do.

    - ``templates``: the templates they may use; ``default_template`` (default: the first) is
      used when a create names none.
    - ``namespace``: the namespace their sandboxes go to: a fixed name, or a callable of the
      :class:`Caller` (for example :func:`caller_namespace`, the Kubernetes default).
    - ``max_sandboxes``: live sandboxes per caller (more is ``429 quota_exceeded``).
    - ``max_lifetime_seconds``: the lifetime cap (and the lifetime of a create that asks for
      none). A create over it is refused, unless the lifetime is marked as the client's
      default (``Prefer: clamp-lifetime``, the SDK's 300 s): that one is cut at the cap.
    - ``scopes``: the data-plane action scopes (:data:`SCOPES`) its callers may be granted. A
      ``/rpc`` create that requests scopes gets ``allowed ∩ requested`` (``403`` when that is
      empty); without a request, and for every ``/v1`` sandbox, it gets all of them.
    - ``ports``: the ports of their sandboxes they may reach through the broker (ports and
      ``"LOW-HIGH"`` ranges, :mod:`..dataplane._ports`; default every unprivileged port, ``()``
      none). A port request also needs the ``commands`` scope (docs/broker-api.md, "Ports").
    - ``network``: its callers' sandboxes may use the network (default ``True``). ``False``:
      local sandboxes get a network of their own (loopback only; it needs isolated sandboxes,
      bubblewrap: without it they fail to start, ``NetworkNotIsolated``); the Kubernetes
      backend leaves the network to the cluster's NetworkPolicies.
    """

    templates: tuple[str, ...] = ("python",)
    default_template: str | None = None
    namespace: NamespaceRule = "default"
    max_sandboxes: int = 5
    max_lifetime_seconds: int = 3600
    scopes: tuple[str, ...] = SCOPES
    ports: tuple[int | str, ...] = DEFAULT_PORTS
    network: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "ports", tuple(self.port_ranges.describe()))
        if not self.templates:
            raise ValueError("Policy.templates must name at least one template")
        if self.default_template is not None and self.default_template not in self.templates:
            raise ValueError(
                f"Policy.default_template {self.default_template!r} is not in "
                f"templates {list(self.templates)!r}"
            )
        if self.max_sandboxes < 0 or self.max_lifetime_seconds <= 0:
            raise ValueError("Policy.max_sandboxes must be >= 0 and max_lifetime_seconds > 0")
        unknown = [s for s in self.scopes if s not in SCOPES]
        if unknown:
            raise ValueError(
                f"Policy.scopes {unknown!r} are not scopes of the local broker; use a subset "
                f"of {list(SCOPES)}"
            )
        if not isinstance(self.network, bool):
            raise ValueError(f"Policy.network must be True or False, not {self.network!r}")
        if isinstance(self.namespace, str) and not _DNS_LABEL.match(self.namespace):
            raise ValueError(f"Policy.namespace {self.namespace!r} is not a DNS-1123 label")

    @property
    def port_ranges(self) -> PortRanges:
        """``ports`` parsed (a ``ValueError`` naming the entry and the rule)."""
        return parse_ports(self.ports)

    @property
    def effective_default_template(self) -> str:
        return self.default_template or self.templates[0]

    def namespace_for(self, caller: Caller) -> str:
        if isinstance(self.namespace, str):
            return self.namespace
        return self.namespace(caller)

    def describe(self, caller: Caller) -> dict[str, Any]:
        """The policy as ``GET /v1/whoami`` returns it."""
        return {
            "templates": list(self.templates),
            "default_template": self.effective_default_template,
            "namespace": self.namespace_for(caller),
            "max_sandboxes": self.max_sandboxes,
            "max_lifetime_seconds": self.max_lifetime_seconds,
            "ports": self.port_ranges.describe(),
        }
