"""Fixtures shared by the client tests (tests/client: sync and async, side by side) and the rest.

pytest runs with ``--import-mode=importlib``, so test directories cannot import each other's
modules: what both suites use is provided here, as fixtures. ``tests/broker`` overrides
``broker`` with its own session-scoped broker.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import SDK_VARIABLES

# ------------------------------------------------------------------------------ local broker

TEST_ISOLATION_ENV = "AGENT_SANDBOX_TEST_ISOLATION"
"""The isolation of the session's local sandboxes: ``none`` (default: host processes, the
fastest) or ``bwrap`` (every local broker and backend a test makes without ``isolation=``
runs its sandboxes in bubblewrap; CI runs a subset so, see docs/local-broker.md). It becomes
the library's ``AGENT_SANDBOX_LOCAL_ISOLATION`` for this process and what it starts."""


def _select_isolation() -> str:
    mode = os.environ.get(TEST_ISOLATION_ENV) or "none"
    if mode not in ("none", "bwrap", "auto"):
        raise pytest.UsageError(f"{TEST_ISOLATION_ENV}={mode!r}: give none, bwrap or auto")
    os.environ["AGENT_SANDBOX_LOCAL_ISOLATION"] = mode
    return mode


TEST_ISOLATION = _select_isolation()


def pytest_report_header() -> str:
    return f"local sandboxes' isolation: {TEST_ISOLATION} (${TEST_ISOLATION_ENV})"



_DETECTING = frozenset({"dialect", "dialect_broker", "rpc_broker", "real_detection"})


@pytest.fixture
def real_detection() -> None:
    """Request it to let the client find out the dialect of a scripted broker itself."""


