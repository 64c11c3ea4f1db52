"""What the broker's operators see (docs/broker/operate.md): the access log, the audit log and the
metrics of a local broker observed as ``broker serve`` observes its app, over real HTTPS with
real signed tokens; the lines are parsed as JSON, the metrics with prometheus-client's parser.

Nothing secret may appear anywhere in them: no token (valid, forged or malformed), no
Authorization header, no query string, no raw path (a data-plane path holds file names).
"""

from __future__ import annotations

import io
import json
import re
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker, Policy
from tests._support import ws_client
from tests._support.port_server import free_port, running_port_app

pytest.importorskip("prometheus_client", reason="needs the [broker] extra")

from prometheus_client.parser import text_string_to_metric_families

from k8s_agent_sandbox_awx.broker.observability._lines import StreamLines
from k8s_agent_sandbox_awx.broker.observability._observer import Observer

FILE_NAME = "quarterly-secret-plans.txt"
QUERY_SECRET = "s3cr3t-in-the-query"
SUBJECT = "system:serviceaccount:team-a:alice"


@dataclass
class Observed:
    broker: LocalBroker
    observer: Observer
    access: io.StringIO
    audit: io.StringIO

    def lines(self, stream: io.StringIO) -> list[dict[str, Any]]:
        return [json.loads(line) for line in stream.getvalue().splitlines()]

    def wait(
        self, stream: io.StringIO, match: Callable[[dict[str, Any]], bool], timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """The lines of ``stream`` that ``match``, once there is one (a line is written when
        the answer ended, which the client may see a moment before)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in self.lines(stream) if match(line)]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    def access_for(self, request_id: str) -> dict[str, Any]:
        [line] = self.wait(self.access, lambda line: line["request_id"] == request_id)
        return line

    def audit_for(self, request_id: str) -> dict[str, Any]:
        [line] = self.wait(self.audit, lambda line: line["request_id"] == request_id)
        return line

    def metrics(self) -> dict[str, list[Any]]:
        assert self.observer.metrics is not None
        text = self.observer.metrics.exposition().decode()
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    def everything(self) -> str:
        assert self.observer.metrics is not None
        exposition = self.observer.metrics.exposition().decode()
        return self.access.getvalue() + self.audit.getvalue() + exposition


@pytest.fixture(scope="module")
def observed() -> Iterator[Observed]:
    access, audit = io.StringIO(), io.StringIO()
    observer = Observer(access=StreamLines(access), audit=StreamLines(audit), metrics=True)
    policy = Policy(
        templates=("python",),
        namespace=lambda caller: str(caller.attributes["namespace"]),
        max_sandboxes=1,
        max_lifetime_seconds=600,
    )
    with LocalBroker(
        templates={"python": None, "gpu": None},
        kubernetes_policy=policy,
        warn=False,
        observer=observer,
    ) as broker:
        yield Observed(broker, observer, access, audit)


@pytest.fixture
def obs(observed: Observed) -> Iterator[Observed]:
    yield observed
    observed.broker.reset()


class Client:
    """httpx with one token; every request carries a fresh X-Request-Id the test can find."""

    def __init__(self, broker: LocalBroker, token: str | None) -> None:
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        self.http = httpx.Client(
            base_url=broker.url,
            verify=ssl.create_default_context(cafile=broker.ca_bundle),
            headers=headers,
            timeout=30.0,
        )
        self.count = 0

    def send(self, method: str, path: str, **kwargs: Any) -> tuple[str, httpx.Response]:
        self.count += 1
        rid = f"t-{time.monotonic_ns()}-{self.count}"
        headers = {"X-Request-Id": rid, **kwargs.pop("headers", {})}
        response = self.http.request(method, path, headers=headers, **kwargs)
        assert response.headers["x-request-id"] == rid
        return rid, response

    def ready(self) -> dict[str, Any]:
        _, created = self.send("POST", "/v1/sandboxes", json={})
        assert created.status_code == 201, created.text
        name = created.json()["name"]
        params = {"wait": "ready", "timeout": 20}
        _, resp = self.send("GET", f"/v1/sandboxes/{name}", params=params)
        assert resp.json()["phase"] == "Ready", resp.text
        sandbox: dict[str, Any] = resp.json()
        return sandbox


def data_headers(sandbox: dict[str, Any]) -> dict[str, str]:
    return {"X-Sandbox-ID": sandbox["name"], "X-Sandbox-Namespace": sandbox["namespace"]}


@pytest.fixture
def alice(obs: Observed) -> Iterator[Client]:
    client = Client(obs.broker, obs.broker.issue_kubernetes_token("team-a", "alice"))
    yield client
    client.http.close()


def forged(broker: LocalBroker) -> str:
    """A token for mallory whose signature is another token's: JWT-shaped, never verified."""
    mallory = broker.issue_kubernetes_token("team-a", "mallory")
    other = broker.issue_kubernetes_token("team-a", "someone-else")
    return mallory.rsplit(".", 1)[0] + "." + other.rsplit(".", 1)[1]


# -- the access log -------------------------------------------------------------------------------


def test_one_access_line_per_request_with_the_route_template(obs: Observed, alice: Client) -> None:
    sandbox = alice.ready()
    name = sandbox["name"]
    rid, resp = alice.send(
        "POST", "/upload", headers=data_headers(sandbox), files={"file": (FILE_NAME, b"x" * 100)}
    )
    assert resp.status_code == 200, resp.text
    up = obs.access_for(rid)
    rid, resp = alice.send(
        "GET", f"/download/{FILE_NAME}?token={QUERY_SECRET}", headers=data_headers(sandbox)
    )
    assert resp.status_code == 200 and resp.content == b"x" * 100
    down = obs.access_for(rid)
    rid, resp = alice.send("GET", f"/v1/sandboxes/{name}")
    get = obs.access_for(rid)

    assert get["route"] == "/v1/sandboxes/{name}" and get["plane"] == "v1"
    assert (get["method"], get["status"], get["end"]) == ("GET", 200, "complete")
    assert get["subject"] == SUBJECT and get["provider"] == "kubernetes"
    assert get["issuer"] == obs.broker.kubernetes.url and get["sandbox"] == name
    assert get["log"] == "access" and re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", get["time"])
    assert isinstance(get["duration_ms"], float) and get["duration_ms"] > 0
    assert up["route"] == "{data} /upload" and up["plane"] == "data" and up["sandbox"] == name
    assert up["bytes_in"] > 100 and up["bytes_out"] > 0
    assert down["route"] == "{data} /download/{path}" and down["bytes_out"] == 100
    text = obs.access.getvalue()
    assert FILE_NAME not in text and QUERY_SECRET not in text and "/download/q" not in text
    assert alice.token is not None and alice.token not in text and "Bearer" not in text


def test_a_request_id_is_kept_when_sane_else_made_and_always_echoed(
    obs: Observed, alice: Client
) -> None:
    resp = alice.http.get("/v1/whoami", headers={"X-Request-Id": "build-42.step:7"})
    assert resp.headers["x-request-id"] == "build-42.step:7"
    obs.access_for("build-42.step:7")
    for insane in ("has a space", "x" * 65, "-leading-dash", 'quote"d'):
        resp = alice.http.get("/v1/whoami", headers={"X-Request-Id": insane})
        made = resp.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", made), made
        assert obs.access_for(made)["route"] == "/v1/whoami"
    resp = alice.http.get("/v1/whoami")
    assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["x-request-id"])
    assert "has a space" not in obs.access.getvalue()


