"""``broker serve``'s request targets, as the caller sent them (httptools' URL parser would
take the path out of an absolute target and drop a fragment): what is not origin-form is 400
and reaches nothing, the app's path and query are the target's own."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator

import pytest

from tests._support.served_broker import ServedBroker, served_broker

pytest.importorskip("uvicorn", reason="needs the [broker] extra")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedBroker]:
    with served_broker(tmp_path_factory.mktemp("targets")) as broker:
        yield broker


def _exchange(broker: ServedBroker, target: str) -> tuple[int, bytes]:
    raw = socket.create_connection(("127.0.0.1", broker.port), timeout=30)
    with broker.tls().wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(
            f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            f"{broker.token()}\r\nConnection: close\r\n\r\n".encode()
        )
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (ssl.SSLError, OSError):
            pass
    return int(answer.split(b" ", 2)[1]), answer


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.1:{port}/v1/whoami",
        "http://127.0.0.1:{port}@127.0.0.1:{port}/v1/whoami",
        "/v1/whoami#fragment",
    ],
)
def test_a_target_that_is_not_origin_form_is_refused_by_the_gate(
    served: ServedBroker, target: str
) -> None:
    status, answer = _exchange(served, target.format(port=served.port))
    assert status == 400, answer[:500]
    assert b'"code":"invalid_path"' in answer.replace(b" ", b""), answer[:500]


@pytest.mark.parametrize("target", ["@127.0.0.1:1/v1/whoami", "127.0.0.1:1", "*"])
def test_a_target_the_parser_refuses_is_400(served: ServedBroker, target: str) -> None:
    status, answer = _exchange(served, target)
    assert status == 400, answer[:500]


def test_the_app_gets_the_path_and_query_as_sent(served: ServedBroker) -> None:
    status, answer = _exchange(served, "/v1/who%61mi?x=%2F")
    assert status == 200, answer[:500]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["subject"]
    status, answer = _exchange(served, "//127.0.0.1:1/v1/whoami")  # a path: no authority
    assert status == 404, answer[:500]
