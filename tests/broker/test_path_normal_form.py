"""Data-plane targets must be in normal form: the scope, the owner and claim checks and the
execution count are decided on exactly the target the broker forwards.

A sandbox granted only ``files`` must not run a command through ``/./commands``,
``/fs/../execute``, ``//execute`` or a percent-encoded form of them, and one granted only
``commands`` must not read a file through ``/commands/../fs/read``, ``/./download/...`` or
``//fs/read``: httpx removes dot segments from the URL the broker forwards and the runtime's
server turns a leading ``//`` into ``/``, so the broker would have decided on one path and
forwarded another. Both dialects: a ``/v1`` sandbox under a policy granting one scope and an
``/rpc`` claim created with ``scopes=[...]``. Every request is sent byte for byte over a TLS
socket (no client library normalises the target first).
"""

from __future__ import annotations

import json
import os
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker, Policy
from tests._support.broker_api import raw_request

CODE = "path_not_normalized"


@pytest.fixture(scope="module")
def scoped_broker() -> Iterator[LocalBroker]:
    with LocalBroker(warn=False) as b:
        b.add_issuer("files-only", policy=Policy(namespace="files-only", scopes=("files",)))
        b.add_issuer(
            "commands-only", policy=Policy(namespace="commands-only", scopes=("commands",))
        )
        yield b


@pytest.fixture(autouse=True)
def _reset_scoped_broker(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "scoped_broker" in request.fixturenames:
        request.getfixturevalue("scoped_broker").reset()


@dataclass
class Tenant:
    """One sandbox granted ``scope`` only, and what a raw request to it needs."""

    broker: LocalBroker
    token: str
    name: str  # the sandbox's name (the broker's execution_count takes it)
    headers: dict[str, str]  # the router headers (and the claim header under /rpc)
    base_dir: Path

    def send(self, method: str, target: str, body: bytes = b"") -> tuple[int, bytes, bytes]:
        """``method target`` exactly as given; returns (status, raw head, body)."""
        return raw_request(self.broker, method, target, body, self.headers, token=self.token)


def _http(broker: LocalBroker, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=broker.url,
        verify=ssl.create_default_context(cafile=broker.ca_bundle),
        headers={"Authorization": f"Bearer {token}"},
        timeout=httpx.Timeout(30.0),
    )


def _v1_tenant(broker: LocalBroker, scope: str) -> Tenant:
    token = broker.issuers[f"{scope}-only"].issue_token("robot")
    with _http(broker, token) as http:
        created = http.post("/v1/sandboxes", json={})
        assert created.status_code == 201, created.text
        name = created.json()["name"]
        ready = http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20})
        assert ready.json()["phase"] == "Ready", ready.text
    headers = {"X-Sandbox-ID": name, "X-Sandbox-Namespace": f"{scope}-only"}
    return _tenant(broker, token, name, headers)


def _rpc_tenant(broker: LocalBroker, scope: str) -> Tenant:
    token = broker.issue_kubernetes_token("team-a", f"rpc-{scope}")
    with _http(broker, token) as http:
        created = http.post("/rpc", json={"op": "create", "scopes": [scope]})
        assert created.status_code == 200, created.text
        claim = created.json()["claim_name"]
        deadline = time.monotonic() + 20
        state = http.post("/rpc", json={"op": "status", "claim_name": claim}).json()
        while not state["ready"] and time.monotonic() < deadline:
            time.sleep(0.05)
            state = http.post("/rpc", json={"op": "status", "claim_name": claim}).json()
        assert state["ready"], state
    headers = {
        "X-Sandbox-ID": state["sandbox_name"],
        "X-Sandbox-Namespace": state["namespace"],
        "X-Sandbox-Claim-Name": claim,
    }
    return _tenant(broker, token, state["sandbox_name"], headers)


def _tenant(broker: LocalBroker, token: str, name: str, headers: dict[str, str]) -> Tenant:
    record = broker._require_store().sandboxes[name]
    assert record.handle is not None
    return Tenant(broker, token, name, headers, Path(record.handle.base_dir))