def test_401s_log_no_identity_and_no_token(obs: Observed, alice: Client) -> None:
    sandbox = alice.ready()
    tokens = {
        "not-a-jwt": "token_malformed",
        "a.b": "token_malformed",
        forged(obs.broker): "bad_signature",
    }
    for token, code in tokens.items():
        client = Client(obs.broker, token)
        rid, resp = client.send("GET", f"/download/{FILE_NAME}", headers=data_headers(sandbox))
        assert resp.status_code == 401 and resp.json()["code"] == code
        line = obs.access_for(rid)
        assert (line["route"], line["status"], line["error"]) == (
            "{data} /download/{path}",
            401,
            code,
        )
        assert line["subject"] is None and line["issuer"] is None
        audit = obs.audit_for(rid)
        assert (audit["action"], audit["outcome"], audit["code"]) == (
            "authenticate",
            "refused",
            code,
        )
        assert audit["subject"] is None and audit["issuer"] is None  # never the forger's claims
        assert audit["reason"] == resp.json()["detail"]
        client.http.close()
        # a fingerprint only for a JWT's shape: the digest of a short secret could be guessed
        assert (audit["token_fingerprint"] is None) == (code == "token_malformed")
    text = obs.everything()
    assert "mallory" not in text and FILE_NAME not in text
    assert all(token not in text for token in tokens)
    assert obs.audit_for(rid)["token_fingerprint"].startswith("sha256:")  # the forged JWT's


