"""What operators see under hostile input: caller and
sandbox values sent through every field the broker logs or counts must reach no log line raw
(no raw path, header value, body value or token; no forged line: CR, LF, ESC and other controls
escaped) and no metric label (bounded label values under hostile input).

A local broker observed as ``broker serve`` observes its app: the access and audit lines in
both formats (JSON and text, each record written both ways), the broker's own messages and
uvicorn's through the formatters ``broker serve`` installs (JSON and text), the metrics.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import ssl
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker, Policy
from tests._support.broker_server import CLI, Pki, Served, write_config
from tests._support.status_server import status_server

pytest.importorskip("prometheus_client", reason="needs the [broker] extra")

from prometheus_client.parser import text_string_to_metric_families

from k8s_agent_sandbox_awx.broker.observability._lines import StreamLines
from k8s_agent_sandbox_awx.broker.observability._observer import Observer
from k8s_agent_sandbox_awx.broker.server._logs import JsonFormatter, TextFormatter


class BothFormats:
    """A line writer that writes every record as JSON and as text (each to its own stream)."""

    def __init__(self) -> None:
        self.json, self.text = io.StringIO(), io.StringIO()
        self._writers = (StreamLines(self.json, "json"), StreamLines(self.text, "text"))
        self.failures = 0

    def write(self, record: Mapping[str, Any]) -> None:
        for writer in self._writers:
            writer.write(record)


@dataclass
class Messages:
    """The broker's and uvicorn's ``logging`` records, formatted as ``broker serve`` formats
    them: JSON lines and text."""

    json: io.StringIO = field(default_factory=io.StringIO)
    text: io.StringIO = field(default_factory=io.StringIO)

    def handlers(self) -> list[logging.Handler]:
        as_json, as_text = logging.StreamHandler(self.json), logging.StreamHandler(self.text)
        as_json.setFormatter(JsonFormatter())
        as_text.setFormatter(TextFormatter())
        return [as_json, as_text]


@dataclass
class Watched:
    broker: LocalBroker
    observer: Observer
    access: BothFormats
    audit: BothFormats
    messages: Messages = field(default_factory=Messages)

    def outputs(self) -> dict[str, str]:
        return {
            "access json": self.access.json.getvalue(),
            "access text": self.access.text.getvalue(),
            "audit json": self.audit.json.getvalue(),
            "audit text": self.audit.text.getvalue(),
            "messages json": self.messages.json.getvalue(),
            "messages text": self.messages.text.getvalue(),
        }

    def metrics(self) -> dict[str, list[Any]]:
        assert self.observer.metrics is not None
        text = self.observer.metrics.exposition().decode()
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    def series(self) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        return {
            (s.name, tuple(sorted(s.labels.items())))
            for samples in self.metrics().values()
            for s in samples
        }

    def client(self, token: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        context = ssl.create_default_context(cafile=self.broker.ca_bundle)
        return httpx.Client(base_url=self.broker.url, verify=context, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def watched() -> Iterator[Watched]:
    access, audit = BothFormats(), BothFormats()
    observer = Observer(access=access, audit=audit, metrics=True)
    policy = Policy(
        templates=("python",),
        namespace=lambda caller: str(caller.attributes["namespace"]),
        max_sandboxes=2,
        max_lifetime_seconds=600,
    )
    messages = Messages()
    handlers = messages.handlers()
    loggers = [logging.getLogger(name) for name in ("k8s_agent_sandbox_awx", "uvicorn")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        for handler in handlers:
            logger.addHandler(handler)
    try:
        with LocalBroker(
            templates={"python": None}, kubernetes_policy=policy, warn=False, observer=observer
        ) as broker:
            yield Watched(broker, observer, access, audit, messages)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
            for handler in handlers:
                logger.removeHandler(handler)


def ready(http: httpx.Client) -> dict[str, Any]:
    created = http.post("/v1/sandboxes", json={})
    assert created.status_code == 201, created.text
    name = created.json()["name"]
    found = http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20})
    assert found.json()["phase"] == "Ready", found.text
    sandbox: dict[str, Any] = found.json()
    return sandbox


# -- item 12: metric label values chosen by a caller -------------------------------------------


def test_hostile_statuses_and_methods_mint_no_new_series(watched: Watched) -> None:
    """The ``status`` label of ``{data} port`` was the user's own server's status code (one
    caller minted 120 series). A status a sandbox chose is now its class (``2xx`` ... ``5xx``,
    else ``other``): a second round of other hostile statuses and methods adds no series."""
    token = watched.broker.issue_kubernetes_token("team-m", "mallory")
    with watched.client(token) as http, status_server() as port:
        sandbox = ready(http)
        headers = {"X-Sandbox-ID": sandbox["name"], "X-Sandbox-Namespace": "team-m",
                   "X-Sandbox-Port": str(port)}  # fmt: skip

        def round_of(statuses: range, methods: tuple[str, ...]) -> None:
            for status in statuses:
                for method in methods:
                    answer = http.request(method, f"/status/{status}", headers=headers)
                    assert answer.status_code == status, answer.text

        round_of(range(200, 600, 7), ("GET", "PROPFIND", "BREW"))
        time.sleep(0.2)  # the metrics are recorded just after the answers end
        before = watched.series()
        round_of(range(201, 600, 7), ("GET", "SEARCH", "MKCOL"))
        time.sleep(0.2)
        after = watched.series()
        http.delete(f"/v1/sandboxes/{sandbox['name']}")
    assert after == before  # the same series: nothing a caller chooses makes new ones
    requests = [
        dict(labels) for name, labels in after if name == "agent_sandbox_broker_requests_total"
    ]
    port_statuses = {s["status"] for s in requests if s["route"] == "{data} port"}
    assert port_statuses == {"2xx", "3xx", "4xx", "5xx"}, port_statuses
    methods = {s["method"] for s in requests if s["route"] == "{data} port"}
    assert methods == {"GET", "other"}, methods


def test_namespace_labels_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A namespace label is a DNS label the policies placed a claim in (with
    ``{caller.namespace}``: the caller's own), at most MAX_NAMESPACES of them per broker."""
    from k8s_agent_sandbox_awx.broker.observability import _metrics

    monkeypatch.setattr(_metrics, "MAX_NAMESPACES", 3)
    labels = _metrics._Namespaces()
    seen = [labels(f"team-{i}") for i in range(6)] + [
        labels("team-0"),
        labels("Bad_NS"),
        labels(""),
    ]
    assert seen == ["team-0", "team-1", "team-2", "other", "other", "other", "team-0", "other", ""]


