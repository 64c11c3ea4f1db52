"""``agent-sandbox-awx broker serve`` observed: its own access log replaces uvicorn's, its
diagnostics are JSON lines too, the audit log goes where ``[audit]`` says and the metrics are
served on ``[metrics] listen`` (plain HTTP, a port of their own); and the pieces the layer is
made of (route templates, line writers) on their own."""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx.broker.common._route_names import (
    data_route,
    issuer_route,
    rpc_route,
    v1_route,
)
from k8s_agent_sandbox_awx.broker.config import BrokerConfigError, load_config
from tests._support.broker_server import CLI, Pki, Served, write_config

pytest.importorskip("uvicorn", reason="needs the [broker] extra")
pytest.importorskip("prometheus_client", reason="needs the [broker] extra")

from prometheus_client.parser import text_string_to_metric_families

from k8s_agent_sandbox_awx.broker.observability._lines import FileLines

QUERY_SECRET = "s3cr3t-query-value"


def _config(tmp_path: Path, pki: Pki, extra: str) -> Path:
    config = write_config(tmp_path, pki)
    config.write_text(config.read_text() + extra)
    return config


def _until_line(server: Served, word: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(server.stdout):
            if word in line:
                return line
        time.sleep(0.02)
    raise AssertionError(f"no line with {word!r}: {server.output()}")


def test_broker_serve_writes_json_lines_and_serves_metrics_apart(
    pki: Pki, tmp_path: Path, started: list[Served]
) -> None:
    audit_file = tmp_path / "audit.jsonl"
    extra = (
        f'\n[logging]\nformat = "json"\n\n[audit]\ndestination = "{audit_file}"\n\n'
        '[metrics]\nlisten = "127.0.0.1:0"\n'
    )
    server = Served.start([*CLI, "broker", "serve", "--config", str(_config(tmp_path, pki, extra))])
    started.append(server)
    server.wait_started()
    metrics_url = _until_line(server, "metrics at http://").split(" metrics at ")[1].split()[0]
    assert audit_file.exists()  # opened at start: a path it cannot open stops it there

    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=pki.context(), timeout=10)
    conn.request(
        "GET", f"/v1/sandboxes/sbx-abc?token={QUERY_SECRET}", headers={"X-Request-Id": "rq-1"}
    )
    response = conn.getresponse()
    response.read()
    assert response.getheader("X-Request-Id") == "rq-1"
    access = json.loads(_until_line(server, '"request_id":"rq-1"'))
    assert (access["log"], access["route"], access["method"]) == (
        "access",
        "/v1/sandboxes/{name}",
        "GET",
    )
    assert access["status"] == response.status and access["end"] == "complete"

    host, _, port = metrics_url.removeprefix("http://").partition(":")
    plain = http.client.HTTPConnection(host, int(port.split("/")[0]), timeout=10)
    plain.request("GET", "/metrics")
    metrics = plain.getresponse()
    assert metrics.status == 200
    families = {f.name: f.samples for f in text_string_to_metric_families(metrics.read().decode())}
    [sample] = [
        s
        for s in families["agent_sandbox_broker_requests"]
        if s.labels.get("route") == "/v1/sandboxes/{name}"
    ]
    assert sample.value == 1 and sample.labels["status"] == str(response.status)
    plain.request("GET", "/other")
    assert plain.getresponse().status == 404

    server.terminate()
    assert server.wait(30) == 0
    output = server.output()
    assert QUERY_SECRET not in output and "HTTP/1.1" not in output  # no uvicorn access line
    # every diagnostic is a JSON line; the CLI's own last word stays plain text
    plain = [line for line in server.stderr if not line.startswith("{")]
    assert plain == ["agent-sandbox-awx broker: stopped\n"], plain
    diagnostics = [json.loads(line) for line in server.stderr if line.startswith("{")]
    assert diagnostics and all(d["log"] == "broker" for d in diagnostics)
    assert any("Uvicorn running" in d["message"] or "Started" in d["message"] for d in diagnostics)


def _diagnostics(server: Served) -> list[dict[str, object]]:
    return [json.loads(line) for line in list(server.stderr) if line.startswith("{")]


