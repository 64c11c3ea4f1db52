"""Data plane: router headers, owner-only access, header stripping, streaming, 502/504."""

from __future__ import annotations

import hashlib
import os
import select
import signal
import socket
import ssl
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("X-Sandbox-ID", "Not_A_Label"),
        ("X-Sandbox-ID", "a" * 64),
        ("X-Sandbox-ID", "-leading"),
        ("X-Sandbox-Namespace", "UPPER"),
        ("X-Sandbox-Port", "0"),
        ("X-Sandbox-Port", "65536"),
        ("X-Sandbox-Port", "80a"),
        ("X-Sandbox-Timeout", "-1"),
        ("X-Sandbox-Timeout", "soon"),
    ],
)
def test_router_header_validation(alice: Any, header: str, value: str) -> None:
    sandbox = alice.ready()
    headers = alice.data_headers(sandbox, **{header: value})
    resp = alice.http.get("/", headers=headers)
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == "invalid_header"
    assert header in resp.json()["detail"]


def test_owner_only_even_same_provider_and_namespace(alice: Any, bob: Any) -> None:
    sandbox = alice.ready()
    assert alice.http.get("/", headers=alice.data_headers(sandbox)).status_code == 200
    resp = bob.run(sandbox, "touch should-not-exist")
    assert resp.status_code == 403
    assert resp.json()["code"] == "not_owner"
    listing = alice.http.get("/list/", headers=alice.data_headers(sandbox)).json()
    assert listing == []


def test_other_provider_is_not_owner(broker: LocalBroker, alice: Any, api: Any) -> None:
    sandbox = alice.ready()
    gitlab = api(broker.issue_gitlab_token("team-a/alice"))
    resp = gitlab.http.get("/", headers=alice.data_headers(sandbox))
    assert resp.status_code == 403
    assert resp.json()["code"] == "not_owner"


def test_data_plane_needs_a_valid_token(broker: LocalBroker, alice: Any, api: Any) -> None:
    sandbox = alice.ready()
    resp = api(None).http.get("/", headers=alice.data_headers(sandbox))
    assert resp.status_code == 401
    assert resp.json()["code"] == "token_missing"


def test_only_the_brokers_own_errors_carry_its_mark(
    broker: LocalBroker, alice: Any, api: Any
) -> None:
    """The broker marks its own error answers (Agent-Sandbox-Broker-Error: code) and strips the
    mark from what it forwards, so a runtime cannot pass its 401 off as the broker's token
    rejection (which would make the client re-send a command)."""
    sandbox = alice.ready(template="echo")
    own = api(None).http.get("/", headers=alice.data_headers(sandbox))
    assert own.status_code == 401
    assert own.headers["agent-sandbox-broker-error"] == own.json()["code"] == "token_missing"
    forged = alice.http.get("/forge-401", headers=alice.data_headers(sandbox))
    assert forged.status_code == 401 and forged.json()["code"] == "token_expired"
    assert "agent-sandbox-broker-error" not in forged.headers
    control = alice.http.get("/v1/sandboxes/no-such-sandbox")
    assert control.status_code == 404
    assert control.headers["agent-sandbox-broker-error"] == "not_found"


def test_unknown_sandbox_wrong_namespace_and_not_ready(broker: LocalBroker, alice: Any) -> None:
    resp = alice.http.get(
        "/", headers={"X-Sandbox-ID": "sbx-nope", "X-Sandbox-Namespace": "team-a"}
    )
    assert resp.status_code == 404
    assert resp.json()["code"] == "not_found"
    sandbox = alice.ready()
    resp = alice.http.get("/", headers=alice.data_headers(sandbox, **{"X-Sandbox-Namespace": "x"}))
    assert resp.status_code == 404
    broker.set_readiness_delay(1.0)
    pending = alice.create().json()
    resp = alice.http.get("/", headers=alice.data_headers(pending))
    assert resp.status_code == 409
    assert resp.json()["code"] == "not_ready"


