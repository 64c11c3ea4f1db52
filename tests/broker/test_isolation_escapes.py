"""Isolated local sandboxes (bubblewrap) against escapes: what a sandbox can make the broker
do, and what it reads of the broker's.

- The runtime's socket: an isolated sandbox's control directory (``/run/agent-sandbox``) is
  its own to write, so a sandbox replaces ``runtime.sock`` there (by a socket of its own, a
  link to a host socket, a FIFO or a file). The broker must keep reaching the runtime it
  started: it holds the socket it found at start by file descriptor and never looks the path
  up again, so nothing the sandbox writes decides what it connects to.
- The broker's files: under ``broker serve`` a sandbox read the configuration file, the TLS
  key, an issuer's ``token_file`` and the audit log from a directory under ``$HOME``; every
  such directory is hidden now, and the start-up message names the isolation in force.
- ``network = false``: a sandbox still reached host Unix sockets in directories it could see
  (under ``$HOME``); those places are hidden now (abstract sockets: the network namespace).

Real HTTPS, real tokens, httpx; each test needs a working ``bwrap`` (skipped where it cannot
run, failed with ``AGENT_SANDBOX_REQUIRE_BWRAP=1``, as CI sets it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker, Policy, caller_namespace
from tests._support.isolation import need_bwrap

CONTROL = "/run/agent-sandbox/runtime.sock"


@pytest.fixture(scope="module")
def isolated() -> Iterator[LocalBroker]:
    need_bwrap()
    policy = Policy(templates=("python",), namespace=caller_namespace)
    with LocalBroker(isolation="bwrap", warn=False, kubernetes_policy=policy) as broker:
        yield broker


@pytest.fixture
def alice(isolated: LocalBroker, api: Callable[..., Any]) -> Iterator[Any]:
    yield api(isolated.issue_kubernetes_token("team-a", "alice"), isolated)
    isolated.reset()


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def _sh(client: Any, sandbox: dict[str, Any], script: str) -> dict[str, Any]:
    """``sh -c script`` through the broker's ``/execute``; its result."""
    resp = client.http.post(
        "/execute",
        json={"command": f"sh -c {_quote(script)}"},
        headers=client.data_headers(sandbox),
    )
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


IMPOSTOR_ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b'Content-Length: 53\r\n\r\n{"stdout": "impostor", "stderr": "", "exit_code": 0}\n'
)
IMPOSTOR = (
    "import os, socket, sys\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "s.bind(sys.argv[1])\n"
    "s.listen(16)\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    c.recv(65536)\n"
    f"    c.sendall({IMPOSTOR_ANSWER!r})\n"
    "    c.close()\n"
)
"""An HTTP server on a Unix socket that answers every request as a runtime's ``/execute``
would, with ``impostor`` as the output (run in the sandbox, or on the host by the test)."""


