"""Fixtures shared by the client tests (tests/client: sync and async, side by side) and the rest.

Only fixtures live here; what they are made of is in ``tests/_support`` (importable: ``from
tests._support.brokers import ...``). ``tests/broker`` overrides ``broker`` with its own
session-scoped broker. Session-scoped fixtures are per xdist worker (each worker its own brokers).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._support import brokers, echoes, isolation, memory, programs, servers, workers
from tests._support.echoes import TokenEcho
from tests._support.programs import LoggingServer, LongStream
from tests._support.servers import RecordingProxy, RecordingServer

try:
    TEST_ISOLATION = isolation.select()
except ValueError as exc:
    raise pytest.UsageError(str(exc)) from None


def pytest_report_header() -> str:
    return f"local sandboxes' isolation: {TEST_ISOLATION} (${isolation.TEST_ISOLATION_ENV})"


def pytest_configure(config: pytest.Config) -> None:
    workers.use_private_tmpdir()  # under xdist: each worker its own TMPDIR


def pytest_unconfigure(config: pytest.Config) -> None:
    workers.remove_private_tmpdir()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    workers.slow_first(items)  # under xdist: the slow tests are handed out first


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return workers.make_scheduler(config, log)  # --dist loadgroup: tests/kube on two workers


CI_VARIABLES = ("CI", "GITLAB_CI", "GITHUB_ACTIONS")
"""The variables by which the CLI knows it runs in a CI job (``cli/_ci.py``): CI machines set
them, and what the CLI shows there differs (no personal claims, no local isolation line)."""


@pytest.fixture(autouse=True)
def _not_in_a_ci_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs as on a developer's machine, whichever machine runs the suite; a test
    about CI jobs sets the variables it means (``monkeypatch.setenv("GITLAB_CI", "true")``)."""
    for name in CI_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _no_state_in_home(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: Any) -> None:
    """``agent-sandbox-awx dev`` keeps its state under ``$XDG_STATE_HOME``: the suite's (one per
    worker, whose tests run one at a time), never the developer's ``~/.local/state``."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-state"))


# ------------------------------------------------------------------------------ local brokers


@pytest.fixture
def real_detection() -> None:
    """Request it to let the client find out the dialect of a scripted broker itself."""


@pytest.fixture(autouse=True)
def _forget_detected_dialects(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Each test finds out afresh which dialect a broker speaks; scripted brokers are taken to
    speak v1 unless the test lets the client detect it (``brokers.forget_detected_dialects``)."""
    yield from brokers.forget_detected_dialects(request, monkeypatch)


@pytest.fixture
def broker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The session's local broker (the pytest plugin's ``sandbox_broker_session``), reset, with
    a clean credential environment and cache. In a test that runs per dialect (it uses the
    fixture ``dialect``, e.g. through ``@pytest.mark.usefixtures("dialect")``) the broker for
    that dialect: see ``dialect_broker``."""
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    v1 = brokers.dialect_of(request) == "v1"
    name = "sandbox_broker_session" if v1 else "rpc_broker_session"
    yield from brokers.clean_use(request.getfixturevalue(name), monkeypatch)


@pytest.fixture(scope="session")
def rpc_broker_session() -> Iterator[Any]:
    """A local broker that serves only the ``/rpc`` dialect (as deployed brokers do), for the
    session; warm pool ``orphan`` names a template that does not exist."""
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    with brokers.rpc_only_local_broker() as session_broker:
        yield session_broker


@pytest.fixture
def rpc_broker(rpc_broker_session: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The ``/rpc``-only broker, reset, with a clean credential environment (like ``broker``)."""
    yield from brokers.clean_use(rpc_broker_session, monkeypatch)