def test_default_namespace_header(broker: LocalBroker, api: Any) -> None:
    client = api(broker.issue_kubernetes_token("default", "someone"))
    sandbox = client.ready()
    resp = client.http.get("/", headers={"X-Sandbox-ID": sandbox["name"]})
    assert resp.status_code == 200
    assert resp.json()["status"] == "ok"


def test_authorization_and_host_are_stripped(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready(template="echo")
    resp = alice.http.post(
        "/anything?x=1",
        content=b"payload",
        headers=alice.data_headers(sandbox, **{"X-Custom": "kept", "Cookie": "c=1"}),
    )
    assert resp.status_code == 200
    seen = resp.json()
    assert seen["path"] == "/anything?x=1"
    assert seen["body_size"] == len(b"payload")
    headers = seen["headers"]
    assert "authorization" not in headers
    assert alice.token not in resp.text
    assert headers["host"] != broker.url.removeprefix("https://")
    assert headers["x-custom"] == "kept"
    assert not any(name.startswith("x-sandbox-") for name in headers)


def test_other_port_is_unreachable(alice: Any) -> None:
    sandbox = alice.ready()
    resp = alice.http.get("/", headers=alice.data_headers(sandbox, **{"X-Sandbox-Port": "9999"}))
    assert resp.status_code == 502
    # issue 23: a port nothing listens on is its own typed error (it was sandbox_unreachable)
    assert resp.json()["code"] == "port_not_listening"


def test_sandbox_timeout_honours_header(alice: Any) -> None:
    sandbox = alice.ready()
    started = time.monotonic()
    resp = alice.http.post(
        "/execute",
        json={"command": "sleep 5"},
        headers=alice.data_headers(sandbox, **{"X-Sandbox-Timeout": "0.5"}),
    )
    assert resp.status_code == 504
    assert resp.json()["code"] == "sandbox_timeout"
    assert time.monotonic() - started < 4


def test_a_request_the_runtime_got_then_lost_is_answer_lost_and_counted(
    broker: LocalBroker, alice: Any
) -> None:
    """The runtime read the request, then its connection broke: the broker's 502 says the
    request may have reached the sandbox (``sandbox_answer_lost``, never the
    ``sandbox_unreachable`` of a request that was not sent), and the execution counts."""
    sandbox = alice.ready(template="echo")
    headers = alice.data_headers(sandbox, **{"X-Test-Drop": "1"})
    resp = alice.http.post("/execute", json={"command": "true"}, headers=headers)
    assert resp.status_code == 502, resp.text
    assert resp.json()["code"] == "sandbox_answer_lost", resp.text
    assert "may have reached the sandbox" in resp.json()["detail"]
    assert broker.execution_count(sandbox["name"]) == 1


def test_dead_runtime_is_unreachable(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready()
    pid = broker.runtime_pid(sandbox["name"])
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)
    resp = alice.http.get("/", headers=alice.data_headers(sandbox))
    assert resp.status_code in (409, 502)
    # The exit reaches the broker as the fork server's report, a moment after the kill (in
    # bubblewrap, once bwrap has seen its child die): the state follows within seconds.
    deadline = time.monotonic() + 10
    while True:
        state = alice.http.get(f"/v1/sandboxes/{sandbox['name']}").json()
        if state["phase"] != "Ready" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert state["phase"] == "Failed"
    assert state["reason"] == "RuntimeExited"


def _chunks(total: int, size: int = 1024 * 1024) -> Iterator[bytes]:
    block = bytes(range(256)) * (size // 256)
    sent = 0
    while sent < total:
        piece = block[: min(size, total - sent)]
        sent += len(piece)
        yield piece


def test_streamed_upload_and_download_round_trip(alice: Any) -> None:
    sandbox = alice.ready()
    total = 48 * 1024 * 1024
    boundary = "agent-sandbox-test-boundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="big/blob.bin"\r\nContent-Type: application/octet-stream\r\n\r\n'
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    digest = hashlib.sha256()

    def body() -> Iterator[bytes]:
        yield head
        for chunk in _chunks(total):
            digest.update(chunk)
            yield chunk
        yield tail

    resp = alice.http.post(  # a generator body: sent chunked, never held in memory
        "/upload",
        content=body(),
        headers=alice.data_headers(
            sandbox, **{"Content-Type": f"multipart/form-data; boundary={boundary}"}
        ),
    )
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"path": "big/blob.bin", "size": total}
    received = hashlib.sha256()
    size = 0
    with alice.http.stream(
        "GET", "/download/big%2Fblob.bin", headers=alice.data_headers(sandbox)
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"] == "application/octet-stream"
        assert int(stream.headers["content-length"]) == total
        for chunk in stream.iter_raw():
            received.update(chunk)
            size += len(chunk)
    assert size == total
    assert received.hexdigest() == digest.hexdigest()


# "%3F" and "%23" decode to "?" and "#": the check reads the whole decoded path, never a URL
# rebuilt from it (where the control character would be in its query or fragment)
@pytest.mark.parametrize("target", ["/download/a%00b", "/download/a%3F%0Ab", "/download/a%23%7F"])
def test_control_characters_in_path_are_invalid(alice: Any, target: str) -> None:
    sandbox = alice.ready()
    resp = alice.http.get(target, headers=alice.data_headers(sandbox))
    assert resp.status_code == 400
    assert resp.json()["code"] == "invalid_path"


def _raw_exchange(broker: LocalBroker, request_line: str, headers: dict[str, str]) -> bytes:
    """Send one request with exactly ``request_line`` over a TLS socket to the broker (no
    client library to normalise the target) and return the whole raw answer."""
    url = urllib.parse.urlsplit(broker.url)
    host, port = url.hostname or "", url.port or 443
    context = ssl.create_default_context(cafile=broker.ca_bundle)
    lines = [request_line, f"Host: {host}:{port}", "Connection: close", "Content-Length: 0"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    with (
        socket.create_connection((host, port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        tls.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    return answer


@pytest.fixture
def canary() -> Iterator[socket.socket]:
    """A loopback TCP listener that no request of the test may reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener


def _reached(listener: socket.socket) -> bool:
    readable, _, _ = select.select([listener], [], [], 0.2)
    return bool(readable)


@pytest.mark.parametrize(
    "form",
    [
        "@127.0.0.1:{port}/download/secret.txt",
        "http://127.0.0.1:{port}/download/secret.txt",
        "http://127.0.0.1:{port}@127.0.0.1:{port}/download/secret.txt",
        "127.0.0.1:{port}",
        "*",
    ],
)
def test_request_target_cannot_redirect_the_forward(
    broker: LocalBroker, alice: Any, bob: Any, canary: socket.socket, form: str
) -> None:
    """A request target that is not origin-form ('/' + path) is 400 and reaches nothing: not
    another tenant's runtime (the owner check passed for the caller's own sandbox) and not any
    other loopback service."""
    mine = alice.ready()
    theirs = bob.ready()
    marker = "tenant-b-secret-" + os.urandom(8).hex()
    written = bob.run(theirs, f"python3 -c \"open('secret.txt', 'w').write('{marker}')\"")
    assert written.json()["exit_code"] == 0, written.text
    handle = broker._require_store().sandboxes[theirs["name"]].handle
    assert handle is not None
    headers = {"Authorization": f"Bearer {alice.token}", **alice.data_headers(mine)}
    for port in (handle.port, canary.getsockname()[1]):
        answer = _raw_exchange(broker, f"GET {form.format(port=port)} HTTP/1.1", headers)
        assert marker.encode() not in answer
        status = int(answer.split(b" ", 2)[1])
        assert status == 400, answer[:500]
        assert b'"code":"invalid_path"' in answer.replace(b" ", b"")
        assert b"origin-form" in answer
    assert not _reached(canary)


def test_request_target_with_a_fragment_is_refused(broker: LocalBroker, alice: Any) -> None:
    """A target with a fragment ('#', never part of a request target) is 400, not a 500."""
    mine = alice.ready()
    headers = {"Authorization": f"Bearer {alice.token}", **alice.data_headers(mine)}
    answer = _raw_exchange(broker, "GET /download/a#b HTTP/1.1", headers)
    assert int(answer.split(b" ", 2)[1]) == 400, answer[:500]
    assert b'"code":"invalid_path"' in answer.replace(b" ", b"")