def test_a_verified_but_refused_token_is_attributed(obs: Observed) -> None:
    token = obs.broker.issue_kubernetes_token("team-a", "late", ttl=-3600)
    client = Client(obs.broker, token)
    rid, resp = client.send("POST", "/v1/sandboxes", json={})
    assert resp.status_code == 401 and resp.json()["code"] == "token_expired"
    audit = obs.audit_for(rid)
    assert audit["subject"] == "system:serviceaccount:team-a:late"
    assert audit["issuer"] == obs.broker.kubernetes.url
    import hashlib

    assert audit["token_fingerprint"] == "sha256:" + hashlib.sha256(token.encode()).hexdigest()
    assert token not in obs.everything()
    client.http.close()


def test_a_stream_is_logged_at_its_end(obs: Observed, alice: Client) -> None:
    sandbox = alice.ready()
    script = "echo tick; while [ ! -e go ]; do sleep 0.05; done; echo tock"
    _, started = alice.send(
        "POST",
        "/commands",
        json={"command": ["/bin/sh", "-c", script]},
        headers=data_headers(sandbox),
    )
    command = started.json()["command_id"]
    rid = "stream-to-its-end"
    headers = {"X-Request-Id": rid, **data_headers(sandbox)}
    url = f"/commands/{command}/events?after=0&duration=20"
    with alice.http.stream("GET", url, headers=headers) as events:
        assert events.status_code == 200
        chunks = events.iter_raw()
        content = b""
        while b"tick" not in content:  # the stream has begun: its first event is here
            content += next(chunks)
        time.sleep(0.4)  # the stream stays open: the command waits for "go"
        _, go = alice.send("POST", "/commands", json={"command": ["touch", "go"]},
                           headers=data_headers(sandbox))  # fmt: skip
        assert go.status_code in (200, 201, 202), go.text
        content += b"".join(chunks)
    assert b"tock" in content
    line = obs.access_for(rid)
    assert line["route"] == "{data} /commands/{id}/events" and line["end"] == "complete"
    assert line["duration_ms"] >= 400  # the whole stream, not its first byte
    assert line["bytes_out"] == len(content)
    assert command not in obs.access.getvalue()

    rid = "client-leaves-early"
    _, started = alice.send(
        "POST", "/commands", json={"command": ["sleep", "30"]}, headers=data_headers(sandbox)
    )
    path = f"/commands/{started.json()['command_id']}/events?after=0&duration=20"
    headers = {**data_headers(sandbox), "X-Request-Id": rid}
    with alice.http.stream("GET", path, headers=headers) as stream:
        assert stream.status_code == 200
    assert obs.access_for(rid)["end"] == "client_gone"


def test_an_answer_that_breaks_off_is_logged_as_upstream_broke(
    obs: Observed, alice: Client
) -> None:
    sandbox = alice.ready()
    script = "for i in $(seq 1 10); do echo $i; sleep 0.01; done"
    _, started = alice.send(
        "POST",
        "/commands",
        json={"command": ["/bin/sh", "-c", script]},
        headers=data_headers(sandbox),
    )
    obs.broker.drop_event_stream_mid_line(1, after_events=3)
    path = f"/commands/{started.json()['command_id']}/events?after=0&duration=20"
    headers = {**data_headers(sandbox), "X-Request-Id": "breaks-off"}
    with pytest.raises(httpx.HTTPError):
        alice.http.get(path, headers=headers)
    line = obs.access_for("breaks-off")
    assert (line["status"], line["end"]) == (200, "upstream_broke")