@pytest.fixture(params=brokers.DIALECTS)
def dialect(request: pytest.FixtureRequest) -> str:
    """Each broker dialect in turn. A test that uses it (directly, through ``dialect_broker``,
    or through ``@pytest.mark.usefixtures("dialect")``) runs once per dialect, and its local
    brokers (``broker``, ``files_broker``, ``legacy_broker``, ``runtime_401_broker``) are the
    ones for that dialect: under ``rpc`` brokers that serve only ``/rpc``, with the same
    templates and policies, which the client finds out itself. Only tests whose behaviour
    depends on the dialect (control plane, routing, claim binding) run per dialect, and a
    small data-plane smoke set; the rest of the data plane runs under one.

    A test that needs an operation a dialect lacks (``_dialect.FEATURES``) says so with
    ``@pytest.mark.dialect_feature(FEATURE, ...)``: it is skipped, with that reason, under a
    dialect without it."""
    name: str = request.param
    brokers.skip_without_features(name, request.node)
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
    """``get(start, dialect)``: the session's broker ``start`` makes for ``dialect``
    (``brokers.session_brokers``)."""
    with brokers.session_brokers() as get:
        yield get


@pytest.fixture
def runtime_401_broker(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """A local broker (its own, for the session) whose GitLab callers may also use the template
    ``unauthorized``: a runtime that answers every request but ``GET /`` with ``401`` and a
    runtime-style body (``tests/unauthorized_runtime.py``), and ``forging``: the same runtime
    whose 401 body imitates the broker's ``token_expired``. Reset and with a clean credential
    environment, like ``broker``; per dialect like ``broker``."""
    yield from brokers.local_broker(request, monkeypatch, brokers.runtime_401_local_broker)


@pytest.fixture
def legacy_broker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A local broker (its own, for the session) whose sandboxes run an old runtime: the local
    runtime without the managed-command endpoints (``tests/legacy_runtime.py``; ``/commands``
    answers ``404`` without a code). Reset and with a clean credential environment; per
    dialect like ``broker``."""
    yield from brokers.local_broker(request, monkeypatch, brokers.legacy_local_broker)


@pytest.fixture
def files_broker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A local broker (its own, for the session) whose Kubernetes callers may use the templates
    ``python`` (the local runtime, with the file API) and ``legacy`` (``tests/legacy_runtime.py``:
    no ``/fs/*``); the policy caps lifetimes at ``FILES_POLICY_CAP`` (120) seconds. Reset and
    with a clean credential environment, like ``broker``; per dialect like ``broker``."""
    yield from brokers.local_broker(request, monkeypatch, brokers.files_local_broker)


@pytest.fixture
def live() -> Callable[..., list[dict[str, Any]]]:
    """``live(broker, timeout=10.0)``: the live claims once deletions have settled."""
    return brokers.live_claims


@pytest.fixture
def use_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], None]:
    """``use_env(env)``: set every variable of ``env`` for this test (undone afterwards)."""

    def apply(env: dict[str, str]) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return apply


# ------------------------------------------------------------------------------ programs


@pytest.fixture
def managed_only_options() -> list[tuple[str, dict[str, Any]]]:
    """``(name, run options)`` for each ``commands.run`` option only the managed-command
    protocol honours: an old runtime (``/execute`` only) refuses each of them."""
    return programs.managed_only_options()


@pytest.fixture(name="process_gone")
def _process_gone() -> Callable[..., bool]:
    """``process_gone(pid, within=10.0)``: whether the process ended within ``within`` s."""
    return programs.process_gone


@pytest.fixture
def long_output() -> tuple[list[str], str]:
    """``(argv, expected)``: a command printing 3000 lines in 300 flushes 3 ms apart (about 300
    events) and the exact output it prints."""
    return programs.long_output()


@pytest.fixture
def long_stream() -> LongStream:
    """A command printing 1600 lines, one write 2 ms apart (``programs.LongStream``)."""
    return programs.long_stream()


@pytest.fixture
def logging_server() -> LoggingServer:
    """A background dev server logging 128 KiB per request (``programs.LoggingServer``)."""
    return programs.logging_server()


