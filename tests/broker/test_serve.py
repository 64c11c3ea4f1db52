"""The broker's server runtime, as real subprocesses over real HTTPS on loopback: the
certificate re-loaded when its files change, SIGTERM's grace, ``/healthz`` and ``/readyz``."""

from __future__ import annotations

import http.client
import json
import socket
import sys
import time
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx._upstream import SandboxError
from tests._support.broker_server import (
    CLI,
    STREAMING_APP,
    Pki,
    Served,
    peer_serial,
    write_config,
)
from tests._support.kube import free_ports
from tests._support.oidc_issuer import BackgroundIssuer

pytest.importorskip("uvicorn", reason="needs the [broker] extra")

MARGIN = 8.0
"""Seconds a stop may take beyond the grace (the interpreter's exit, a loaded machine: 3 s was
not enough on a CI machine at load 16); well under the 30 s grace that "at once" is told from."""


def _serve(started: list[Served], config: Path, *, app: bool = False, **env: str) -> Served:
    argv = (
        [sys.executable, str(STREAMING_APP), str(config)]
        if app
        else [*CLI, "broker", "serve", "--config", str(config)]
    )
    server = Served.start(argv, env=env)
    started.append(server)
    server.wait_started()
    return server


def _connect(pki: Pki, server: Served, timeout: float = 10.0) -> http.client.HTTPSConnection:
    conn = http.client.HTTPSConnection(
        "127.0.0.1", server.port, context=pki.context(), timeout=timeout
    )
    conn.connect()
    return conn


def _get(conn: http.client.HTTPSConnection, path: str, method: str = "GET") -> tuple[int, bytes]:
    conn.request(method, path)
    response = conn.getresponse()
    return response.status, response.read()


def _serial_of_a_new_connection(pki: Pki, server: Served) -> int:
    conn = _connect(pki, server)
    try:
        assert conn.sock is not None
        return peer_serial(conn.sock)  # type: ignore[arg-type]
    finally:
        conn.close()


def _until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


# ------------------------------------------------------------------------- certificate reload


def test_a_rotated_certificate_is_served_to_new_connections_old_ones_keep_theirs(
    pki: Pki, tmp_path: Path, started: list[Served]
) -> None:
    first = pki.write(pki.issue())
    server = _serve(started, write_config(tmp_path, pki))
    old = _connect(pki, server)  # a keep-alive connection, open across the rotation
    assert old.sock is not None and peer_serial(old.sock) == first  # type: ignore[arg-type]
    assert _get(old, "/healthz")[0] == 200
    second = pki.write(pki.issue())
    assert second != first
    _until(lambda: _serial_of_a_new_connection(pki, server) == second)
    assert _get(old, "/healthz") == (200, b'{"status": "alive"}')  # the same connection
    assert peer_serial(old.sock) == first  # type: ignore[arg-type]
    old.close()
    assert "re-loaded: new connections get the new certificate" in server.output()


def test_a_broken_rotation_keeps_the_old_certificate_and_logs_one_error(
    pki: Pki, tmp_path: Path, started: list[Served]
) -> None:
    first = pki.write(pki.issue())
    server = _serve(started, write_config(tmp_path, pki))
    stranger = pki.issue()
    broken = pki.issue()
    pki.write(broken, key=stranger)  # a key that does not belong to the certificate
    _until(lambda: "does not belong to the certificate" in server.output())

    def errors() -> list[str]:
        return [line for line in server.stderr if "cannot be used" in line]

    # the two files are replaced one after the other: a check between the two renames sees
    # another broken pair (the new certificate, the old key), logged once too
    time.sleep(0.5)
    seen = len(errors())
    assert seen in (1, 2), server.output()
    time.sleep(1.0)  # five more checks of the same broken pair: nothing more is logged
    assert len(errors()) == seen, server.output()
    errors_now = errors()
    assert all("does not belong to the certificate" in line for line in errors_now)
    assert str(pki.cert_file) in errors_now[-1] and str(pki.key_file) in errors_now[-1]
    assert "still serving the previous certificate" in errors_now[-1]
    assert "PRIVATE KEY" not in server.output()  # paths, never contents
    assert _serial_of_a_new_connection(pki, server) == first
    pki.key_file.write_bytes(b"not a key")  # another broken state: logged once more
    _until(lambda: "holds no PEM private key" in server.output())
    assert _serial_of_a_new_connection(pki, server) == first
    fixed = pki.write(broken)  # the pair made whole: taken at the next check
    _until(lambda: _serial_of_a_new_connection(pki, server) == fixed)