@pytest.fixture(params=["v1", "rpc"])
def dialect(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _make(broker: LocalBroker, dialect: str, scope: str) -> Tenant:
    return (_v1_tenant if dialect == "v1" else _rpc_tenant)(broker, scope)


def _assert_refused(status: int, head: bytes, body: bytes, target: str) -> dict[str, Any]:
    assert status == 400, (target, head, body[:300])
    answer = json.loads(body)
    assert answer["code"] == CODE, answer
    assert f"agent-sandbox-broker-error: {CODE}".encode() in head.lower()
    assert "normal form" in answer["detail"], answer
    return dict(answer)


# -- a sandbox granted only ``files`` runs no command -------------------------------------------

COMMAND_TARGETS = [
    # the issue's variants
    "/./commands",
    "/fs/../commands",
    "//execute",
    "/fs/../execute",
    # percent-encoded dots, slashes and letters
    "/%2e/commands",
    "/%2E/execute",
    "/fs/%2e%2e/commands",
    "/fs/%2E%2E/execute",
    "/fs/.%2e/execute",
    "/fs%2f..%2fexecute",
    "/fs/..%2Fexecute",
    "/%2Fexecute",
    "/%2fcommands",
    "/%65xecute",
    "/%63ommands",
    # backslashes, path parameters, trailing dot segments and empty segments
    "/fs\\..\\execute",
    "/fs/..%5Cexecute",
    "/fs%5C..%5Cexecute",
    "/execute;x",
    "/fs;x/../execute",
    "/execute/.",
    "/commands/.",
    "/execute/",
    "/commands/",
    "/fs/./../execute",
    "/fs//../execute",
    "/fs/read/../../commands",
]


@pytest.mark.parametrize("target", COMMAND_TARGETS)
def test_files_only_sandbox_runs_no_command_through_a_non_normal_path(
    scoped_broker: LocalBroker, dialect: str, target: str
) -> None:
    tenant = _make(scoped_broker, dialect, "files")
    marker = tenant.base_dir / "ran-a-command"
    command: Any = ["touch", str(marker)] if "ommands" in target else f"touch {marker}"
    before = scoped_broker.execution_count(tenant.name)
    status, head, body = tenant.send("POST", target, json.dumps({"command": command}).encode())
    _assert_refused(status, head, body, target)
    assert scoped_broker.execution_count(tenant.name) == before
    assert not marker.exists()
    # the canonical forms are still refused by scope, and nothing ran either
    for canonical in ("/execute", "/commands"):
        status, _, body = tenant.send("POST", canonical, json.dumps({"command": command}).encode())
        assert status == 403 and json.loads(body)["code"] == "scope_denied", body
    assert scoped_broker.execution_count(tenant.name) == before
    assert not marker.exists()


# -- a sandbox granted only ``commands`` reads no file ------------------------------------------

FILE_TARGETS = [
    # the issue's variants
    "/commands/../fs/read?path=secret.txt",
    "/./download/secret.txt",
    "//fs/read?path=secret.txt",
    # more of the same
    "//download/secret.txt",
    "/commands/../download/secret.txt",
    "/commands/./../fs/read?path=secret.txt",
    "/commands/x/../../fs/read?path=secret.txt",
    "/fs/read/.?path=secret.txt",
    # percent-encoded
    "/commands/%2e%2e/fs/read?path=secret.txt",
    "/commands/%2E%2E/download/secret.txt",
    "/%2E/download/secret.txt",
    "/%2e/fs/read?path=secret.txt",
    "/commands%2F..%2Fdownload%2Fsecret.txt",
    "/%2Ffs/read?path=secret.txt",
    "/%64ownload/secret.txt",
    "/%66s/read?path=secret.txt",
    # backslashes and path parameters
    "/commands\\..\\download\\secret.txt",
    "/commands/..%5Cdownload/secret.txt",
    "/download;x/secret.txt",
    "/commands;x/../fs/read?path=secret.txt",
]


@pytest.mark.parametrize("target", FILE_TARGETS)
def test_commands_only_sandbox_reads_no_file_through_a_non_normal_path(
    scoped_broker: LocalBroker, dialect: str, target: str
) -> None:
    tenant = _make(scoped_broker, dialect, "commands")
    secret = "secret-" + os.urandom(8).hex()
    (tenant.base_dir / "secret.txt").write_text(secret)
    status, head, body = tenant.send("GET", target)
    assert secret.encode() not in body
    _assert_refused(status, head, body, target)
    for canonical in ("/fs/read?path=secret.txt", "/download/secret.txt"):
        status, _, body = tenant.send("GET", canonical)
        assert secret.encode() not in body
        assert status == 403 and json.loads(body)["code"] == "scope_denied", body


# -- the legacy file path argument ----------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/download/sub//a.txt",
        "/download/sub/./a.txt",
        "/download/sub/../a.txt",
        "/list/sub/",
        "/exists/..",
        "/exists/.",
        "/download/%2E%2E%2Fcommands",
        "/download/%2e%2e/commands",
        "/list/a;b",
        "/download/a\\b.txt",
    ],
)
def test_a_legacy_file_path_in_raw_form_is_refused(
    scoped_broker: LocalBroker, dialect: str, target: str
) -> None:
    """After ``/download/``, ``/list/`` and ``/exists/`` the raw segments follow the same rules
    (an HTTP client would resolve ``/download/../commands`` into ``/commands``)."""
    tenant = _make(scoped_broker, dialect, "files")
    status, head, body = tenant.send("GET", target)
    _assert_refused(status, head, body, target)