def _until_diagnostic(server: Served, word: str, timeout: float = 10.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in _diagnostics(server):
            if word in str(line["message"]):
                return line
        time.sleep(0.02)
    raise AssertionError(f"no message with {word!r}: {server.output()}")


def test_the_start_is_one_message_naming_the_process_addresses_backend_and_file(
    pki: Pki, tmp_path: Path, started: list[Served]
) -> None:
    """Issue 21: with a metrics port there were two uvicorn servers, and each said "Started
    server process [PID]" (and "Shutting down", "Finished server process [PID]"). Now the start
    is ONE message with what an operator needs, in JSON fields too, and no lifecycle line of
    uvicorn's appears twice."""
    extra = '\n[logging]\nformat = "json"\n\n[metrics]\nlisten = "127.0.0.1:0"\n'
    config = _config(tmp_path, pki, extra)
    server = Served.start([*CLI, "broker", "serve", "--config", str(config)])
    started.append(server)
    api = server.wait_started()
    metrics_url = _until_line(server, "metrics at http://").split(" metrics at ")[1].split()[0]
    line = _until_diagnostic(server, "Started")
    pid = server.process.pid
    assert line["logger"] == "k8s_agent_sandbox_awx.broker.server" and line["level"] == "info"
    assert (line["pid"], line["api"], line["metrics"]) == (pid, api, metrics_url)
    assert (line["backend"], line["config"]) == ("local", str(config))
    assert line["public_url"] == "https://sandbox-broker.example.com"
    for fact in (f"[{pid}]", api, metrics_url, "backend local", str(config)):
        assert fact in str(line["message"]), (fact, line)
    server.terminate()
    assert server.wait(30) == 0
    messages = [str(d["message"]) for d in _diagnostics(server)]
    assert [m for m in messages if "Started" in m] == [line["message"]], messages
    assert messages.count(f"Finished server process [{pid}]") == 1, messages
    assert messages.count("Shutting down") == 1, messages


def test_the_text_start_message_is_one_line_too(
    pki: Pki, tmp_path: Path, started: list[Served]
) -> None:
    extra = '\n[logging]\nformat = "text"\n\n[metrics]\nlisten = "127.0.0.1:0"\n'
    config = _config(tmp_path, pki, extra)
    server = Served.start([*CLI, "broker", "serve", "--config", str(config)])
    started.append(server)
    api = server.wait_started()
    server.terminate()
    assert server.wait(30) == 0
    [line] = [line for line in server.stderr if "Started" in line]
    pid = server.process.pid
    assert line.startswith("INFO:") and f"[{pid}]" in line and api in line, line
    assert "backend local" in line and str(config) in line and "metrics http://" in line, line
    assert sum("Finished server process" in line for line in server.stderr) == 1, server.stderr


def test_text_lines_and_no_access_log_when_asked(
    pki: Pki, tmp_path: Path, started: list[Served]
) -> None:
    extra = '\n[logging]\nformat = "text"\n'
    server = Served.start([*CLI, "broker", "serve", "--config", str(_config(tmp_path, pki, extra))])
    started.append(server)
    server.wait_started()
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=pki.context(), timeout=10)
    conn.request("GET", "/v1/whoami", headers={"X-Request-Id": "rq-text"})
    conn.getresponse().read()
    line = _until_line(server, "request_id=rq-text")
    assert "log=access" in line and "route=/v1/whoami" in line and "method=GET" in line
    server.terminate()
    assert server.wait(30) == 0

    quiet = write_config(tmp_path, pki)
    quiet.write_text(quiet.read_text().replace("[server]\n", "[server]\naccess_log = false\n", 1))
    with quiet.open("a") as extra_tables:  # the audit (always written) apart from stdout
        extra_tables.write(f'\n[audit]\ndestination = "{tmp_path / "audit.jsonl"}"\n')
    server = Served.start([*CLI, "broker", "serve", "--config", str(quiet)])
    started.append(server)
    server.wait_started()
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=pki.context(), timeout=10)
    conn.request("GET", "/v1/whoami", headers={"X-Request-Id": "rq-quiet"})
    conn.getresponse().read()
    time.sleep(0.3)
    assert "rq-quiet" not in server.output()