def test_a_pair_that_cannot_be_used_at_start_is_a_configuration_error(
    pki: Pki, tmp_path: Path
) -> None:
    import subprocess

    pki.write(pki.issue(), key=pki.issue())
    config = write_config(tmp_path, pki)
    run = subprocess.run(
        [*CLI, "broker", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "the private key does not belong to the certificate" in run.stderr
    assert str(pki.cert_file) in run.stderr and str(pki.key_file) in run.stderr
    assert "server.tls_cert_file, server.tls_key_file" in run.stderr
    assert "Traceback" not in run.stderr


# ---------------------------------------------------------------------------------- SIGTERM


def test_sigterm_lets_an_in_flight_stream_finish_and_refuses_new_connections(
    pki: Pki, tmp_path: Path, started: list[Served]
) -> None:
    grace = 8.0
    config = write_config(tmp_path, pki, shutdown_grace_seconds=grace)
    server = _serve(started, config, app=True, READY_FLAG=str(tmp_path / "flag"))
    conn = _connect(pki, server)
    conn.request("GET", "/stream?chunks=8&interval=0.25")
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline() == b"chunk 0\n"
    sent = server.terminate()
    time.sleep(0.5)
    assert server.process.poll() is None  # still finishing the stream
    with pytest.raises(ConnectionRefusedError):  # but no longer accepting
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    rest = response.read()
    assert rest.splitlines()[-1] == b"done" and b"chunk 7\n" in rest
    assert server.wait(grace + MARGIN) == 0
    assert time.monotonic() - sent < grace  # it did not wait out the grace
    assert "streaming app: stopped" in server.output()


def test_sigterm_cuts_what_is_left_after_the_grace_and_exits_0(
    pki: Pki, tmp_path: Path, started: list[Served]
) -> None:
    grace = 1.0
    config = write_config(tmp_path, pki, shutdown_grace_seconds=grace)
    server = _serve(started, config, app=True, READY_FLAG=str(tmp_path / "flag"))
    conn = _connect(pki, server, timeout=30)
    conn.request("GET", "/stream?chunks=200&interval=0.1")  # 20 s: longer than the grace
    response = conn.getresponse()
    assert response.readline() == b"chunk 0\n"
    sent = server.terminate()
    assert server.wait(grace + MARGIN) == 0
    assert time.monotonic() - sent >= grace - 0.2  # it waited for the stream first
    with pytest.raises(http.client.IncompleteRead):
        response.read()
    assert "timeout graceful shutdown exceeded" in server.output()


def test_sigterm_with_only_idle_connections_stops_at_once(
    pki: Pki, tmp_path: Path, started: list[Served]
) -> None:
    config = write_config(tmp_path, pki, shutdown_grace_seconds=30)
    server = _serve(started, config)
    idle = _connect(pki, server)
    assert _get(idle, "/healthz")[0] == 200  # then kept alive, idle
    sent = server.terminate()
    assert server.wait(MARGIN) == 0
    assert time.monotonic() - sent < MARGIN
    with pytest.raises((http.client.HTTPException, OSError)):
        _get(idle, "/healthz")  # the server closed it
    assert "agent-sandbox-awx broker: stopped" in server.output()


# ---------------------------------------------------------------------------------- probes


def test_healthz_and_readyz_follow_the_apps_readiness_check(
    pki: Pki, tmp_path: Path, started: list[Served]
) -> None:
    flag = tmp_path / "flag"
    server = _serve(started, write_config(tmp_path, pki), app=True, READY_FLAG=str(flag))
    conn = _connect(pki, server)
    assert _get(conn, "/healthz") == (200, b'{"status": "alive"}')
    status, body = _get(conn, "/readyz")
    assert status == 503
    assert json.loads(body) == {
        "status": "not ready",
        "not_ready": {"flag": f"{flag} does not exist yet"},
    }
    flag.write_text("")
    assert _get(conn, "/readyz") == (200, b'{"status": "ready"}')
    assert _get(conn, "/readyz", "HEAD") == (200, b"")
    status, body = _get(conn, "/healthz", "POST")
    assert status == 405 and json.loads(body)["code"] == "method_not_allowed"
    assert _get(conn, "/other") == (200, b"hello")  # every other path is the app's


def _local_broker_config(directory: Path, pki: Pki, issuer: BackgroundIssuer, port: int) -> Path:
    """``broker serve`` over the local backend, trusting ``issuer`` (discovery over HTTPS
    with its test-time CA), one policy for every subject, listening on ``port``."""
    path = directory / "local-broker.toml"
    path.write_text(
        "[server]\n"
        f'listen = "127.0.0.1:{port}"\n'
        f'public_url = "https://127.0.0.1:{port}"\n'
        f'tls_cert_file = "{pki.cert_file}"\n'
        f'tls_key_file = "{pki.key_file}"\n'
        "shutdown_grace_seconds = 10\n"
        "\n[[issuers]]\n"
        'name = "ci"\n'
        f'url = "{issuer.url}"\n'
        'provider = "gitlab"\n'
        f'ca_file = "{issuer.ca_file}"\n'
        "\n[[policies]]\n"
        'name = "everyone"\n'
        'issuer = "ci"\n'
        'warm_pools = ["python"]\n'
        'namespace = "ci-sandboxes"\n'
        "max_sandboxes = 2\n"
        "\n[backend]\n"
        'kind = "local"\n'
        "\n[backend.local]\n"
        'templates = { python = "" }\n'
    )
    return path


def _wait_ready(pki: Pki, server: Served, timeout: float = 20.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        conn = _connect(pki, server)
        status, body = _get(conn, "/readyz")
        conn.close()
        if status == 200:
            return dict(json.loads(body))
        assert time.monotonic() < deadline, body
        time.sleep(0.1)


@pytest.mark.parametrize("protocol", ["v1", "rpc"])
def test_broker_serve_runs_the_broker_over_the_local_backend_for_the_sdk(
    pki: Pki, tmp_path: Path, started: list[Served], protocol: str
) -> None:
    """The local half of "one broker, two backends": ``broker serve --config FILE`` as a real
    process, the broker app over the local backend, a caller verified through its issuer's
    OIDC discovery and JWKS over HTTPS, driven by the SDK (create, run, files, kill)."""
    from k8s_agent_sandbox_awx import Sandbox

    with BackgroundIssuer(tmp_path) as issuer:
        [port] = free_ports(1)
        config = _local_broker_config(tmp_path, pki, issuer, port)
        server = _serve(started, config)
        assert "for 1 issuer(s), 1 policy, backend local" in server.output()
        assert _wait_ready(pki, server) == {"status": "ready"}
        url = f"https://127.0.0.1:{port}"
        environ = {
            "AGENT_SANDBOX_BROKER_URL": url,
            "AGENT_SANDBOX_CA_BUNDLE": str(pki.ca_file),
            "AGENT_SANDBOX_TOKEN": issuer.token(
                "project_path:g/p:ref_type:branch:ref:main", aud=url
            ),
            "AGENT_SANDBOX_BROKER_PROTOCOL": protocol,
            "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
        }
        sandbox = Sandbox.create(environ=environ)
        try:
            result = sandbox.commands.run("echo served")
            assert (result.stdout, result.exit_code) == ("served\n", 0)
            sandbox.files.write("notes/a.txt", b"from the sdk")
            assert sandbox.files.read("notes/a.txt") == b"from the sdk"
            assert [e.name for e in sandbox.files.list("notes")] == ["a.txt"]
        finally:
            sandbox.kill()
        assert not sandbox.is_running()
        with pytest.raises(SandboxError):  # a token of an issuer the broker does not trust
            Sandbox.create(environ={**environ, "AGENT_SANDBOX_TOKEN": _foreign_token(url)})
        server.terminate()
        assert server.wait(MARGIN + 10) == 0


def _foreign_token(audience: str) -> str:
    import jwt
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = int(time.time())
    claims = {"iss": "https://elsewhere.test", "sub": "x", "aud": audience, "exp": now + 600}
    return jwt.encode({**claims, "iat": now}, key, "RS256", headers={"kid": "k"})


def test_an_ipv6_listen_address(pki: Pki, tmp_path: Path, started: list[Served]) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    server = _serve(started, write_config(tmp_path, pki, listen="[::1]:0"))
    assert server.url.startswith("https://[::1]:")
    with socket.create_connection(("::1", server.port), timeout=10) as raw:
        with pki.context().wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert tls.recv(100).startswith(b"HTTP/1.1 200")