@contextlib.contextmanager
def _host_impostor(path: Path) -> Iterator[list[int]]:
    """:data:`IMPOSTOR` on the host at ``path``: the count of connections it accepted."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(16)
    server.settimeout(0.2)
    accepted = [0]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted[0] += 1
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(IMPOSTOR_ANSWER)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join(5)
        server.close()


BARRIER = (
    "import os, sys, time\n"
    "d = '/app/barrier'\n"
    "os.makedirs(d, exist_ok=True)\n"
    "open(os.path.join(d, sys.argv[1]), 'w').close()\n"
    "deadline = time.monotonic() + 10\n"
    "while len(os.listdir(d)) < int(sys.argv[2]) and time.monotonic() < deadline:\n"
    "    time.sleep(0.02)\n"
    "print('met' if len(os.listdir(d)) >= int(sys.argv[2]) else 'alone')\n"
)
"""Each of N commands waits (10 s at most) until all N run: N requests in flight at once,
so the broker needs N connections to the runtime, all but one of them new."""


def _new_connections(client: Any, sandbox: dict[str, Any], count: int) -> list[Any]:
    """``count`` ``/execute`` requests that are all in flight at once (:data:`BARRIER`): what
    each answered (status, and the command's output when 200)."""
    headers = client.data_headers(sandbox)
    script = _quote(BARRIER)

    def one(_: int) -> Any:
        body = {"command": f"python3 -c {script} {uuid.uuid4().hex} {count}"}
        resp = client.http.post("/execute", json=body, headers=headers)
        return (resp.status_code, resp.json().get("stdout") if resp.status_code == 200 else None)

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


SWAPS = {
    "symlink": "rm -f {control} && ln -s {host} {control}",
    "fifo": "rm -f {control} && mkfifo {control}",
    "file": "rm -f {control} && echo not-a-socket > {control}",
}


@pytest.mark.parametrize("swap", ["socket", *SWAPS])
def test_a_sandbox_cannot_redirect_the_broker_by_replacing_its_runtime_socket(
    alice: Any, tmp_path: Path, swap: str
) -> None:
    """After the swap, requests on new connections still reach the sandbox's runtime: never a
    host socket the link names (resolved on the host: a path the sandbox cannot see itself),
    never a server of the sandbox's own; a FIFO or a file there does not break them."""
    sandbox = alice.ready()
    host_socket = tmp_path / "host.sock"  # the host's temporary directory: hidden in a sandbox
    with _host_impostor(host_socket) as accepted:
        if swap == "socket":
            started = alice.http.post(
                "/commands",
                json={"command": ["python3", "-c", IMPOSTOR, CONTROL + ".new"]},
                headers=alice.data_headers(sandbox),
            )
            assert started.status_code == 200, started.text
            wait = f"for i in $(seq 200); do test -S {CONTROL}.new && break; sleep 0.05; done"
            swapped = _sh(alice, sandbox, f"{wait}; mv -f {CONTROL}.new {CONTROL}")
        else:
            swapped = _sh(alice, sandbox, SWAPS[swap].format(control=CONTROL, host=host_socket))
        assert swapped["exit_code"] == 0, swapped
        assert _sh(alice, sandbox, f"ls -l {CONTROL}")["exit_code"] == 0
        answers = _new_connections(alice, sandbox, 4)
        assert answers == [(200, "met\n")] * 4, answers
        assert accepted == [0]
    assert _sh(alice, sandbox, "echo still the runtime")["stdout"] == "still the runtime\n"


# -- the broker's own files (broker serve) --------------------------------------------------------
@contextlib.contextmanager
def _outside_tmp() -> Iterator[Path]:
    """A directory of the test's in the home directory: not under the host's temporary one,
    which bubblewrap hides anyway (where operators keep a broker's files: ~/broker/)."""
    home = Path.home()
    if not os.access(home, os.W_OK):
        pytest.skip(f"the home directory {home} is not writable here")
    folder = Path(tempfile.mkdtemp(prefix=".awx-test-", dir=home))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_sandboxes_of_broker_serve_read_none_of_the_brokers_files(tmp_path: Path) -> None:
    """``broker serve`` with the local backend in bubblewrap, its configuration file, TLS pair,
    an issuer's ``token_file`` and the audit log in a directory under ``$HOME``: a sandbox
    reads none of them, nor lists their directory; its start-up message states the isolation
    in force (bubblewrap, and what it hides), never "NO isolation"."""
    need_bwrap()
    from k8s_agent_sandbox_awx import Sandbox
    from tests._support.broker_server import CLI, Pki, Served
    from tests._support.kube import free_ports
    from tests._support.oidc_issuer import BackgroundIssuer

    with _outside_tmp() as folder, BackgroundIssuer(tmp_path) as issuer:
        pki = Pki(folder)
        pki.write(pki.issue())
        token_file = folder / "issuer.token"
        token_file.write_text("s3cr3t-issuer-token\n")
        audit = folder / "audit.log"
        [port] = free_ports(1)
        config = folder / "broker.toml"
        config.write_text(
            "[server]\n"
            f'listen = "127.0.0.1:{port}"\n'
            f'public_url = "https://127.0.0.1:{port}"\n'
            f'tls_cert_file = "{pki.cert_file}"\n'
            f'tls_key_file = "{pki.key_file}"\n'
            "shutdown_grace_seconds = 5\n"
            "\n[[issuers]]\n"
            'name = "ci"\n'
            f'url = "{issuer.url}"\n'
            'provider = "gitlab"\n'
            f'ca_file = "{issuer.ca_file}"\n'
            f'token_file = "{token_file}"\n'
            "\n[[policies]]\n"
            'name = "everyone"\n'
            'issuer = "ci"\n'
            'warm_pools = ["python"]\n'
            'namespace = "ci-sandboxes"\n'
            f'\n[audit]\ndestination = "{audit}"\n'
            '\n[backend]\nkind = "local"\n'
        )
        argv = [*CLI, "broker", "serve", "--config", str(config)]
        server = Served.start(argv, env={"AGENT_SANDBOX_LOCAL_ISOLATION": "bwrap"})
        try:
            server.wait_started()
            url = f"https://127.0.0.1:{port}"
            environ = {
                "AGENT_SANDBOX_BROKER_URL": url,
                "AGENT_SANDBOX_CA_BUNDLE": str(pki.ca_file),
                "AGENT_SANDBOX_TOKEN": issuer.token("project_path:g/p:ref_type:branch", aud=url),
                "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
            }
            with Sandbox.create(environ=environ, ready_timeout=60) as sandbox:
                for path in (config, pki.key_file, pki.cert_file, token_file, audit, folder):
                    assert path.exists()  # on the host
                    seen = sandbox.commands.run(f"ls -d {path} && head -c 200 {path}")
                    assert seen.exit_code != 0, (path, seen)
                    assert "s3cr3t" not in seen.stdout and "PRIVATE KEY" not in seen.stdout
                assert sandbox.commands.run("echo still works").stdout == "still works\n"
        finally:
            server.terminate()
            server.wait(30)
    output = server.output()
    assert "NO isolation" not in output, output
    [said] = [line for line in output.splitlines() if "the local backend runs sandboxes" in line]
    assert "bubblewrap" in said and str(folder) in said, said


# -- network = false ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def offline_broker() -> Iterator[LocalBroker]:
    need_bwrap()
    policy = Policy(templates=("python",), namespace="gitlab-ci", network=False)
    with LocalBroker(isolation="bwrap", warn=False, gitlab_policy=policy) as broker:
        yield broker


CONNECT_UNIX = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "s.settimeout(5)\n"
    "try:\n"
    "    s.connect(sys.argv[1].replace('@', '\\0', 1))\n"
    "    print('connected')\n"
    "except OSError as exc:\n"
    "    print('refused', type(exc).__name__)\n"
)