@pytest.fixture
def port_app() -> Iterator[int]:
    with running_port_app() as port:
        yield port


def test_a_websocket_is_one_access_line_and_is_counted(
    obs: Observed, alice: Client, port_app: int
) -> None:
    """A WebSocket handshake on a port request is one access line at the session's end (the
    route template, 101 or the refusal's status and code, the caller, the sandbox, the
    duration), an audit line when refused as not allowed, and a request in the metrics."""
    pytest.importorskip("websockets", reason="needs the [broker] extra (WebSocket upgrades)")
    before = obs.metrics()
    sandbox = alice.ready()
    bearer = {"Authorization": f"Bearer {alice.token}"}
    cases = {
        "ws-accepted": (port_app, bearer),
        "ws-port-not-allowed": (80, bearer),  # below the policy's ports (1024-65535)
        "ws-not-listening": (free_port(), bearer),
        "ws-no-token": (port_app, {}),
    }
    heads = {}
    for rid, (port, auth) in cases.items():
        headers = {**data_headers(sandbox), "X-Sandbox-Port": str(port), **auth}
        ws = ws_client.connect_tls(
            obs.broker.url, obs.broker.ca_bundle, f"/ws?token={QUERY_SECRET}",
            {**headers, "X-Request-Id": rid},
        )  # fmt: skip
        heads[rid] = ws.head
        if rid == "ws-accepted":
            time.sleep(0.2)  # the session lasts: its line comes at its end, with its duration
            ws.send(1, b"hello")
            assert ws.recv() == (1, b"hello")
            ws.close()
        ws.sock.close()
    assert heads["ws-accepted"].startswith(b"HTTP/1.1 101"), heads["ws-accepted"]
    lines = {rid: obs.access_for(rid) for rid in cases}  # exactly one line each
    assert all(f"x-request-id: {rid}".encode() in heads[rid].lower() for rid in cases)

    accepted = lines["ws-accepted"]
    assert (accepted["route"], accepted["plane"], accepted["method"]) == (
        "{data} websocket",
        "data",
        "GET",
    )
    assert (accepted["status"], accepted["end"], accepted["error"]) == (101, "complete", None)
    assert accepted["subject"] == SUBJECT and accepted["sandbox"] == sandbox["name"]
    assert accepted["duration_ms"] >= 200  # the whole session
    assert accepted["bytes_in"] == 5 and accepted["bytes_out"] == 5  # the messages' bytes
    refused = {rid: (line["status"], line["error"]) for rid, line in lines.items()}
    assert refused["ws-port-not-allowed"] == (403, "port_not_allowed")
    assert refused["ws-not-listening"] == (502, "port_not_listening")
    assert refused["ws-no-token"] == (401, "token_missing")
    for rid in cases:
        assert lines[rid]["route"] == "{data} websocket" and lines[rid]["end"] == "complete"
    assert lines["ws-port-not-allowed"]["subject"] == SUBJECT
    audit = obs.audit_for("ws-port-not-allowed")
    assert (audit["outcome"], audit["code"]) == ("refused", "port_not_allowed")
    text = obs.everything()
    assert alice.token is not None and alice.token not in text and QUERY_SECRET not in text
    assert "Bearer" not in obs.access.getvalue() and "/ws" not in obs.access.getvalue()

    time.sleep(0.2)  # the metrics are recorded just after the lines are written
    after = obs.metrics()
    requests = "agent_sandbox_broker_requests"
    for status in ("101", "403", "502", "401"):
        labels = {"route": "{data} websocket", "method": "GET", "status": status}
        counted = _value(after[requests], requests + "_total", **labels)
        assert counted - _value(before.get(requests, []), requests + "_total", **labels) == 1
    refusals = "agent_sandbox_broker_refusals"
    labels = {"action": "access", "code": "port_not_allowed"}
    assert (
        _value(after[refusals], refusals + "_total", **labels)
        - _value(before.get(refusals, []), refusals + "_total", **labels)
        == 1
    )