def test_the_configuration_checks_the_observability_tables(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "audit.jsonl"
    extra = (
        f'\n[logging]\nformat = "xml"\n\n[audit]\ndestination = "{missing}"\n\n'
        '[metrics]\nlisten = "127.0.0.1:0"\nport = 9\n'
    )
    with pytest.raises(BrokerConfigError) as caught:
        load_config(_config(tmp_path, pki, extra))
    text = str(caught.value)
    assert "logging.format: 'xml' is not one of 'json', 'text'" in text
    assert "audit.destination" in text and "does not exist" in text
    assert "metrics.port: is not a key of [metrics]" in text
    good = load_config(_config(tmp_path, pki, '\n[audit]\ndestination = "audit.jsonl"\n'))
    assert good.audit.destination == tmp_path / "audit.jsonl"  # relative to the file
    assert good.logging.format == "json" and good.metrics is None


# -- the parts ----------------------------------------------------------------------------------


def test_route_templates_never_hold_a_path_or_a_name() -> None:
    assert v1_route("/v1/sandboxes") == "/v1/sandboxes"
    assert v1_route("/v1/sandboxes/sbx-1") == "/v1/sandboxes/{name}"
    assert v1_route("/v1/sandboxes/sbx-1/lifetime") == "/v1/sandboxes/{name}/lifetime"
    assert v1_route("/v1/sandboxes/sbx-1/secret/x") == "/v1 unmatched"
    assert rpc_route("create", ("create",)) == "/rpc op=create"
    assert rpc_route("drop table", ("create",)) == "/rpc op=other"
    assert rpc_route(["x"], ("create",)) == "/rpc op=other"
    assert data_route("/download/secret%2Fplans.txt") == "{data} /download/{path}"
    assert data_route("/list/") == "{data} /list/{path}"
    assert data_route("/commands/c-123/events") == "{data} /commands/{id}/events"
    assert data_route("/commands/c-123") == "{data} /commands/{id}"
    assert data_route("/commands/c-123/whatever") == "{data} /commands/{id}/other"
    assert data_route("/fs/read") == "{data} /fs/read"
    assert data_route("/fs/secret") == "{data} /fs/other"
    assert data_route("/anything/else") == "{data} other"
    assert data_route("/code/execute") == "{data} /code/execute"
    assert data_route("/code/executions/e-1/events") == "{data} /code/executions/{id}/events"
    assert data_route("/code/executions/e-1") == "{data} /code/executions/{id}"
    assert data_route("/code/contexts/c-1/remove") == "{data} /code/contexts/{id}/remove"
    assert data_route("/code/contexts") == "{data} /code/contexts"
    assert data_route("/code/contexts/secret/x") == "{data} /code/other"
    assert data_route("/code/secret-name") == "{data} /code/other"
    assert issuer_route("/issuers/kubernetes/jwks") == "/issuers/{name}/jwks"
    assert (
        issuer_route("/issuers/gitlab/.well-known/openid-configuration")
        == "/issuers/{name}/.well-known/openid-configuration"
    )
    assert issuer_route("/issuers/x/y/jwks") == "/issuers unmatched"


def test_a_file_destination_is_appended_to_and_reopened_after_rotation(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"earlier":true}\n')
    lines = FileLines(path)
    assert os.stat(path).st_mode & 0o077 == 0 or path.read_text()  # appended, kept
    lines.write({"n": 1})
    os.rename(path, tmp_path / "audit.jsonl.1")  # logrotate's default: move, then a new file
    lines.write({"n": 2})
    lines.write({"n": 3})
    assert (tmp_path / "audit.jsonl.1").read_text() == '{"earlier":true}\n{"n":1}\n'
    assert path.read_text() == '{"n":2}\n{"n":3}\n'
    assert os.stat(path).st_mode & 0o777 == 0o600  # made by the broker: its own only
    path.unlink()
    lines.write({"n": 4})
    assert path.read_text() == '{"n":4}\n'
    lines.close()
    assert lines.failures == 0


def test_a_line_that_cannot_be_written_is_counted_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from k8s_agent_sandbox_awx.broker.observability._lines import StreamLines

    class Broken:
        name = "broken"

        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            pass

    lines = StreamLines(Broken(), "json")  # type: ignore[arg-type]
    lines.write({"a": 1})
    lines.write({"a": 2})
    assert lines.failures == 2
    reported = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(reported) == 1 and "No space left on device" in reported[0].getMessage()


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("the server tests run on Linux")


@pytest.mark.asyncio
async def test_broker_serves_metrics_read_its_issuers_and_backend(pki: Pki, tmp_path: Path) -> None:
    """The app ``broker serve`` builds (``app_factory``, a ConfiguredBroker around the
    BrokerApp) is observed as a broker: the metrics read its verifier and its backend at
    scrape time (each issuer's readiness, the live sandboxes)."""
    import httpx

    from k8s_agent_sandbox_awx.broker._app_factory import app_factory
    from k8s_agent_sandbox_awx.broker.observability._serve import observed

    config = load_config(_config(tmp_path, pki, '\n[metrics]\nlisten = "127.0.0.1:0"\n'))
    served = observed(app_factory(config), config)
    assert served.metrics is not None
    transport = httpx.ASGITransport(app=served.metrics)
    async with httpx.AsyncClient(transport=transport, base_url="http://metrics") as client:
        text = (await client.get("/metrics")).text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {
        "agent_sandbox_broker_issuer_ready",
        "agent_sandbox_broker_active_sandboxes",
    } <= families