# -- item 11: raw paths and caller values in the logs ------------------------------------------

CONTROLS = ("\r", "\n", "\x1b", "\x07", "\x85", "\x9b", "\u2028", "\u2029", "\x00")
"""What forges a line or drives a terminal: none may reach a log as itself."""
PADDING = "Q" * 10240  # 10 KiB: no log line may carry a caller's value whole


class Hostile:
    """Hostile values, each marked with a tag of its own (``Z<tag>Z``): a ``secret`` one (a
    path, a header's or a body's value, an unverified claim) may appear in no log at all, not
    even escaped; the tags of the ``escaped`` ones (a verified subject) may appear, escaped."""

    def __init__(self) -> None:
        self.secrets: list[str] = []
        self.escaped: list[str] = []

    def _tag(self, name: str, kind: list[str]) -> str:
        tag = f"Z{name}Z"
        kind.append(tag)
        return tag

    def text(self, name: str, *, pad: bool = True) -> str:
        """A value for a body or a claim: CR, LF, ESC, BEL, NEL, CSI, LS, a forged text line
        and a forged JSON line (and 10 KiB)."""
        tag = self._tag(name, self.secrets)
        forged = f'\r\nINFO:     forged {tag}\n{{"log": "audit", "forged": "{tag}"}}\n'
        return f"{tag}{forged}\x1b[2J\x1b]0;t\x07\x85\x9b31m\u2028" + (PADDING if pad else "")

    def header(self, name: str) -> bytes:
        """A header value: what reaches the broker of a hostile one (obs-text: NEL, CSI)."""
        tag = self._tag(name, self.secrets)
        return f"{tag}\x85INFO: forged {tag}\x9b2J{PADDING}".encode("latin-1")

    def path(self, name: str) -> str:
        """A path segment, percent-encoded (the broker decodes it: CR, LF and ESC in it)."""
        return urllib.parse.quote(self.text(name, pad=False), safe="") + PADDING

    def secret_path(self, name: str) -> str:
        """A path segment that holds a secret and nothing the broker refuses (no control
        character): the port requests forward it (``/reset/<code>``)."""
        return self._tag(name, self.secrets) + "-" + PADDING

    def verified(self, name: str) -> str:
        return self._tag(name, self.escaped) + "\r\nINFO:     forged\x1b[2J"