def test_every_error_answer_names_its_code_in_the_access_line(
    obs: Observed, alice: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each error answer of the broker, wherever it is made (the front-ends, the app's outage
    answer on HTTP and on ``/rpc``, a method ``/rpc`` does not take, a WebSocket to no data
    route), carries its code in the access line: the code the answer names (its header, its
    JSON), or for ``/rpc``'s plain-text answers the code the broker decided on."""
    from k8s_agent_sandbox_awx.broker.backends._interface import BackendUnavailable

    sandbox = alice.ready()
    store = obs.broker._require_app().backend
    answers: dict[str, tuple[int, str]] = {}

    def answer(code: str, method: str, path: str, **kwargs: Any) -> None:
        rid, resp = alice.send(method, path, **kwargs)
        assert resp.status_code >= 400, resp.text
        header = resp.headers.get("agent-sandbox-broker-error")
        assert header in (None, code), (header, code)  # the answer's own code, when it has one
        answers[rid] = (resp.status_code, code)

    async def outage(*_: Any, **__: Any) -> Any:
        raise BackendUnavailable("the Kubernetes API server is unreachable (test)")

    answer("not_found", "GET", "/nowhere")
    answer("method_not_allowed", "GET", "/rpc")
    answer("invalid_header", "GET", "/", headers={"X-Sandbox-ID": "Not_A_Name"})
    with monkeypatch.context() as patch:
        for method in ("get", "find_claim", "list_owned"):
            patch.setattr(store, method, outage)
        answer("backend_unavailable", "GET", "/v1/sandboxes")
        answer("backend_unavailable", "GET", "/", headers=data_headers(sandbox))
        answer("backend_unavailable", "POST", "/rpc", json={"op": "status", "claim_name": "x"})
    obs.broker.inject_unavailable(2, scope="any")  # the local broker's injected outage
    answer("unavailable", "GET", "/", headers=data_headers(sandbox))
    answer("unavailable", "GET", "/v1/sandboxes")
    ws = ws_client.connect_tls(
        obs.broker.url, obs.broker.ca_bundle, "/v1/whoami", {"X-Request-Id": "ws-control"}
    )
    ws.sock.close()
    assert ws.head.split(b" ")[1] == b"404" and b"not_found" in ws.head, ws.head
    answers["ws-control"] = (404, "not_found")
    lines = {rid: obs.access_for(rid) for rid in answers}
    seen = {rid: (line["status"], line["error"]) for rid, line in lines.items()}
    assert seen == answers


def test_port_requests_are_one_route_their_port_apart(
    obs: Observed, alice: Client, port_app: int
) -> None:
    """A port request is named ``{data} port`` (HTTP) or ``{data} websocket`` in the access
    log and the metrics whatever its path (the user's, not the runtime's routes); its port is
    the access line's ``port``, never a metric label. Runtime requests keep their routes."""
    pytest.importorskip("websockets", reason="needs the [broker] extra (WebSocket upgrades)")
    before = obs.metrics()
    sandbox = alice.ready()
    at_port = {**data_headers(sandbox), "X-Sandbox-Port": str(port_app)}
    rid_download, resp = alice.send("GET", f"/download/{FILE_NAME}", headers=at_port)
    assert resp.status_code in (200, 404), resp.text  # the app's answer, whatever it is
    rid_other, _ = alice.send("POST", "/execute", content=b"{}", headers=at_port)
    runtime = {**data_headers(sandbox), "X-Sandbox-Port": "8888"}
    rid_runtime, _ = alice.send("GET", f"/download/{FILE_NAME}", headers=runtime)
    bearer = {"Authorization": f"Bearer {alice.token}", "X-Request-Id": "port-ws"}
    ws = ws_client.connect_tls(obs.broker.url, obs.broker.ca_bundle, "/ws", {**at_port, **bearer})
    assert ws.head.startswith(b"HTTP/1.1 101"), ws.head
    ws.close()
    ws.sock.close()

    lines = {rid: obs.access_for(rid) for rid in (rid_download, rid_other, rid_runtime, "port-ws")}
    named = {rid: (line["route"], line["port"]) for rid, line in lines.items()}
    assert named == {
        rid_download: ("{data} port", port_app),
        rid_other: ("{data} port", port_app),
        rid_runtime: ("{data} /download/{path}", None),
        "port-ws": ("{data} websocket", port_app),
    }
    time.sleep(0.2)  # the metrics are recorded just after the lines are written
    after = obs.metrics()
    requests = "agent_sandbox_broker_requests"
    counted = _value(after[requests], requests + "_total", route="{data} port")
    assert counted - _value(before.get(requests, []), requests + "_total", route="{data} port") == 2
    labels = {key for family in after.values() for sample in family for key in sample.labels}
    routes = {sample.labels.get("route") for family in after.values() for sample in family}
    assert "port" not in labels and not any(str(port_app) in (r or "") for r in routes)
    assert FILE_NAME not in obs.everything()


def test_a_refused_websocket_writes_no_server_error(obs: Observed, alice: Client) -> None:
    """A handshake the broker refuses with its JSON answer (a missing token, a port nothing
    listens on, a WebSocket to the control plane) is its access line; the server's log gets
    no ERROR for it (uvicorn 0.54 logged "ASGI callable returned without completing
    handshake." for every one)."""
    import asyncio
    import logging

    pytest.importorskip("websockets", reason="needs the [broker] extra (WebSocket upgrades)")
    sandbox = alice.ready()
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]
    server_log = logging.getLogger("uvicorn.error")
    server_log.addHandler(handler)
    try:
        bearer = {"Authorization": f"Bearer {alice.token}"}
        cases = {
            "refused-no-token": ("/ws", {**data_headers(sandbox), "X-Sandbox-Port": "18000"}, 401),
            "refused-not-listening": (
                "/ws",
                {**data_headers(sandbox), "X-Sandbox-Port": str(free_port()), **bearer},
                502,
            ),
            "refused-control-plane": ("/v1/whoami", bearer, 404),
        }
        for rid, (path, headers, status) in cases.items():
            headers = {**headers, "X-Request-Id": rid}
            ws = ws_client.connect_tls(obs.broker.url, obs.broker.ca_bundle, path, headers)
            ws.sock.close()
            assert ws.head.split(b" ")[1] == str(status).encode(), ws.head
        for rid, (_, _, status) in cases.items():
            line = obs.access_for(rid)
            assert line["status"] == status and line["error"] is not None, line
        # the server logs right after the app returned (the access line's end), in the same
        # step of its event loop: once a later step ran there, it would have logged
        obs.broker._call(asyncio.sleep(0))
    finally:
        server_log.removeHandler(handler)
    assert [record.getMessage() for record in errors] == []
    # exactly that record, after a handshake the broker answered: elsewhere it stays an error
    from k8s_agent_sandbox_awx.broker.dataplane._relay import NO_HANDSHAKE

    record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, NO_HANDSHAKE, (), None)
    assert all(f.filter(record) for f in server_log.filters)