@contextlib.contextmanager
def _unix_listener(address: str) -> Iterator[list[int]]:
    """A host Unix socket listening at ``address`` (``@name``: an abstract one): how many
    connections it accepted."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(address.replace("@", "\0", 1))
    server.listen(4)
    server.settimeout(0.1)
    accepted = [0]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                accepted[0] += 1
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join(5)
        server.close()


def test_a_sandbox_without_network_reaches_no_host_unix_socket(
    offline_broker: LocalBroker, api: Callable[..., Any]
) -> None:
    """``network = false``: no connection to a host service over a Unix socket either, in the
    places where host sockets live outside /run and /tmp (which are the sandbox's own): the
    home directory and /var (/var/tmp here), and abstract sockets (the network namespace)."""
    client = api(offline_broker.issue_gitlab_token("group/project"), offline_broker)
    sandbox = client.ready()
    var_tmp = Path(tempfile.mkdtemp(prefix="awx-test-", dir="/var/tmp"))
    try:
        with _outside_tmp() as home_dir:
            for address in (
                str(home_dir / "service.sock"),
                str(var_tmp / "service.sock"),
                f"@awx-test-{uuid.uuid4().hex}",
            ):
                with _unix_listener(address) as accepted:
                    body = {"command": f"python3 -c {_quote(CONNECT_UNIX)} {address}"}
                    resp = client.http.post(
                        "/execute", json=body, headers=client.data_headers(sandbox)
                    )
                    assert resp.status_code == 200, resp.text
                    assert resp.json()["stdout"].startswith("refused"), (address, resp.json())
                    assert accepted == [0], address
    finally:
        shutil.rmtree(var_tmp, ignore_errors=True)
    assert _sh(client, sandbox, "echo still works")["stdout"] == "still works\n"