def raw_request(watched: Watched, head: bytes) -> bytes:
    url = httpx.URL(watched.broker.url)
    context = ssl.create_default_context(cafile=watched.broker.ca_bundle)
    with socket.create_connection((url.host, url.port), 15) as plain:
        with context.wrap_socket(plain, server_hostname=url.host) as sock:
            sock.sendall(head)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def forged_token(watched: Watched, **claims: Any) -> str:
    """A token for alice whose signature is another token's (the claims are never verified)."""
    token = watched.broker.issue_kubernetes_token("team-h", "alice", claims=claims)
    other = watched.broker.issue_kubernetes_token("team-h", "someone-else")
    return token.rsplit(".", 1)[0] + "." + other.rsplit(".", 1)[1]


def send_control_plane(watched: Watched, h: Hostile, http: httpx.Client) -> None:
    """Paths, headers, bodies and query strings of the v1 and /rpc control plane."""
    for method in ("GET", "DELETE"):
        http.request(method, "/v1/sandboxes/" + h.path(f"v1-path-{method}"))
    http.put("/v1/sandboxes/" + h.path("v1-lifetime-path") + "/lifetime", json={"seconds": 1})
    http.get("/v1/" + h.path("v1-unmatched"))
    http.get("/v1/whoami", params={"q": h.text("query")})
    bodies = {
        "template": {"template": h.text("template")},
        "label-key": {"labels": {h.text("label-key", pad=False): "v"}},
        "label-value": {"labels": {"k": h.text("label-value")}},
        "annotation-key": {"annotations": {h.text("annotation-key", pad=False): "v"}},
        "reserved": {"annotations": {"broker.agent-sandbox-awx.io/" + h.text("reserved"): "v"}},
        "env-name": {"env": {h.text("env-name"): "v"}},
        "unknown-field": {h.text("unknown-field"): 1},
        "lifetime": {"lifetime_seconds": h.text("lifetime")},
    }
    for body in bodies.values():
        http.post("/v1/sandboxes", json=body)
    http.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": h.header("idempotency")})
    http.post("/v1/sandboxes", json={}, headers={"Prefer": h.header("prefer")})
    rpc = [
        {"op": h.text("rpc-op")},
        {"op": "create", h.text("rpc-unknown-field"): 1},
        {"op": "create", "backend": h.text("rpc-backend")},
        {"op": "create", "warmpool": h.text("rpc-warmpool")},
        {"op": "create", "scopes": [h.text("rpc-scope")]},
        {"op": "create", "lifecycle": {"shutdownPolicy": h.text("rpc-policy")}},
        {"op": "create", "lifecycle": {h.text("rpc-lifecycle-field"): 1}},
        {"op": "create", "lifecycle": {"shutdownTime": h.text("rpc-time")}},
        {"op": "create", "labels": {"k": h.text("rpc-label")}},
        {"op": "create", "pod_annotations": {h.text("rpc-pod-annotation", pad=False): "v"}},
        {"op": "delete", "claim_name": h.text("rpc-claim")},
        {"op": "extend", "claim_name": h.text("rpc-extend-claim")},
        {"op": "delete", "claim_name": "broker-none", "request_purpose": h.text("rpc-long")},
    ]
    for body in rpc:
        http.post("/rpc", json=body)
    created = http.post("/rpc", json={"op": "create"})
    assert created.status_code == 200, created.text
    purpose = h.text("purpose", pad=False)[:64]
    claim = created.json()["claim_name"]
    deleted = http.post(
        "/rpc", json={"op": "delete", "claim_name": claim, "request_purpose": purpose}
    )
    assert deleted.status_code == 204, deleted.text