# -- the audit log ---------------------------------------------------------------------------------


def test_audit_lines_for_every_v1_decision(obs: Observed, alice: Client) -> None:
    rid, created = alice.send("POST", "/v1/sandboxes", json={"lifetime_seconds": 300})
    assert created.status_code == 201
    name = created.json()["name"]
    line = obs.audit_for(rid)
    assert (line["log"], line["action"], line["outcome"]) == ("audit", "create", "admitted")
    assert (line["sandbox"], line["namespace"], line["template"], line["pool"]) == (
        name,
        "team-a",
        "python",
        "python",
    )
    assert line["lifetime_seconds"] == 300 and line["policy"] == "kubernetes"
    assert line["expires_at"] == created.json()["expires_at"]
    assert (line["subject"], line["provider"]) == (SUBJECT, "kubernetes")
    assert line["attributes"]["namespace"] == "team-a"
    assert line["token_fingerprint"].startswith("sha256:")

    rid, refused = alice.send("POST", "/v1/sandboxes", json={})
    assert refused.status_code == 429
    quota = obs.audit_for(rid)
    assert (quota["outcome"], quota["code"], quota["namespace"]) == (
        "refused",
        "quota_exceeded",
        "team-a",
    )
    assert quota["quota"] == {"name": "max_sandboxes", "limit": 1, "held": 1}

    rid, refused = alice.send("POST", "/v1/sandboxes", json={"template": "gpu"})
    policy = obs.audit_for(rid)
    assert (policy["outcome"], policy["code"]) == ("refused", "template_not_allowed")
    assert "'gpu'" in policy["reason"] and policy["status"] == 403

    rid, extended = alice.send("PUT", f"/v1/sandboxes/{name}/lifetime", json={"seconds": 400})
    line = obs.audit_for(rid)
    assert (line["action"], line["outcome"], line["sandbox"]) == ("extend", "extended", name)
    assert line["expires_at"] == extended.json()["expires_at"]
    rid, _ = alice.send("PUT", f"/v1/sandboxes/{name}/lifetime", json={"seconds": 100000})
    line = obs.audit_for(rid)
    assert (line["outcome"], line["code"]) == ("refused", "lifetime_exceeds_policy")

    rid, _ = alice.send("DELETE", f"/v1/sandboxes/{name}")
    line = obs.audit_for(rid)
    assert (line["action"], line["outcome"], line["sandbox"]) == ("delete", "deleted", name)
    rid, _ = alice.send("GET", f"/v1/sandboxes/{name}")
    assert obs.wait(obs.audit, lambda line: line["request_id"] == rid, timeout=0.3) == []


