"""The operators' view of ``agent-sandbox-awx broker serve`` over the Kubernetes backend: a
create, a command and a delete through it appear in its access log (by route template, never
a name), its audit log (each decision with the claim's name and namespace) and its /metrics
(the counts, the live sandboxes by namespace). The CLI itself runs, as a process, on the real
API server, with the stand-in controller's pods."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import Sandbox
from tests._support.broker_server import CLI, Pki, Served
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer, free_ports
from tests._support.kube_broker import BrokerIdentity, write_config

pytest.importorskip("prometheus_client", reason="needs the [broker] extra")

from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow


def lines_of(read: Callable[[], list[str]], log: str) -> list[dict[str, Any]]:
    return [
        record
        for line in read()
        if line.startswith("{") and (record := json.loads(line)).get("log") == log
    ]


def until(check: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)
    return value


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    host, _, rest = url.removeprefix("http://").partition(":")
    connection = http.client.HTTPConnection(host, int(rest.split("/")[0]), timeout=10)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.parametrize("protocol", ["v1", "rpc"])
def test_a_create_run_and_delete_in_the_access_and_audit_logs_and_the_metrics(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    python_pool: str,
    identity: BrokerIdentity,
    broker_pki: Pki,
    tmp_path: Path,
    protocol: str,
) -> None:
    [port] = free_ports(1)
    audit_file = tmp_path / "audit.jsonl"
    config = write_config(tmp_path / "broker.toml", identity, broker_pki, port)
    config.write_text(
        config.read_text() + f'\n[logging]\nformat = "json"\n\n[audit]\ndestination = '
        f'"{audit_file}"\n\n[metrics]\nlisten = "127.0.0.1:0"\n'
    )
    server = Served.start([*CLI, "broker", "serve", "--config", str(config)])
    try:
        url = server.wait_started(60)
        metrics_url = until(
            lambda: next((ln for ln in server.stdout if " metrics at http://" in ln), None),
            "metrics line",
        ).split(" metrics at ")[1].split()[0]  # fmt: skip
        token_file = tmp_path / "token"
        kube.create_service_account(namespace, "agent")
        token_file.write_text(kube.token_request(namespace, "agent", url))
        environ = {
            "AGENT_SANDBOX_BROKER_URL": url,
            "AGENT_SANDBOX_CA_BUNDLE": str(broker_pki.cert_file.parent / "ca.pem"),
            "AGENT_SANDBOX_TOKEN_FILE": str(token_file),
            "AGENT_SANDBOX_BROKER_PROTOCOL": protocol,
        }
        until(lambda: _ready(url, broker_pki), "readiness", 30)
        sandbox = Sandbox.create(environ=environ, timeout=600)
        assert sandbox.commands.run("echo observed").stdout == "observed\n"
        live = scrape(metrics_url)
        sandbox.kill()
        check_audit(audit_file, namespace, sandbox.name, protocol)
        check_access(server, sandbox.name, protocol)
        after = until(
            lambda: (found := scrape(metrics_url)).get(
                ("agent_sandbox_broker_active_sandboxes", frozenset({("namespace", namespace)})),
                0.0,
            ) == 0 and found,
            "no live sandbox in the metrics",
        )  # fmt: skip
        check_metrics(live, after, namespace, protocol)
    finally:
        server.terminate()
        server.wait(30)


def _ready(url: str, pki: Pki) -> bool:
    host, _, port = url.removeprefix("https://").partition(":")
    connection = http.client.HTTPSConnection(host, int(port), context=pki.context(), timeout=5)
    connection.request("GET", "/readyz")
    return connection.getresponse().status == 200


def check_audit(audit_file: Path, namespace: str, name: str, protocol: str) -> None:
    """A create admitted and a delete done, each naming the claim and its namespace."""
    records = until(
        lambda: len(found := [r for r in lines_of(lambda: audit_file.read_text().splitlines(),
                                                  "audit")
                              if r["action"] in ("create", "delete")]) >= 2 and found,
        "the create's and the delete's audit lines",
    )  # fmt: skip
    named = "sandbox" if protocol == "v1" else "claim"
    by_action = {r["action"]: r for r in records}
    create, delete = by_action["create"], by_action["delete"]
    assert (create["outcome"], create[named], create["namespace"]) == ("admitted", name, namespace)
    assert (delete["outcome"], delete[named], delete["namespace"]) == ("deleted", name, namespace)
    assert create["subject"] == f"system:serviceaccount:{namespace}:agent"
    assert create["pool"] == "python" and create["policy"] == "namespace"


def check_access(server: Served, name: str, protocol: str) -> None:
    """One access line per request, by route template: never the claim's name."""
    delete = ("DELETE", "/v1/sandboxes/{name}") if protocol == "v1" else ("POST", "/rpc op=delete")

    def complete() -> list[dict[str, Any]] | None:  # up to the delete's line, the last one
        records = lines_of(lambda: list(server.stdout), "access")
        return records if any((r["method"], r["route"]) == delete for r in records) else None

    records = until(complete, "access lines up to the delete")
    routes = {(r["method"], r["route"], r["status"]) for r in records}
    if protocol == "v1":
        assert ("POST", "/v1/sandboxes", 201) in routes
        assert any(m == "DELETE" and r == "/v1/sandboxes/{name}" for m, r, _ in routes)
    else:
        assert any(m == "POST" and r.startswith("/rpc") for m, r, _ in routes)
    assert ("POST", "{data} /commands", 200) in routes  # the command, through the data plane
    assert all(name not in json.dumps(r["route"]) for r in records)
    assert all(r["end"] == "complete" for r in records)


def check_metrics(
    live: dict[tuple[str, frozenset[tuple[str, str]]], float],
    after: dict[tuple[str, frozenset[tuple[str, str]]], float],
    namespace: str,
    protocol: str,
) -> None:
    """The create and the delete counted by namespace; the live sandbox by namespace."""
    ns = ("namespace", namespace)

    def value(found: Any, name: str, **labels: str) -> float:
        return float(found.get((name, frozenset({*labels.items(), ns})), 0.0))

    created = "agent_sandbox_broker_claims_created_total"
    deleted = "agent_sandbox_broker_claims_deleted_total"
    active = "agent_sandbox_broker_active_sandboxes"
    assert value(live, created, outcome="admitted") == 1
    assert value(live, active) == 1
    assert value(after, deleted, outcome="deleted") == 1
    requests = "agent_sandbox_broker_requests_total"
    create_route = "/v1/sandboxes" if protocol == "v1" else None
    counted = [
        v for (n, labels), v in after.items()
        if n == requests and dict(labels).get("method") == "POST"
        and (create_route is None or dict(labels).get("route") == create_route)
    ]  # fmt: skip
    assert counted and sum(counted) >= 1