@pytest.fixture(autouse=True)
def _forget_detected_dialects(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Each test finds out afresh which dialect a broker speaks (the SDK remembers it per
    broker URL for the life of the process). Scripted brokers speak v1 and serve no
    ``/v1/healthz``: unless a test runs per dialect (``dialect``, ``dialect_broker``) or uses
    ``rpc_broker`` or ``real_detection``, a broker whose dialect is not pinned is taken to
    speak v1 (no probe)."""
    from k8s_agent_sandbox_awx.client import _base
    from k8s_agent_sandbox_awx.client.wire import _dialects

    _dialects.forget_detected()
    if _DETECTING.isdisjoint(request.fixturenames):
        v1 = _dialects.get_dialect("v1")
        monkeypatch.setattr(_base, "detected", lambda _url: v1)
        monkeypatch.setattr(_dialects, "detected", lambda _url: v1)
    yield
    _dialects.forget_detected()


_CLEAN_ENV = (
    *SDK_VARIABLES,  # every variable the SDK reads, the original package's aliases included
    "GITHUB_ACTIONS",
    "ACTIONS_ID_TOKEN_REQUEST_URL",
    "ACTIONS_ID_TOKEN_REQUEST_TOKEN",
)


@pytest.fixture
def broker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The session's local broker (the pytest plugin's ``sandbox_broker_session``), reset, with
    a clean credential environment and cache. In a test that runs per dialect (it uses the
    fixture ``dialect``, e.g. through ``pytestmark = pytest.mark.usefixtures("dialect")``) the
    broker for that dialect: see ``dialect_broker``."""
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    name = "sandbox_broker_session" if dialect_of(request) == "v1" else "rpc_broker_session"
    yield from _clean_use(request.getfixturevalue(name), monkeypatch)


def _clean_use(session_broker: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``session_broker``, reset, with a clean credential environment and cache (and reset
    again afterwards)."""
    from k8s_agent_sandbox_awx import clear_credential_cache

    for name in _CLEAN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    session_broker.reset()
    clear_credential_cache()
    yield session_broker
    clear_credential_cache()
    session_broker.reset()


DIALECTS = ("v1", "rpc")


@pytest.fixture(scope="session")
def rpc_broker_session() -> Iterator[Any]:
    """A local broker that serves only the ``/rpc`` dialect (as deployed brokers do), for the
    session; warm pool ``orphan`` names a template that does not exist."""
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    from k8s_agent_sandbox_awx.testing import LocalBroker

    pools = {"orphan": "no-such-template"}
    with LocalBroker(protocols=("rpc",), warm_pools=pools, warn=False) as session_broker:
        yield session_broker


@pytest.fixture
def rpc_broker(rpc_broker_session: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The ``/rpc``-only broker, reset, with a clean credential environment (like ``broker``)."""
    yield from _clean_use(rpc_broker_session, monkeypatch)


@pytest.fixture(params=DIALECTS)
def dialect(request: pytest.FixtureRequest) -> str:
    """Each broker dialect in turn. A test that uses it (directly, through ``dialect_broker``,
    or a whole module through ``pytestmark = pytest.mark.usefixtures("dialect")``) runs once
    per dialect, and its local brokers (``broker``, ``files_broker``, ``legacy_broker``,
    ``runtime_401_broker``) are the ones for that dialect: under ``rpc`` brokers that serve
    only ``/rpc``, with the same templates and policies, which the client finds out itself.

    A test that needs an operation a dialect lacks (``_dialect.FEATURES``) says so with
    ``@pytest.mark.dialect_feature(FEATURE, ...)``: it is skipped, with that reason, under a
    dialect without it."""
    from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect

    name: str = request.param
    marker = request.node.get_closest_marker("dialect_feature")
    if marker is not None:
        missing = [f for f in marker.args if f not in get_dialect(name).features]
        if missing:
            pytest.skip(
                f"the {name!r} dialect lacks the {' and '.join(missing)} feature "
                "(Dialect.features): "
                + marker.kwargs.get("reason", "this test is about that operation")
            )
    return name


def dialect_of(request: pytest.FixtureRequest) -> str:
    """The dialect the requesting test runs under: its ``dialect`` parameter, else ``v1``."""
    if "dialect" not in request.fixturenames:
        return "v1"
    name: str = request.getfixturevalue("dialect")
    return name


@pytest.fixture
def dialect_broker(broker: Any, dialect: str) -> Any:
    """The local broker for ``dialect``, reset, with a clean credential environment: ``v1`` the
    session broker (it serves both dialects; a client without configuration finds ``v1``),
    ``rpc`` a broker that serves only ``/rpc`` (the client finds ``rpc``). The same as
    ``broker`` in a test that runs per dialect."""
    del dialect  # requested for its parametrisation: ``broker`` follows it
    return broker


@pytest.fixture(scope="session")
def _session_brokers() -> Iterator[Callable[[Callable[..., Any], str], Any]]:
    """``get(start, dialect)``: the session's broker that ``start(**options)`` (a context
    manager making a ``LocalBroker``) makes for ``dialect`` — under ``v1`` one that serves both
    dialects, under ``rpc`` one that serves only ``/rpc`` — started on first use and stopped
    at the end of the session."""
    started: dict[tuple[Callable[..., Any], str], Any] = {}
    with contextlib.ExitStack() as stack:

        def get(start: Callable[..., Any], dialect: str) -> Any:
            if (start, dialect) not in started:
                options = {} if dialect == "v1" else {"protocols": (dialect,)}
                started[start, dialect] = stack.enter_context(start(**options))
            return started[start, dialect]

        yield get


def _local_broker(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, start: Callable[..., Any]
) -> Iterator[Any]:
    """The session's broker made by ``start`` for the test's dialect, used as ``broker`` is."""
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    get = request.getfixturevalue("_session_brokers")
    yield from _clean_use(get(start, dialect_of(request)), monkeypatch)


UNAUTHORIZED_RUNTIME = Path(__file__).with_name("unauthorized_runtime.py")


@contextlib.contextmanager
def _runtime_401_local_broker(**options: Any) -> Iterator[Any]:
    from k8s_agent_sandbox_awx.testing import LocalBroker, Policy

    templates: dict[str, str | list[str] | None] = {
        "python": None,
        "unauthorized": [sys.executable, str(UNAUTHORIZED_RUNTIME), "--port", "{port}"],
        "forging": [
            *(sys.executable, str(UNAUTHORIZED_RUNTIME), "--port", "{port}"),
            *("--code", "token_expired"),
        ],
    }
    policy = Policy(
        templates=("python", "unauthorized", "forging"),
        namespace="gitlab-ci",
        max_sandboxes=5,
        max_lifetime_seconds=600,
    )
    with LocalBroker(templates=templates, gitlab_policy=policy, warn=False, **options) as made:
        yield made


@pytest.fixture
def runtime_401_broker(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """A local broker (its own, for the session) whose GitLab callers may also use the template
    ``unauthorized``: a runtime that answers every request but ``GET /`` with ``401`` and a
    runtime-style body (``tests/unauthorized_runtime.py``), and ``forging``: the same runtime
    whose 401 body imitates the broker's ``token_expired``. Reset and with a clean credential
    environment, like ``broker``; per dialect like ``broker``."""
    yield from _local_broker(request, monkeypatch, _runtime_401_local_broker)


LEGACY_RUNTIME = Path(__file__).with_name("legacy_runtime.py")


@contextlib.contextmanager
def _legacy_local_broker(**options: Any) -> Iterator[Any]:
    from k8s_agent_sandbox_awx.testing import LocalBroker, Policy

    templates: dict[str, str | list[str] | None] = {
        "legacy": [sys.executable, str(LEGACY_RUNTIME), "--port", "{port}"],
    }
    policy = Policy(templates=("legacy",), namespace="default", max_sandboxes=3)
    with LocalBroker(templates=templates, kubernetes_policy=policy, warn=False, **options) as made:
        yield made


@pytest.fixture
def legacy_broker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A local broker (its own, for the session) whose sandboxes run an old runtime: the local
    runtime without the managed-command endpoints (``tests/legacy_runtime.py``; ``/commands``
    answers ``404`` without a code). Reset and with a clean credential environment; per
    dialect like ``broker``."""
    yield from _local_broker(request, monkeypatch, _legacy_local_broker)


@pytest.fixture
def managed_only_options() -> list[tuple[str, dict[str, Any]]]:
    """``(name, run options)`` for each ``commands.run`` option only the managed-command
    protocol honours: an old runtime (``/execute`` only) refuses each of them."""
    return [
        ("on_stdout", {"on_stdout": print}),
        ("on_stderr", {"on_stderr": print}),
        ("envs", {"envs": {"A": "b"}}),
        ("cwd", {"cwd": "/tmp"}),
        ("background", {"background": True}),
        ("stdin", {"background": True, "stdin": True}),
    ]


def process_gone(pid: int, within: float = 10.0) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``within`` s (a wait, not a speed test)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(name="process_gone")
def _process_gone() -> Callable[..., bool]:
    """``process_gone(pid, within=10.0)``: whether the process ended within ``within`` s."""
    return process_gone


LONG_OUTPUT = """
import sys, time
for i in range(1, 3001):
    sys.stdout.write(f"line {i} of the long output\\n")
    if i % 10 == 0:
        sys.stdout.flush()
        time.sleep(0.003)  # a pause every 10 lines: hundreds of events, not a few big reads
"""


@pytest.fixture
def long_output() -> tuple[list[str], str]:
    """``(argv, expected)``: a command printing 3000 lines in 300 flushes 3 ms apart (about 300
    events) and the exact output it prints."""
    argv = [sys.executable, "-c", LONG_OUTPUT]
    return argv, "".join(f"line {i} of the long output\n" for i in range(1, 3001))


LONG_STREAM = """
import sys, time
out = sys.stdout.buffer
for i in range(1, 1601):
    out.write(f"line {i} of a long stream \u00e9\u20ac {'x' * (i % 7)}\\n".encode())
    out.flush()
    time.sleep(0.002)  # one write per event: 1600 events, not a few big reads
"""


@dataclass(frozen=True)
class LongStream:
    """A command that prints 1600 lines, one write 2 ms apart (so about 1600 events, each
    line with two multi-byte characters that a mid-line drop may split), and what it prints."""

    argv: list[str]
    expected: str
    lines: int = 1600


@pytest.fixture
def long_stream() -> LongStream:
    expected = "".join(
        f"line {i} of a long stream \u00e9\u20ac {'x' * (i % 7)}\n" for i in range(1, 1601)
    )
    return LongStream([sys.executable, "-c", LONG_STREAM], expected)


LOGGING_SERVER = r"""
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        sys.stderr.write(("served " + self.path + " ").ljust(131072, ".") + "\n")
        sys.stderr.flush()  # a dev server's request log: 128 KiB per request
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@dataclass(frozen=True)
class LoggingServer:
    """A background dev server (a command: ``argv``) that logs every request it serves to its
    stderr, 128 KiB each; its first output line is its port (it listens on 127.0.0.1: a local
    sandbox's commands are host processes)."""

    argv: list[str]

    @staticmethod
    def serves(port: int, requests: int, within: float = 10.0) -> float:
        """Send ``requests`` requests one after the other, each answered within ``within`` s
        (else the test fails: the server is blocked); the slowest answer's seconds."""
        slowest = 0.0
        for i in range(requests):
            started = time.monotonic()
            url = f"http://127.0.0.1:{port}/{i}"
            with urllib.request.urlopen(url, timeout=within) as resp:
                assert resp.read() == b"ok"
            slowest = max(slowest, time.monotonic() - started)
        return slowest


@pytest.fixture
def logging_server() -> LoggingServer:
    return LoggingServer([sys.executable, "-c", LOGGING_SERVER])


def mid_line_drops(broker: Any, sandbox: str) -> Callable[[int], None]:
    """``inject(events_seen)``: called by an output callback; every 200 events it makes the
    broker drop the next event stream of ``sandbox`` inside a line (half of it sent, then the
    connection cut) after a varying number of whole lines, so that drops happen all along a
    long stream, mixed with the cuts."""
    done: set[int] = set()

    def inject(seen: int) -> None:
        step = seen // 200
        if step and step not in done:
            done.add(step)
            broker.drop_event_stream_mid_line(1, after_events=(step * 17) % 50, sandbox=sandbox)

    return inject


@pytest.fixture(name="mid_line_drops")
def _mid_line_drops() -> Callable[[Any, str], Callable[[int], None]]:
    """``mid_line_drops(broker, sandbox_name)``: see :func:`mid_line_drops`."""
    return mid_line_drops


@pytest.fixture(scope="session")
def bashless_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A ``PATH`` without bash: one directory of links to every program on this process's
    ``PATH`` but ``bash`` and ``rbash``. A sandbox created with ``env={"PATH": ...}`` of it is,
    to the client, an image without bash: the client looks bash up on the command's ``PATH``
    (it never starts ``/bin/bash`` by its path). What it does not simulate: ``/bin/bash`` still
    exists on this machine, so a command that names it by its path would find it."""
    directory = tmp_path_factory.mktemp("bashless-bin")
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(entry):
            continue
        for name in os.listdir(entry):
            link, program = directory / name, os.path.join(entry, name)
            if name in ("bash", "rbash") or link.exists() or link.is_symlink():
                continue
            if os.path.isfile(program) and os.access(program, os.X_OK):
                link.symlink_to(program)
    assert not (directory / "bash").exists() and (directory / "tr").exists()
    return str(directory)


@pytest.fixture
def streams_opened(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], list[str]]:
    """``streams_opened(sandbox)`` (sync or async): the list of the event streams its commands
    open from then on: ``"POST"`` for a streamed start, the ``after`` cursor of each
    ``GET /commands/{id}/events``."""

    def watch(sandbox: Any) -> list[str]:
        transport = sandbox.commands._transport
        opened: list[str] = []
        events = transport.events

        def counting(spec: Any, **options: Any) -> Any:
            opened.append(spec.params.get("after", spec.method))
            return events(spec, **options)

        monkeypatch.setattr(transport, "events", counting)
        return opened

    return watch


FILES_POLICY_CAP = 120


@contextlib.contextmanager
def _files_local_broker(**options: Any) -> Iterator[Any]:
    from k8s_agent_sandbox_awx.testing import LocalBroker, Policy

    templates: dict[str, str | list[str] | None] = {
        "python": None,
        "legacy": [sys.executable, str(LEGACY_RUNTIME), "--port", "{port}"],
    }
    policy = Policy(
        templates=("python", "legacy"),
        namespace="team-a",
        max_sandboxes=10,
        max_lifetime_seconds=FILES_POLICY_CAP,
    )
    with LocalBroker(templates=templates, kubernetes_policy=policy, warn=False, **options) as made:
        yield made


@pytest.fixture
def files_broker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A local broker (its own, for the session) whose Kubernetes callers may use the templates
    ``python`` (the local runtime, with the file API) and ``legacy`` (``tests/legacy_runtime.py``:
    no ``/fs/*``); the policy caps lifetimes at ``FILES_POLICY_CAP`` (120) seconds. Reset and
    with a clean credential environment, like ``broker``; per dialect like ``broker``."""
    yield from _local_broker(request, monkeypatch, _files_local_broker)


def live_claims(broker: Any, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The broker's live claims once deletions have settled (a DELETE is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        claims = [c for c in broker.claims() if not c["metadata"].get("deletionTimestamp")]
        if not claims or time.monotonic() > deadline:
            return claims
        time.sleep(0.05)


@pytest.fixture
def live() -> Callable[..., list[dict[str, Any]]]:
    """``live(broker, timeout=10.0)``: the live claims once deletions have settled."""
    return live_claims


@pytest.fixture
def use_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], None]:
    """``use_env(env)``: set every variable of ``env`` for this test (undone afterwards)."""

    def apply(env: dict[str, str]) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return apply


# ------------------------------------------------------------------------------ client memory

# Prepended to every client script: the script runs in a fresh interpreter, so that the peak
# RSS (VmHWM) it reports is the client's alone (the broker and the runtimes live elsewhere).
_CLIENT_PRELUDE = r"""
import hashlib, json, os, sys

SIZE = int(sys.argv[1])

def vm_hwm_kib():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
"""


@pytest.fixture
def round_trip_growth(broker: Any) -> Callable[[str, int], int]:
    """``round_trip_growth(script, size) -> bytes``: run a client script that writes ``size``
    generated bytes to a sandbox and reads them back, in a fresh interpreter with the broker's
    zero-arg environment. The script sees ``SIZE``, ``vm_hwm_kib()`` and the modules hashlib,
    json, os and sys, and prints a JSON report ``{"base_kib", "peak_kib", "size", "same"}`` as
    its last line. Asserts that it exited 0, read back ``size`` bytes and that their digest is
    the digest of what it sent; returns the growth of its peak RSS during the transfers."""

    def run(script: str, size: int) -> int:
        env = {**os.environ, **broker.environ("kubernetes")}
        env["AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        out = subprocess.run(
            [sys.executable, "-c", _CLIENT_PRELUDE + script, str(size)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report["size"] == size
        assert report["same"]
        growth: int = (report["peak_kib"] - report["base_kib"]) * 1024
        return growth

    return run


# ------------------------------------------------------------------------------ HTTPS servers


class RecordingServer:
    """A loopback HTTPS server (plain HTTP without a ``context``) that records every request's
    path and headers and answers 200 with ``body`` (JSON when given), or 307 to ``redirect_to``
    + the path. Request bodies (sized or chunked) are read and dropped."""

    def __init__(
        self, context: ssl.SSLContext | None, redirect_to: str | None, body: bytes = b""
    ) -> None:
        self.seen: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                if self.headers.get("Transfer-Encoding") == "chunked":
                    while True:
                        size = int(self.rfile.readline().strip() or b"0", 16)
                        self.rfile.read(size + 2)
                        if size == 0:
                            break
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                outer.seen.append({"path": self.path, **dict(self.headers.items())})
                if redirect_to is not None:
                    self.send_response(307)
                    self.send_header("Location", redirect_to + self.path)
                else:
                    self.send_response(200)
                    if body:
                        self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if context is not None:
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
            scheme = "https"
        self.port = self.httpd.server_address[1]
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def https_server() -> Iterator[Callable[..., RecordingServer]]:
    """``https_server(context, redirect_to=None, body=b"")``: start a :class:`RecordingServer`
    with the server-side TLS ``context`` (``None``: plain HTTP); every server started is closed
    after the test."""
    started: list[RecordingServer] = []

    def start(
        context: ssl.SSLContext | None, redirect_to: str | None = None, body: bytes = b""
    ) -> RecordingServer:
        server = RecordingServer(context, redirect_to, body)
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        server.close()


@pytest.fixture
def redirect_servers(
    tmp_path: Path, https_server: Callable[..., RecordingServer]
) -> tuple[RecordingServer, RecordingServer, str]:
    """``(redirector, recorder, ca_path)``: the redirector answers every request with a 307 to
    the recorder (another origin); both use a certificate of a CA made for this test."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    recorder = https_server(context)
    redirector = https_server(context, recorder.url)
    return redirector, recorder, str(ca_path)


# ------------------------------------------------------------------------------ proxies

PROXY_VARIABLES = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "AGENT_SANDBOX_TRUST_ENV_PROXIES",
)


class RecordingProxy:
    """A loopback HTTP proxy that records every request line it gets (``seen``) and whether one
    carried an ``Authorization`` header (``saw_authorization``). ``CONNECT host:port`` is
    tunnelled to ``127.0.0.1:port`` whatever the host (every test server is on this machine);
    any other request (plain-HTTP forwarding) is answered ``502``."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.saw_authorization = False
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                client: socket.socket = self.request
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                lines = head.split(b"\r\n")
                outer.seen.append(lines[0].decode("latin-1"))
                if any(line.lower().startswith(b"authorization:") for line in lines):
                    outer.saw_authorization = True
                method, target = lines[0].split(b" ")[:2]
                if method != b"CONNECT":
                    client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                    return
                port = int(target.rsplit(b":", 1)[1])
                with socket.create_connection(("127.0.0.1", port)) as upstream:
                    client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    _pipe(client, upstream)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between two sockets until one side closes."""
    with selectors.DefaultSelector() as selector:
        selector.register(a, selectors.EVENT_READ, b)
        selector.register(b, selectors.EVENT_READ, a)
        while True:
            for key, _ in selector.select(timeout=30):
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                if not data:
                    return
                key.data.sendall(data)


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingProxy]:
    """A :class:`RecordingProxy`, with no proxy variable set (tests set the ones they need)."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    server = RecordingProxy()
    yield server
    server.close()


@pytest.fixture
def resolve_to_loopback(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """``resolve_to_loopback(host)``: name resolution in this process maps ``host`` to
    127.0.0.1 and refuses every other name that is not a loopback one, so that a test using a
    non-loopback broker name never sends a packet off this machine."""
    real = socket.getaddrinfo
    names: set[str] = set()

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name in names:
            name = "127.0.0.1"
        elif name not in ("127.0.0.1", "::1", "localhost"):
            raise socket.gaierror(socket.EAI_NONAME, f"{name!r}: not resolved in tests")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return names.add


@pytest.fixture
def remote_broker(
    tmp_path: Path,
    https_server: Callable[..., RecordingServer],
    resolve_to_loopback: Callable[[str], None],
) -> tuple[str, str, RecordingServer]:
    """``(url, ca_path, server)``: a stand-in broker that is not on a loopback address as far
    as the client can tell — ``https://broker.example:PORT``, with a certificate for that name
    from a CA made for this test — though the name resolves to 127.0.0.1 (see
    ``resolve_to_loopback``). It answers every request ``200 {"items": []}``."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("broker.example").configure_cert(context)
    ca_path = tmp_path / "remote-ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    server = https_server(context, body=b'{"items": []}')
    resolve_to_loopback("broker.example")
    return f"https://broker.example:{server.port}", str(ca_path), server


# ------------------------------------------------------------------------------ echoed tokens

ECHO_CALLER_TOKEN = "opaque-caller-token-0123456789"
ECHO_OTHER_JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJzb21lb25lIn0.c2lnbmF0dXJlLW9mLWFub3RoZXI"
ECHO_OTHER_BEARER = "0p4qu3-4cc355-t0k3n-fr0m-3ls3wh3r3"


class TokenEcho:
    """One server answer that repeats a secret: ``op`` (``"whoami"``, ``"list"`` or
    ``"create"``) gets ``answer`` from a scripted broker and must raise ``error`` (the name of
    an exception class the package exports). The client's token is ``CALLER_TOKEN``."""

    CALLER_TOKEN = ECHO_CALLER_TOKEN

    def __init__(self, name: str, op: str, error: str, answer: Callable[[], Any]) -> None:
        self.name, self.op, self.error, self.answer = name, op, error, answer

    def handler(self, request: Any) -> Any:
        if request.method == "DELETE":
            return httpx.Response(204)
        return self.answer()

    def secrets(self) -> list[str]:
        """What must never show: the caller's token, the other tokens and each JWT part."""
        jwt_parts = ECHO_OTHER_JWT.split(".")[1:]
        return [ECHO_CALLER_TOKEN, ECHO_OTHER_BEARER, *jwt_parts, jwt_parts[0][:12]]


def _token_echoes() -> list[TokenEcho]:
    def sandbox(**extra: Any) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "name": "sbx-1",
            "namespace": "default",
            "phase": "Pending",
            "router": {"sandbox_id": "sbx-1", "namespace": "default", "port": 8888},
        }
        obj.update(extra)
        return obj

    caller = ECHO_CALLER_TOKEN
    return [
        TokenEcho(
            "401 detail repeats the Authorization header",
            "whoami",
            "BrokerAuthenticationError",
            lambda: httpx.Response(
                401,
                json={"code": "token_revoked", "detail": f"got Authorization: Bearer {caller}"},
            ),
        ),
        TokenEcho(
            "400 detail is an object with the headers and a JWT",
            "whoami",
            "BrokerError",
            lambda: httpx.Response(
                400,
                json={
                    "code": "invalid_request",
                    "detail": {"authorization": f"Bearer {caller}", "jwt": ECHO_OTHER_JWT},
                },
            ),
        ),
        TokenEcho(
            "the caller's bare token and another bearer token in a text body",
            "whoami",
            "BrokerUnavailableError",
            lambda: httpx.Response(
                502, text=f"upstream rejected Bearer {ECHO_OTHER_BEARER}; you sent {caller}"
            ),
        ),
        TokenEcho(
            "a JWT cut by the length limit of a text body",
            "whoami",
            "BrokerError",
            lambda: httpx.Response(400, text="x" * 264 + " " + ECHO_OTHER_JWT),
        ),
        TokenEcho(
            "a redirect to a URL with a token",
            "whoami",
            "BrokerRedirectError",
            lambda: httpx.Response(
                307, headers={"Location": f"https://elsewhere.example/?t={ECHO_OTHER_JWT}"}
            ),
        ),
        TokenEcho(
            "a Retry-After header with a bearer token",
            "whoami",
            "BrokerQuotaError",
            lambda: httpx.Response(
                429,
                json={"code": "rate_limited", "detail": "slow down"},
                headers={"Retry-After": f"Bearer {ECHO_OTHER_BEARER}"},
            ),
        ),
        TokenEcho(
            "a 200 answer that is not JSON",
            "whoami",
            "BrokerProtocolError",
            lambda: httpx.Response(200, text=f"hello {ECHO_OTHER_JWT}"),
        ),
        TokenEcho(
            "a Sandbox object with a token in a bad field",
            "list",
            "BrokerProtocolError",
            lambda: httpx.Response(
                200,
                json={"items": [sandbox(router={"sandbox_id": "s", "port": ECHO_OTHER_JWT})]},
            ),
        ),
        TokenEcho(
            "a Failed sandbox whose message has a token",
            "create",
            "SandboxFailedError",
            lambda: httpx.Response(
                201,
                json=sandbox(
                    phase="Failed",
                    reason=f"Bearer {ECHO_OTHER_BEARER}",
                    message=f"pull failed with {ECHO_OTHER_JWT}",
                ),
            ),
        ),
    ]


@pytest.fixture
def token_echoes() -> list[TokenEcho]:
    """Scripted broker answers (for httpx.MockTransport) that repeat the caller's token
    (``ECHO_CALLER_TOKEN``), a bearer token or a JWT, each in another part of the answer."""
    return _token_echoes()


def leaked(error: BaseException, echo: TokenEcho) -> list[str]:
    """The secrets of ``echo`` found in anything ``error`` shows: str, repr, notes and the
    text attributes (``detail``, ``location``, ``reason``)."""
    shown = [str(error), repr(error), *getattr(error, "__notes__", [])]
    shown += [str(getattr(error, name, "")) for name in ("detail", "location", "reason")]
    return [secret for secret in echo.secrets() if any(secret in text for text in shown)]


@pytest.fixture
def find_leaks() -> Callable[[BaseException, TokenEcho], list[str]]:
    """``find_leaks(error, echo)``: the secrets of ``echo`` that ``error`` shows."""
    return leaked


# ------------------------------------------------------------------------------ unreachable


@pytest.fixture
def wrong_ca_environ(broker: Any, tmp_path: Path) -> tuple[dict[str, str], str]:
    """``(environ, ca_path)``: the local broker's zero-arg environment, but with a CA bundle
    of another CA (made for this test), so that the broker's certificate does not verify."""
    trustme = pytest.importorskip("trustme")
    wrong = tmp_path / "wrong-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(wrong))
    return {**broker.environ("kubernetes"), "AGENT_SANDBOX_CA_BUNDLE": str(wrong)}, str(wrong)


@pytest.fixture
def closed_port_broker(broker: Any) -> tuple[Any, Any]:
    """``(config, auth)`` for a broker URL on a loopback port nothing listens on (fast
    backoff), with a token for that URL."""
    from k8s_agent_sandbox_awx import BrokerConnectionConfig, OIDCTokenAuth

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"https://127.0.0.1:{probe.getsockname()[1]}"
    auth = OIDCTokenAuth(broker.issue_gitlab_token("group/project", audience=url))
    config = BrokerConnectionConfig(
        broker_url=url, ca_cert=broker.ca_bundle, backoff_base=0.01, backoff_max=0.01
    )
    return config, auth