def test_audit_lines_for_every_rpc_decision(obs: Observed, alice: Client) -> None:
    rid, created = alice.send("POST", "/rpc", json={"op": "create"})
    claim = created.json()["claim_name"]
    line = obs.audit_for(rid)
    assert (line["route"], line["action"], line["outcome"]) == (
        "/rpc op=create",
        "create",
        "admitted",
    )
    assert line["claim"] == claim and line["pool"] == "python" and line["namespace"] == "team-a"
    rid, refused = alice.send("POST", "/rpc", json={"op": "create"})
    assert refused.status_code == 429
    assert obs.audit_for(rid)["quota"] == {"name": "max_sandboxes", "limit": 1, "held": 1}

    shutdown = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 500))
    body = {"op": "extend", "claim_name": claim, "lifecycle": {"shutdownTime": shutdown}}
    rid, _ = alice.send("POST", "/rpc", json=body)
    line = obs.audit_for(rid)
    assert (line["action"], line["outcome"], line["claim"]) == ("extend", "extended", claim)
    rid, _ = alice.send("POST", "/rpc", json={"op": "status", "claim_name": claim})
    assert obs.access_for(rid)["route"] == "/rpc op=status"
    rid, _ = alice.send("POST", "/rpc", json={"op": "delete", "claim_name": claim})
    line = obs.audit_for(rid)
    assert (line["action"], line["outcome"], line["claim"]) == ("delete", "deleted", claim)
    rid, _ = alice.send("POST", "/rpc", json={"op": "delete", "claim_name": "broker-nothing00"})
    assert obs.audit_for(rid)["outcome"] == "absent"
    rid, _ = alice.send("POST", "/rpc", json={"op": "snapshot_create", "x": "y"})
    assert obs.access_for(rid)["route"] == "/rpc op=other"


# -- the metrics -----------------------------------------------------------------------------------