def send_tokens(watched: Watched, h: Hostile, http: httpx.Client) -> None:
    """Tokens: forged ones with hostile claims (never verified: never written), issuer-signed
    ones refused for a hostile claim, an Authorization header that is no token."""
    for claim in ("iss", "sub", "aud", "exp", "nbf", "kid"):
        if claim == "kid":
            token = watched.broker.issue_kubernetes_token("team-h", "alice")
            head = json.dumps({"alg": "RS256", "kid": h.text("kid")}).encode()
            import base64

            part = base64.urlsafe_b64encode(head).rstrip(b"=").decode()
            token = part + "." + token.split(".", 1)[1]
        else:
            token = forged_token(watched, **{claim: h.text(f"forged-{claim}")})
        http.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"})
    alg = forged_token(watched)
    header = json.dumps({"alg": h.text("alg", pad=False), "kid": "k"}).encode()
    import base64

    alg = base64.urlsafe_b64encode(header).rstrip(b"=").decode() + "." + alg.split(".", 1)[1]
    http.get("/v1/whoami", headers={"Authorization": f"Bearer {alg}"})
    for claim in ("aud", "exp", "iat"):  # signed: its signature verifies, a claim rule refuses
        token = watched.broker.issue_kubernetes_token(
            "team-h", "alice", claims={claim: h.text(f"signed-{claim}", pad=False)}
        )
        http.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"})
    both = watched.broker.issue_kubernetes_token(
        "team-h", "alice", claims={"kubernetes.io.namespace": h.text("spelled", pad=False)}
    )
    http.get("/v1/whoami", headers={"Authorization": f"Bearer {both}"})
    http.get("/v1/whoami", headers={"Authorization": h.header("authorization")})
    http.get("/v1/whoami", headers={"Authorization": b"Bearer " + h.header("bearer")})


