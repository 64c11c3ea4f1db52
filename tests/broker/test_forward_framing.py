"""What the router forwards is what the broker checked: the method as received, and a body the
router frames itself.

- A data-plane method not in upper case is ``400 invalid_method``: HTTP methods are
  case-sensitive (RFC 9110, section 9.1) and httpx would forward ``post`` as ``POST``, a command
  run that the broker neither checked as ``POST`` nor counted.
- A ``GET`` (``HEAD``, ``DELETE``, ``OPTIONS``) with a body is ``400 invalid_request``; one with
  ``Content-Length: 0`` (what some clients send) is forwarded.
- The client's framing headers are never forwarded: a chunked body that also declares a
  ``Content-Length`` reaches the runtime whole (it was a ``500`` and an ASGI traceback).

Every request is sent byte for byte over TLS (no client library rewrites it).
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker


def _send(
    broker: LocalBroker, api: Any, sandbox: dict[str, Any], request_line: str, *extra: str
) -> tuple[int, bytes, bytes]:
    """``request_line`` and the headers ``extra`` (then the body, if one follows a blank
    entry) exactly as given; returns (status, raw head, body)."""
    url = urllib.parse.urlsplit(broker.url)
    host, port = url.hostname or "", url.port or 443
    lines = [request_line, f"Host: {host}:{port}", "Connection: close"]
    lines += [f"Authorization: Bearer {api.token}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in api.data_headers(sandbox).items()]
    headers, body = (list(extra), "")
    if "" in extra:
        at = extra.index("")
        headers, body = list(extra[:at]), "".join(extra[at + 1 :])
    context = ssl.create_default_context(cafile=broker.ca_bundle)
    with (
        socket.create_connection((host, port), timeout=15) as sock,
        context.wrap_socket(sock, server_hostname=host) as tls,
    ):
        data = "\r\n".join(lines + headers) + "\r\n\r\n" + body
        tls.sendall(data.encode("latin-1"))
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, rest


def _error(body: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads(body)
    return obj


@pytest.mark.parametrize("method", ["post", "Post", "pOST"])
def test_a_method_not_in_upper_case_is_refused_and_runs_nothing(
    broker: LocalBroker, alice: Any, tmp_path: Path, method: str
) -> None:
    sandbox = alice.ready()
    marker = tmp_path / "ran"
    body = json.dumps({"command": f"touch {marker}"})
    status, head, answer = _send(
        broker, alice, sandbox, f"{method} /execute HTTP/1.1", f"Content-Length: {len(body)}",
        "", body,
    )  # fmt: skip
    assert status == 400, answer
    error = _error(answer)
    assert error["code"] == "invalid_method", error
    assert "upper case" in error["detail"] and "RFC 9110" in error["detail"], error
    assert b"agent-sandbox-broker-error: invalid_method" in head.lower()
    assert not marker.exists()
    assert broker.execution_count(sandbox["name"]) == 0


def test_a_get_with_a_body_is_refused_and_one_with_an_empty_length_is_forwarded(
    broker: LocalBroker, alice: Any
) -> None:
    sandbox = alice.ready()
    target = "GET /fs/list?path=/app HTTP/1.1"
    status, _, answer = _send(broker, alice, sandbox, target, "Content-Length: 5", "", "hello")
    assert status == 400, answer
    error = _error(answer)
    assert error["code"] == "invalid_request" and "carries no body" in error["detail"], error
    chunked = ("Transfer-Encoding: chunked", "", "5\r\nhello\r\n0\r\n\r\n")
    status, _, answer = _send(broker, alice, sandbox, target, *chunked)
    assert (status, _error(answer)["code"]) == (400, "invalid_request"), answer
    status, _, answer = _send(broker, alice, sandbox, target, "Content-Length: 0")
    assert status == 200, answer


def test_a_chunked_body_with_a_content_length_reaches_the_runtime_whole(
    broker: LocalBroker, alice: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sandbox = alice.ready()
    body = json.dumps({"path": "/app/made-by-a-chunked-body"})
    chunked = f"{len(body):x}\r\n{body}\r\n0\r\n\r\n"
    status, _, answer = _send(
        broker, alice, sandbox, "POST /fs/mkdir HTTP/1.1",
        "Transfer-Encoding: chunked", "Content-Length: 5", "", chunked,
    )  # fmt: skip
    assert status == 200, answer
    listed = alice.http.get(
        "/fs/list", params={"path": "/app"}, headers=alice.data_headers(sandbox)
    )
    assert "made-by-a-chunked-body" in listed.text, listed.text
    assert "Exception in ASGI application" not in caplog.text