def _value(samples: list[Any], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_count_what_was_done(obs: Observed, alice: Client) -> None:
    before = obs.metrics()
    sandbox = alice.ready()
    for _ in range(3):
        alice.send("GET", "/", headers=data_headers(sandbox))
    alice.send("POST", "/v1/sandboxes", json={})  # over the quota
    bad = Client(obs.broker, "not-a-jwt")
    bad.send("GET", "/v1/whoami")
    bad.http.close()
    time.sleep(0.2)  # the last lines are written after the answers
    after = obs.metrics()

    def delta(family: str, name: str, **labels: str) -> float:
        return _value(after[family], name, **labels) - _value(
            before.get(family, []), name, **labels
        )

    requests = "agent_sandbox_broker_requests_total"
    assert delta("agent_sandbox_broker_requests", requests, route="{data} /", status="2xx") == 3
    assert (
        delta("agent_sandbox_broker_requests", requests, route="/v1/sandboxes", status="201") == 1
    )
    assert (
        delta("agent_sandbox_broker_requests", requests, route="/v1/sandboxes", status="429") == 1
    )
    hist = "agent_sandbox_broker_request_duration_seconds_count"
    assert delta("agent_sandbox_broker_request_duration_seconds", hist, route="{data} /") == 3
    failures = "agent_sandbox_broker_token_verification_failures"
    assert delta(failures, failures + "_total", reason="token_malformed") == 1
    created = "agent_sandbox_broker_claims_created"
    assert delta(created, created + "_total", namespace="team-a", outcome="admitted") == 1
    assert delta(created, created + "_total", namespace="team-a", outcome="refused") == 1
    refusals = "agent_sandbox_broker_refusals"
    assert delta(refusals, refusals + "_total", action="create", code="quota_exceeded") == 1
    data = "agent_sandbox_broker_data_plane_bytes"
    assert delta(data, data + "_total", direction="out") > 0
    active = "agent_sandbox_broker_active_sandboxes"
    assert _value(after[active], active, namespace="team-a") == 1
    jwks = "agent_sandbox_broker_jwks_refreshes"
    assert _value(after[jwks], jwks + "_total", issuer="kubernetes") >= 1
    ready = "agent_sandbox_broker_issuer_ready"
    assert _value(after[ready], ready, issuer="kubernetes", verification="jwks") == 1
    assert "agent_sandbox_broker_jwks_refresh_failures" in after

    labels = {v for samples in after.values() for s in samples for v in s.labels.values()}
    assert not any(v.startswith("sbx-") or "serviceaccount" in v for v in labels), labels
    assert sandbox["name"] not in obs.everything().split("# HELP", 1)[-1]


def test_several_observed_brokers_keep_their_counts_apart(obs: Observed) -> None:
    other = Observer(metrics=True)
    with LocalBroker(warn=False, observer=other) as broker:
        httpx.get(
            broker.url + "/v1/healthz", verify=ssl.create_default_context(cafile=broker.ca_bundle)
        )
        time.sleep(0.1)
        assert other.metrics is not None and obs.observer.metrics is not None
        assert other.metrics.registry is not obs.observer.metrics.registry
        text = other.metrics.exposition().decode()
        families = {f.name: f.samples for f in text_string_to_metric_families(text)}
        total = _value(
            families["agent_sandbox_broker_requests"], "agent_sandbox_broker_requests_total"
        )
        assert total == 1


def test_the_audit_lifetime_is_whole_seconds_in_both_dialects(obs: Observed, alice: Client) -> None:
    """v1 writes the caller's integer; /rpc wrote the lifetime it computed as a float (600.0,
    or 499.73 from a shutdownTime): both are whole seconds, an int, now."""
    rid, created = alice.send("POST", "/rpc", json={"op": "create"})
    lifetime = obs.audit_for(rid)["lifetime_seconds"]
    assert (type(lifetime), lifetime) == (int, 600)
    alice.send("POST", "/rpc", json={"op": "delete", "claim_name": created.json()["claim_name"]})
    shutdown = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 500))
    body = {"op": "create", "lifecycle": {"shutdownTime": shutdown}}
    rid, created = alice.send("POST", "/rpc", json=body)
    lifetime = obs.audit_for(rid)["lifetime_seconds"]
    assert type(lifetime) is int and 495 <= lifetime <= 500
    alice.send("POST", "/rpc", json={"op": "delete", "claim_name": created.json()["claim_name"]})
    rid, created = alice.send("POST", "/v1/sandboxes", json={"lifetime_seconds": 300})
    lifetime = obs.audit_for(rid)["lifetime_seconds"]
    assert (type(lifetime), lifetime) == (int, 300)
