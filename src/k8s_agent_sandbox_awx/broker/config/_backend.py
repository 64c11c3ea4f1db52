"""``[backend]``, ``[backend.kubernetes]`` and ``[backend.local]``."""

from __future__ import annotations

import string
from typing import Any

from . import _checks
from ._reader import Table, show, type_name
from ._schema import (
    RUNTIME_PLACEHOLDERS,
    BackendConfig,
    KubernetesBackendConfig,
    LocalBackendConfig,
)

_KINDS = ("kubernetes", "local")


def backend(table: Table) -> BackendConfig:
    kind: Any = table.string("kind", example='"kubernetes" (or "local")', choices=_KINDS)
    kube = table.table("kubernetes", title="[backend.kubernetes]")
    local = table.table("local", title="[backend.local]")
    table.finish()
    config = BackendConfig(
        kind=kind or "kubernetes",
        kubernetes=_kubernetes(kube) if kube is not None else None,
        local=_local(local) if local is not None else None,
    )
    if not kind:
        return config
    for other, sub in (("kubernetes", kube), ("local", local)):
        if other != kind and sub is not None:
            table.problem(
                other,
                f"[backend.{other}] is only read with kind = {other!r} (kind is {kind!r})",
                f"remove [backend.{other}], or set kind = {other!r}",
            )
    if kind == "kubernetes" and kube is None:
        table.problem(
            "kubernetes",
            'kind = "kubernetes" needs a [backend.kubernetes] table',
            'add [backend.kubernetes] with at least router_url (or data_plane = "pod")',
        )
    if kind == "local" and local is None:
        table.ctx.defaulted.add(table.key("local"))
        return BackendConfig(kind="local", local=LocalBackendConfig())
    return config


def _only_with(table: Table, keys: tuple[str, ...], condition: str) -> None:
    """Keys that mean something only under ``condition`` (``false``, their default, is fine)."""
    for key in keys:
        if table.given(key) and table.data[key] is not False and table.ok(key):
            table.problem(
                key, f"is only used with {condition}", f"remove {key}, or set {condition}"
            )


def _kubernetes(table: Table) -> KubernetesBackendConfig:
    connection: Any = table.string(
        "connection", "in-cluster", example='"in-cluster"', choices=("in-cluster", "kubeconfig")
    )
    data_plane: Any = table.string(
        "data_plane", "router", example='"router"', choices=("router", "pod")
    )
    config = KubernetesBackendConfig(
        connection=connection or "in-cluster",
        kubeconfig_file=table.path("kubeconfig_file", what="kubeconfig file"),
        context=table.string("context", None, example='"my-cluster"'),
        ready_timeout_seconds=table.number("ready_timeout_seconds", 180.0, above=True),
        data_plane=data_plane or "router",
        router_url=_checks.url(
            table,
            "router_url",
            schemes=("http", "https"),
            example='"http://sandbox-router-svc.agent-sandbox-system.svc.cluster.local:8080"',
        ),
        router_token_file=table.path("router_token_file", what="token file"),
        router_ca_file=table.path("router_ca_file", what="CA bundle (PEM)"),
        runtime_port=table.number("runtime_port", 8888, integer=True, minimum=1, maximum=65535),
        allow_loopback_pod_ips=table.boolean("allow_loopback_pod_ips", False),
        router_pod_ip=table.boolean("router_pod_ip", True),
        pod_label_domains=table.strings(
            "pod_label_domains",
            ("sandbox.users.io",),
            example='["sandbox.users.io"] (the controller\'s allowed-label-domains)',
            item=_label_domain,
        ),
    )
    table.finish()
    _kubernetes_rules(table, config)
    return config


def _label_domain(value: str) -> str | None:
    if value != value.lower():
        return "is not in lower case (agent-sandbox's controller lower-cases its domains)"
    return _checks.dns_subdomain(value)


def _kubernetes_rules(table: Table, config: KubernetesBackendConfig) -> None:
    if config.connection == "kubeconfig" and table.ok("connection"):
        if not table.given("kubeconfig_file"):
            table.problem(
                "kubeconfig_file",
                'connection = "kubeconfig" needs kubeconfig_file',
                'add kubeconfig_file = "~/.kube/config"',
            )
    else:
        _only_with(table, ("kubeconfig_file", "context"), 'connection = "kubeconfig"')
    if config.data_plane == "router" and table.ok("data_plane"):
        if not table.given("router_url"):
            table.problem(
                "router_url",
                'data_plane = "router" (the default) needs router_url',
                'add router_url = "http://sandbox-router-svc.agent-sandbox-system.svc.'
                'cluster.local:8080", or set data_plane = "pod"',
            )
        if config.router_url and config.router_url.lower().startswith("http://"):
            _only_with(table, ("router_ca_file",), "an https:// router_url")
    else:
        _only_with(
            table, ("router_url", "router_token_file", "router_ca_file"), 'data_plane = "router"'
        )
        if table.given("router_pod_ip") and table.ok("router_pod_ip"):
            table.problem(
                "router_pod_ip", 'is only used with data_plane = "router"', "remove router_pod_ip"
            )


def _local(table: Table) -> LocalBackendConfig:
    example = '{ python = "" } (template = runtime command, "" = the built-in runtime)'
    raw: dict[str, Any] = table.mapping("templates", {"python": ""}, example=example)
    table.finish()
    templates: dict[str, str | tuple[str, ...]] = {}
    for template, command in raw.items():
        key = f"templates.{_checks.dotted(template)}"
        why = _checks.dns_subdomain(template)
        if why:
            table.problem(key, f"{show(template)} {why}", "name the template like a warm pool")
            continue
        argv = [command] if isinstance(command, str) else command
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            table.problem(
                key,
                f"must be a command line (a string) or an argv (an array of strings), not "
                f"{type_name(command)}",
                f'write {_checks.dotted(template)} = "" for the built-in runtime',
            )
            continue
        wrong = _placeholder_problem(argv)
        if wrong:
            table.problem(key, wrong, f"use only {', '.join(sorted(RUNTIME_PLACEHOLDERS))}")
            continue
        templates[template] = command if isinstance(command, str) else tuple(command)
    if not raw and table.ok("templates"):
        table.problem("templates", "is empty", f"name at least one, e.g. templates = {example}")
    return LocalBackendConfig(templates=templates)


def _placeholder_problem(argv: list[str]) -> str | None:
    for part in argv:
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(part) if f is not None]
        except ValueError as exc:
            return f"has a bad placeholder ({exc}; write a literal brace as {{{{ or }}}})"
        unknown = sorted(set(fields) - RUNTIME_PLACEHOLDERS)
        if unknown:
            return f"has the unknown placeholder {{{unknown[0]}}}"
    return None