def send_data_plane(watched: Watched, h: Hostile, http: httpx.Client, port: int) -> None:
    sandbox = ready(http)
    data = {"X-Sandbox-ID": sandbox["name"], "X-Sandbox-Namespace": sandbox["namespace"]}
    for name in ("X-Sandbox-Claim-Name", "X-Sandbox-ID", "X-Sandbox-Namespace",
                 "X-Sandbox-Port", "X-Sandbox-Timeout", "X-Request-Id", "User-Agent",
                 "Cookie", "Referer"):  # fmt: skip
        http.get("/commands", headers={**data, name: h.header("header-" + name.lower())})
    http.get("/download/" + h.path("download"), headers=data)
    http.get("/" + h.path("data-unnormal") + "/../x", headers=data)
    ported = {**data, "X-Sandbox-Port": str(port)}
    http.get("/status/404/" + h.path("port-path"), headers=ported)
    http.get("/status/404/" + h.secret_path("port-secret-path"), headers=ported)
    with contextlib.suppress(httpx.RemoteProtocolError):  # the broker drops a broken answer
        http.get("/broken/" + h.secret_path("broken-path"), headers=ported)
    with http.stream("GET", "/slow/" + h.secret_path("slow-path"), headers=ported) as answer:
        assert answer.status_code == 200
        next(answer.iter_raw())  # the first chunk; then the client goes away
    http.get("/anything", headers={**ported, "X-Sandbox-Claim-Name": h.header("port-claim")})
    head = (f"GET /ws/{h.path('ws-path')} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            f"Authorization: Bearer {http.headers['authorization'].split()[1]}\r\n"
            f"X-Sandbox-ID: {sandbox['name']}\r\nX-Sandbox-Namespace: {sandbox['namespace']}\r\n"
            f"X-Sandbox-Port: 80\r\nConnection: close\r\n\r\n")  # fmt: skip
    raw_request(watched, head.encode("latin-1"))
    method = "ZmethodZ" + "M" * 10240
    h.secrets.append("ZmethodZ")
    raw_request(watched, f"{method} /v1/whoami HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                .encode())  # fmt: skip
    http.delete(f"/v1/sandboxes/{sandbox['name']}")


def test_no_caller_value_reaches_a_log_raw_and_no_line_is_forged(watched: Watched) -> None:
    """Every field the broker logs, fed CR, LF, ESC, C1 controls, forged lines and 10 KiB values:
    the access and audit lines (JSON and text), the broker's own messages and uvicorn's (JSON
    and text). No path, header value, body value, query or unverified claim reaches any of them,
    escaped or not (a reason names the input and the rule instead); a verified subject is
    written escaped; every line is one record of its log."""
    h = Hostile()
    sub = h.verified("subject")
    token = watched.broker.issue_kubernetes_token("team-h", sub)
    with watched.client(token) as http, status_server() as port:
        send_control_plane(watched, h, http)
        send_tokens(watched, h, http)
        send_data_plane(watched, h, http, port)
    with watched.client(watched.broker.issue_kubernetes_token("team-h", "alice")) as http:
        assert http.get("/v1/whoami").status_code == 200
    time.sleep(0.5)  # the last lines are written just after the answers
    outputs = watched.outputs()
    leaked = {(where, tag) for where, text in outputs.items() for tag in h.secrets if tag in text}
    assert not leaked, " ".join(sorted({tag for _, tag in leaked}))
    assert any(tag in outputs["access json"] for tag in h.escaped)  # the verified subject
    controls = {(where, repr(c)) for where, text in outputs.items() for c in CONTROLS
                if c in text.replace("\n", "") or (c == "\n" and "\r\n" in text)}  # fmt: skip
    assert not controls, sorted(controls)
    for where, text in outputs.items():
        assert PADDING not in text, where
        for line in text.split("\n")[:-1]:
            if where.endswith("json"):
                assert json.loads(line)["log"] in ("access", "audit", "broker"), (where, line)
            elif where.startswith("messages"):
                levels = ("DEBUG:", "INFO:", "WARNING:", "ERROR:", "CRITICAL:", "    ")
                assert line.startswith(levels), (where, line[:200])
            else:
                assert line.startswith("time=") and line.count(" log=") == 1, (where, line[:200])
    messages = outputs["messages text"]
    assert "the client went away during GET {data} port" in messages, messages[-3000:]
    assert "broke off mid-stream" in messages and "GET {data} port" in messages
    assert "rpc: deleting claim" in messages and "request_purpose" in messages


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_broker_serve_writes_hostile_values_in_no_line(tmp_path: Path, fmt: str) -> None:
    """``broker serve`` itself (its formatters installed for its messages and uvicorn's, its
    access and audit lines on standard output): a hostile path, method, request id and a token
    whose issuer is hostile reach none of its lines."""
    pki = Pki(tmp_path)
    pki.write(pki.issue())
    config = write_config(tmp_path, pki)
    config.write_text(config.read_text() + f'\n[logging]\nformat = "{fmt}"\n')
    server = Served.start([*CLI, "broker", "serve", "--config", str(config)])
    try:
        server.wait_started()
        h = Hostile()
        forged = forged_like(issuer=h.text("serve-iss", pad=False))
        heads = [
            f"DELETE /v1/sandboxes/{h.path('serve-path')} HTTP/1.1\r\nHost: x\r\n",
            f"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {forged}\r\n",
            "GET /v1/whoami HTTP/1.1\r\nHost: x\r\nX-Request-Id: ",
            f"Z{'serve-method'}Z{'M' * 10240} /v1/whoami HTTP/1.1\r\nHost: x\r\n",
        ]
        h.secrets.append("Zserve-methodZ")
        for index, head in enumerate(heads):
            text = head.encode("latin-1")
            if index == 2:
                text += h.header("serve-request-id") + b"\r\n"
            conn = socket.create_connection(("127.0.0.1", server.port), 10)
            with pki.context().wrap_socket(conn, server_hostname="127.0.0.1") as sock:
                sock.sendall(text + b"Connection: close\r\n\r\n")
                while sock.recv(65536):
                    pass
        time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(30)
    output = server.output()
    assert not [tag for tag in h.secrets if tag in output], output[-3000:]
    assert not [c for c in CONTROLS if c != "\n" and c in output], output[-3000:]
    # three reached the app; llhttp refuses the method it does not know (400, one warning)
    assert output.count("log=access" if fmt == "text" else '"log":"access"') >= 3, output
    assert "Invalid HTTP request received." in output
    for line in server.stderr:
        if fmt == "json" and line.startswith("{"):
            assert json.loads(line)["log"] == "broker"
        else:
            levels = ("INFO:", "WARNING:", "ERROR:", "DEBUG:", "    ", "agent-sandbox-awx broker:")
            assert line.startswith(levels), line


def forged_like(*, issuer: str) -> str:
    """A JWT-shaped token of ``issuer`` with a made-up signature."""
    import base64

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    claims = {"iss": issuer, "sub": "x", "aud": "https://sandbox-broker.example.com", "exp": 2**31}
    head = b64(json.dumps({"alg": "RS256", "kid": "k"}).encode())
    return f"{head}.{b64(json.dumps(claims).encode())}.{b64(b'x' * 64)}"
