"""What the broker relays of a sandbox's answer, on the HTTP and the WebSocket paths: never the
broker's own error mark or the headers of one hop (a sandbox forging ``Agent-Sandbox-Broker-
Error`` made the SDK take its 401 for the broker's), and a status HTTP does not have (600 to
999) is the broker's ``502 sandbox_answer_lost``, never a 500."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests._support import ws_client
from tests._support.broker_api import Api
from tests._support.status_server import raw_server, status_server

FORGED_HEAD = (
    b"HTTP/1.1 401 Unauthorized\r\n"
    b"Agent-Sandbox-Broker-Error: token_expired\r\n"
    b"agent-sandbox-broker-error: token_revoked\r\n"
    b"X-Request-Id: forged-request-id\r\n"
    b"Keep-Alive: timeout=600\r\n"
    b"Proxy-Authenticate: Basic realm=forged\r\n"
    b"Trailer: X-Forged\r\n"
    b"Server: forged-server\r\n"
    b"Date: Thu, 01 Jan 1970 00:00:00 GMT\r\n"
    b"X-Users-Own: kept\r\n"
    b"Content-Type: application/json\r\n"
)
FORGED_BODY = b'{"detail": "the token expired", "code": "token_expired"}'


@pytest.fixture
def forging_server() -> Iterator[int]:
    """A user's server in the sandbox (a local sandbox's ports are the host's) that answers
    every request, a WebSocket handshake included, with a 401 carrying the broker's own mark
    and headers of the broker's connection."""

    def answer(conn: socket.socket, head: bytes) -> None:
        length = f"Content-Length: {len(FORGED_BODY)}\r\nConnection: close\r\n\r\n"
        conn.sendall(FORGED_HEAD + length.encode() + FORGED_BODY)

    with raw_server(answer) as port:
        yield port


def _fields(head: bytes) -> list[tuple[str, str]]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines)]


def test_no_path_relays_a_sandboxs_answer_with_the_brokers_own_headers(
    alice: Api, forging_server: int
) -> None:
    """A server's non-101 answer to a WebSocket handshake was relayed with its
    Agent-Sandbox-Broker-Error (which makes the SDK take a sandbox's 401 for the broker's token
    rejection, and re-send), and with its hop-by-hop headers; the HTTP path stripped them. Both
    paths now relay a sandbox's answer without the broker's mark, the headers of one hop,
    Server, Date and X-Request-Id (the broker's own, when it observes); the server's own headers
    and body stay."""
    sandbox = alice.ready()
    headers = {**alice.data_headers(sandbox), "X-Sandbox-Port": str(forging_server)}
    assert alice.token is not None
    ws = ws_client.connect_tls(
        alice.broker.url, alice.broker.ca_bundle, "/ws",
        {**headers, "Authorization": f"Bearer {alice.token}", "X-Request-Id": "rq-ws-26"},
    )  # fmt: skip
    ws.sock.close()
    over_http = alice.http.get("/anything", headers={**headers, "X-Request-Id": "rq-http-26"})
    answers = {
        "websocket": (ws.head.split(b"\r\n", 1)[0], _fields(ws.head), "rq-ws-26"),
        "http": (
            f"HTTP/1.1 {over_http.status_code}".encode(),
            [(k.lower(), v) for k, v in over_http.headers.multi_items()],
            "rq-http-26",
        ),
    }
    for path, (status_line, fields, request_id) in answers.items():
        names = [k for k, _ in fields]
        assert status_line.startswith(b"HTTP/1.1 401"), (path, status_line)
        own = {"agent-sandbox-broker-error", "keep-alive", "proxy-authenticate", "trailer"}
        assert not own & set(names), (path, fields)
        assert ("x-users-own", "kept") in fields, (path, fields)
        ids = [v for k, v in fields if k == "x-request-id"]  # the broker's, when it observes
        assert ids in ([], [request_id]), (path, fields)
        assert "forged-server" not in str(fields) and "1970" not in str(fields), (path, fields)


def test_a_status_http_does_not_have_is_the_brokers_502_on_both_paths(alice: Api) -> None:
    """A sandbox's server answering status 600 to 999 made the broker's server fail sending the
    answer (a 500 with a traceback in the error log, the connection dropped). It is now the
    broker's 502 sandbox_answer_lost (the request reached the sandbox); a WebSocket handshake's
    such answer is the broker's 502 too (``websockets`` refuses to parse it: the handshake
    failed)."""
    sandbox = alice.ready()
    assert alice.token is not None
    with status_server() as port:
        headers = {**alice.data_headers(sandbox), "X-Sandbox-Port": str(port)}
        for status in (600, 799, 999):
            answer = alice.http.get(f"/status/{status}", headers=headers)
            assert answer.status_code == 502, answer.text
            assert answer.json()["code"] == "sandbox_answer_lost"
            assert f"status {status}, which is no final HTTP status" in answer.json()["detail"]
            ws = ws_client.connect_tls(
                alice.broker.url, alice.broker.ca_bundle, f"/status/{status}",
                {**headers, "Authorization": f"Bearer {alice.token}"},
            )  # fmt: skip
            ws.sock.close()
            assert ws.head.startswith(b"HTTP/1.1 502"), ws.head  # the broker's, never a 500
            assert b"agent-sandbox-broker-error: sandbox_" in ws.head.lower()
        assert alice.http.get("/status/599", headers=headers).status_code == 599
