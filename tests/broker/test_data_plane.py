"""Data plane: router headers, owner-only access, header stripping, streaming, 502/504."""

from __future__ import annotations

import hashlib
import os
import signal
import time
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
    assert resp.json()["code"] == "sandbox_unreachable"


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


def test_dead_runtime_is_unreachable(broker: LocalBroker, alice: Any) -> None:
    sandbox = alice.ready()
    pid = broker.runtime_pid(sandbox["name"])
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)
    resp = alice.http.get("/", headers=alice.data_headers(sandbox))
    assert resp.status_code in (409, 502)
    state = alice.http.get(f"/v1/sandboxes/{sandbox['name']}").json()
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


def test_control_characters_in_path_are_invalid(alice: Any) -> None:
    sandbox = alice.ready()
    resp = alice.http.get("/download/a%00b", headers=alice.data_headers(sandbox))
    assert resp.status_code == 400
    assert resp.json()["code"] == "invalid_path"