@pytest.fixture(name="mid_line_drops")
def _mid_line_drops() -> Callable[[Any, str], Callable[[int], None]]:
    """``mid_line_drops(broker, sandbox_name)``: see :func:`programs.mid_line_drops`."""
    return programs.mid_line_drops


@pytest.fixture(scope="session")
def bashless_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A ``PATH`` without bash: one directory of links to every program on this process's
    ``PATH`` but ``bash`` and ``rbash``. A sandbox created with ``env={"PATH": ...}`` of it is,
    to the client, an image without bash: the client looks bash up on the command's ``PATH``
    (it never starts ``/bin/bash`` by its path). What it does not simulate: ``/bin/bash`` still
    exists on this machine, so a command that names it by its path would find it."""
    return programs.make_bashless_path(tmp_path_factory.mktemp("bashless-bin"))


@pytest.fixture
def streams_opened(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], list[str]]:
    """``streams_opened(sandbox)`` (sync or async): the list of the event streams its commands
    open from then on: ``"POST"`` for a streamed start, the ``after`` cursor of each
    ``GET /commands/{id}/events``."""
    return lambda sandbox: programs.watch_streams(monkeypatch, sandbox)


@pytest.fixture
def round_trip_growth(broker: Any) -> Callable[[str, int], int]:
    """``round_trip_growth(script, size) -> bytes``: the growth of a client script's peak RSS
    over a round trip of ``size`` bytes, in a fresh interpreter (``memory.round_trip_growth``)."""
    return lambda script, size: memory.round_trip_growth(broker, script, size)


# ------------------------------------------------------------------------------ HTTPS servers


@pytest.fixture
def https_server() -> Iterator[Callable[..., RecordingServer]]:
    """``https_server(context, redirect_to=None, body=b"")``: start a :class:`RecordingServer`
    with the server-side TLS ``context`` (``None``: plain HTTP); every server started is closed
    after the test."""
    started = servers.Servers()
    yield started
    started.close()


@pytest.fixture
def redirect_servers(
    tmp_path: Path, https_server: Callable[..., RecordingServer]
) -> tuple[RecordingServer, RecordingServer, str]:
    """``(redirector, recorder, ca_path)``: the redirector answers every request with a 307 to
    the recorder (another origin); both use a certificate of a CA made for this test."""
    ca_path = tmp_path / "ca.pem"
    context = servers.server_context("127.0.0.1", ca_path)
    recorder = https_server(context)
    redirector = https_server(context, recorder.url)
    return redirector, recorder, str(ca_path)


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingProxy]:
    """A :class:`RecordingProxy`, with no proxy variable set (tests set the ones they need)."""
    for name in servers.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    server = RecordingProxy()
    yield server
    server.close()


@pytest.fixture
def resolve_to_loopback(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """``resolve_to_loopback(host)``: name resolution in this process maps ``host`` to
    127.0.0.1 and refuses every other name that is not a loopback one, so that a test using a
    non-loopback broker name never sends a packet off this machine."""
    return servers.resolve_to_loopback(monkeypatch)


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
    ca_path = tmp_path / "remote-ca.pem"
    context = servers.server_context("broker.example", ca_path)
    server = https_server(context, body=b'{"items": []}')
    resolve_to_loopback("broker.example")
    return f"https://broker.example:{server.port}", str(ca_path), server


# ------------------------------------------------------------------------------ echoed tokens


@pytest.fixture
def token_echoes() -> list[TokenEcho]:
    """Scripted broker answers (for httpx.MockTransport) that repeat the caller's token
    (``ECHO_CALLER_TOKEN``), a bearer token or a JWT, each in another part of the answer."""
    return echoes.token_echoes()


@pytest.fixture
def find_leaks() -> Callable[[BaseException, TokenEcho], list[str]]:
    """``find_leaks(error, echo)``: the secrets of ``echo`` that ``error`` shows."""
    return echoes.leaked


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