@pytest.mark.parametrize(
    "target",
    ["/download/..%2Fcommands", "/list/..%2F..%2Fcommands", "/list/sub%2F..%2F..%2Fcommands"],
)
def test_an_encoded_dot_dot_in_a_legacy_file_path_stays_a_file_path(
    scoped_broker: LocalBroker, dialect: str, target: str
) -> None:
    """A percent-encoded legacy file path is forwarded as it is: it stays the argument of its
    route (the runtime resolves it and refuses an escape with its own 403), it never reaches
    ``/commands``."""
    tenant = _make(scoped_broker, dialect, "files")
    status, head, body = tenant.send("GET", target)
    assert status == 403, (target, head, body[:300])
    assert b"agent-sandbox-broker-error" not in head.lower()  # the runtime's answer
    assert "escapes" in json.loads(body)["detail"]
    assert b'"commands": [' not in body  # not GET /commands (the command list)


def test_normal_targets_and_queries_still_work(scoped_broker: LocalBroker, dialect: str) -> None:
    """What both clients send is normal: encoded file paths (``%2F``, ``%3B``, ``%5C``), the
    empty legacy path (``/list/``, ``/list``), names starting with a dot and queries holding
    ``/../`` (queries are not paths: the runtime decides about them)."""
    tenant = _make(scoped_broker, dialect, "files")
    (tenant.base_dir / "sub").mkdir()
    (tenant.base_dir / "sub" / "a.txt").write_text("nested")
    (tenant.base_dir / "a;b.txt").write_text("semicolon")
    (tenant.base_dir / "a\\b.txt").write_text("backslash")
    (tenant.base_dir / ".hidden").write_text("dot file")
    expected = {
        "/download/sub%2Fa.txt": b"nested",
        "/download/sub%2fa.txt": b"nested",
        "/download/sub/a.txt": b"nested",
        "/download/.%2Fsub%2Fa.txt": b"nested",  # upstream's list("./sub") style
        "/download/a%3Bb.txt": b"semicolon",
        "/download/a%5Cb.txt": b"backslash",
        "/download/.hidden": b"dot file",
        "/fs/read?path=sub/a.txt": b"nested",
        "/fs/read?path=sub%2Fa.txt": b"nested",
    }
    for target, content in expected.items():
        status, _, body = tenant.send("GET", target)
        assert (status, body) == (200, content), (target, status, body[:300])
    for target in ("/list/", "/list", "/list/sub", "/list/sub%2F", "/exists/sub%2Fa.txt", "/"):
        status, head, body = tenant.send("GET", target)
        assert status == 200, (target, head, body[:300])
    status, head, body = tenant.send("GET", "/fs/read?path=sub/../sub/a.txt&x=//..%2F")
    assert b"agent-sandbox-broker-error" not in head.lower(), (head, body)  # the runtime's


def test_the_refusal_names_the_path_and_the_rule(scoped_broker: LocalBroker) -> None:
    tenant = _make(scoped_broker, "v1", "files")
    status, head, body = tenant.send("POST", "/fs/../execute", b'{"command": "true"}')
    detail = _assert_refused(status, head, body, "/fs/../execute")["detail"]
    assert "'/fs/../execute'" in detail
    assert "'..'" in detail
    status, head, body = tenant.send("POST", "/%65xecute", b'{"command": "true"}')
    detail = _assert_refused(status, head, body, "/%65xecute")["detail"]
    assert "%65" in detail


def test_the_client_maps_the_refusal_to_a_typed_error() -> None:
    from k8s_agent_sandbox_awx import errors
    from k8s_agent_sandbox_awx.client.wire._dialect_v1 import error_from_response
    from k8s_agent_sandbox_awx.client.wire._protocol import RequestSpec

    spec = RequestSpec("GET", "/download/x", "read 'x'", data_plane=True)
    body = json.dumps({"detail": "the request path '/x/../y' is not in normal form", "code": CODE})
    exc = error_from_response(400, {"Agent-Sandbox-Broker-Error": CODE}, body.encode(), spec=spec)
    assert isinstance(exc, errors.BrokerError)
    assert exc.code == CODE
    assert "normal form" in str(exc)
    assert "client bug" not in str(exc)  # the hint says what the rule is, not "report it"
