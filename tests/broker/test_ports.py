"""Port requests at the broker (issue 23): the policy's ``ports``, the ``commands`` scope, the
runtime's port reserved, the local backend's routes, WebSocket handshakes checked before they
are accepted. The end-to-end scenarios through the SDK are in tests/client/test_ports.py and
test_port_forward.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.datastructures import Headers

from k8s_agent_sandbox_awx.broker.common._errors import ApiError
from k8s_agent_sandbox_awx.broker.dataplane._ports import refuse_unsupported_upgrade
from k8s_agent_sandbox_awx.broker.identity._ports import parse_ports
from k8s_agent_sandbox_awx.broker.identity._rules import PolicyRule
from k8s_agent_sandbox_awx.broker.identity._settings import SettingsError
from k8s_agent_sandbox_awx.testing import LocalBroker, Policy
from tests._support import ws_client
from tests._support.port_server import free_port, running_port_app


@pytest.fixture
def app_port() -> Iterator[int]:
    """The app on a free port of this host (a local sandbox's ports are the host's): the
    broker's forwarding is what these tests are about; the SDK's tests start it in a sandbox."""
    with running_port_app() as port:
        yield port


# -- the policy knob -----------------------------------------------------------------------------
def test_ports_parse_ports_and_ranges() -> None:
    ranges = parse_ports([8000, "3000-3999", "9000"])
    assert ranges.allows(8000) and ranges.allows(3000) and ranges.allows(3999)
    assert ranges.allows(9000) and not ranges.allows(2999) and not ranges.allows(8001)
    assert ranges.describe() == [8000, "3000-3999", 9000]
    assert not parse_ports([]).allows(8000)
    assert Policy().port_ranges.describe() == ["1024-65535"]


@pytest.mark.parametrize("bad", [0, 70000, "4000-3000", "80-", "http", True, 8.5, "1-2-3"])
def test_a_bad_port_entry_names_itself_and_the_rule(bad: object) -> None:
    with pytest.raises(ValueError, match=r"Policy\.ports: .* is not a port or a range") as info:
        Policy(ports=(bad,))  # type: ignore[arg-type]
    assert repr(bad) in str(info.value) and "1 to 65535" in str(info.value)


def test_ports_must_be_a_list() -> None:
    with pytest.raises(ValueError, match="must be a list of ports and ranges"):
        parse_ports("8000")
    with pytest.raises(SettingsError, match="ports"):
        PolicyRule("p", "i", ("python",), "default", ports="8000")  # type: ignore[arg-type]
    rule = PolicyRule("p", "i", ("python",), "default", ports=(8000, "9000-9001"))
    assert rule.policy().port_ranges.describe() == [8000, "9000-9001"]


def test_an_upgrade_the_server_cannot_accept_is_501() -> None:
    with pytest.raises(ApiError) as info:
        refuse_unsupported_upgrade(Headers({"upgrade": "websocket"}))
    assert info.value.status == 501 and info.value.code == "websocket_unsupported"
    refuse_unsupported_upgrade(Headers({"upgrade": "h2c"}))  # not a WebSocket: stripped


# -- at the broker ---------------------------------------------------------------------------
@pytest.fixture
def narrow(broker: LocalBroker, api: Callable[..., Any]) -> Any:
    """A caller whose policy allows ports 18000 and 18100-18199 only."""
    name = "ports-narrow"
    if name not in broker.issuers:
        broker.add_issuer(
            name,
            policy=Policy(templates=("python",), namespace=name, ports=(18000, "18100-18199")),
        )
    return api(broker.issuers[name].issue_token("narrow-caller"))


@pytest.fixture
def files_only(broker: LocalBroker, api: Callable[..., Any]) -> Any:
    name = "ports-files-only"
    if name not in broker.issuers:
        broker.add_issuer(
            name, policy=Policy(templates=("python",), namespace=name, scopes=("files",))
        )
    return api(broker.issuers[name].issue_token("files-caller"))


def test_a_port_outside_the_policy_is_403_naming_it(narrow: Any) -> None:
    sandbox = narrow.ready()
    resp = narrow.http.get("/", headers=narrow.data_headers(sandbox, **{"X-Sandbox-Port": "8000"}))
    assert resp.status_code == 403
    assert resp.headers["agent-sandbox-broker-error"] == "port_not_allowed"
    detail = resp.json()["detail"]
    assert "port 8000" in detail and "[18000, '18100-18199']" in detail
    inside = narrow.http.get(
        "/", headers=narrow.data_headers(sandbox, **{"X-Sandbox-Port": "18150"})
    )
    assert inside.json()["code"] == "port_not_listening"  # allowed: it got as far as the port


def test_whoami_shows_the_ports_the_policy_allows(narrow: Any, alice: Any) -> None:
    """``GET /v1/whoami``'s policy names the ports a port request may reach, as the policy
    writes them (the default: every unprivileged port)."""
    assert narrow.http.get("/v1/whoami").json()["policy"]["ports"] == [18000, "18100-18199"]
    assert alice.http.get("/v1/whoami").json()["policy"]["ports"] == ["1024-65535"]


def test_a_files_only_sandbox_reaches_no_port(files_only: Any) -> None:
    sandbox = files_only.ready()
    headers = files_only.data_headers(sandbox, **{"X-Sandbox-Port": "18000"})
    resp = files_only.http.get("/", headers=headers)
    assert resp.status_code == 403 and resp.json()["code"] == "scope_denied"
    assert "'commands' scope" in resp.json()["detail"] and "port 18000" in resp.json()["detail"]


def test_the_runtime_port_stays_the_runtime_api(alice: Any) -> None:
    sandbox = alice.ready()
    for port in ({}, {"X-Sandbox-Port": "8888"}):  # the default, and named
        headers = alice.data_headers(sandbox, **port)
        resp = alice.http.get("/list;x", headers=headers)
        assert resp.status_code == 400 and resp.json()["code"] == "path_not_normalized"
        health = alice.http.get("/", headers=headers)
        assert health.status_code == 200 and "agent-sandbox-broker-error" not in health.headers


def test_another_sandboxes_runtime_is_no_port(broker: LocalBroker, alice: Any, bob: Any) -> None:
    mine = alice.ready()
    theirs = bob.ready()
    store = broker._require_store()
    with store.lock:
        record = store.sandboxes[theirs["name"]]
    assert record.handle is not None
    runtime_port = str(record.handle.port)
    resp = alice.http.get("/", headers=alice.data_headers(mine, **{"X-Sandbox-Port": runtime_port}))
    assert resp.status_code == 502 and resp.json()["code"] == "sandbox_unreachable"
    assert "a sandbox runtime's" in resp.json()["detail"]


def test_a_port_request_is_not_counted_and_not_normal_form(
    broker: LocalBroker, alice: Any, app_port: int
) -> None:
    sandbox = alice.ready()
    headers = alice.data_headers(sandbox, **{"X-Sandbox-Port": str(app_port)})
    resp = alice.http.post("/execute", content=b"{}", headers=headers)
    assert resp.status_code == 200 and resp.content == b"{}"  # the app's echo, not the runtime
    assert broker.execution_count(sandbox["name"]) == 0  # a port request runs no command
    odd = alice.http.get("/headers/%2e%2e;x", headers=headers)
    assert odd.status_code == 200 and odd.json()["path"] == "/headers/%2e%2e;x"


def test_a_port_requests_path_reaches_no_log_record(
    alice: Any, app_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A user's server may carry secrets in its paths (``/reset/<code>``): the broker logs the
    port request (sandbox, port, method), never its path (docs/broker/security.md)."""
    sandbox = alice.ready()
    headers = alice.data_headers(sandbox, **{"X-Sandbox-Port": str(app_port)})
    with caplog.at_level("DEBUG"):
        assert alice.http.get("/headers/reset-code-31337", headers=headers).status_code == 200
    ours = [r for r in caplog.records if r.name.startswith("k8s_agent_sandbox_awx")]
    lines = [r.getMessage() for r in ours]
    assert any(f"port {app_port} request GET" in line for line in lines), lines
    assert not [line for line in lines if "reset-code-31337" in line]


# -- WebSocket handshakes --------------------------------------------------------------------
def _ws(broker: LocalBroker, headers: dict[str, str], path: str = "/ws") -> ws_client.WebSocket:
    """A handshake to the broker itself over TLS."""
    return ws_client.connect_tls(broker.url, broker.ca_bundle, path, headers)


def test_websocket_handshakes_are_checked_first(
    broker: LocalBroker, alice: Any, bob: Any, app_port: int
) -> None:
    pytest.importorskip("websockets", reason="needs the [broker] extra (WebSocket upgrades)")
    sandbox = alice.ready()
    port = app_port
    router = alice.data_headers(sandbox, **{"X-Sandbox-Port": str(port)})
    cases = [
        ({**router}, b"401"),  # no token
        ({**router, "Authorization": f"Bearer {bob.token}"}, b"403"),  # not the owner
        ({**alice.data_headers(sandbox), "Authorization": f"Bearer {alice.token}"}, b"400"),
    ]
    for headers, status in cases:
        ws = _ws(broker, headers)
        ws.sock.close()
        assert ws.head.split(b" ")[1] == status, ws.head
        assert b"agent-sandbox-broker-error" in ws.head.lower()
    ws = _ws(broker, {**router, "Authorization": f"Bearer {alice.token}"})
    assert ws.head.startswith(b"HTTP/1.1 101"), ws.head  # checked, then accepted
    ws.send(1, b"checked")
    assert ws.recv() == (1, b"checked")
    ws.sock.close()
    missing = _ws(broker, {**router, "Authorization": f"Bearer {alice.token}"}, "/headers")
    missing.sock.close()
    assert missing.head.startswith(b"HTTP/1.1 200")  # the server's own answer, relayed
    assert b"agent-sandbox-broker-error" not in missing.head.lower()


# -- the Kubernetes backend's routes ------------------------------------------------------------
def _kube_state(**fields: Any) -> Any:
    from k8s_agent_sandbox_awx.broker.backends._interface import READY, Owner
    from k8s_agent_sandbox_awx.broker.backends.kubernetes._claims import KubeClaimState

    base: dict[str, Any] = dict(
        name="claim-1", namespace="team-a", template="python", owner=Owner("i", "s", "p"),
        labels={}, annotations={}, stamps={}, env={}, created_at=0.0, expires_at=1.0,
        phase=READY, reason=None, message=None, transition_at=0.0, started_at=0.0, bound=True,
        scopes=frozenset({"commands"}), uid="u", sandbox_name="sbx-1", pod_ips=("10.0.0.7",),
    )  # fmt: skip
    return KubeClaimState(**{**base, **fields})


async def _routes(settings: Any) -> Any:
    from k8s_agent_sandbox_awx.broker.backends.kubernetes._routes import Routes

    return Routes(settings)


def test_kubernetes_routes_a_port_request_to_that_port() -> None:
    import asyncio

    from k8s_agent_sandbox_awx.broker.backends._interface import Unroutable
    from k8s_agent_sandbox_awx.broker.backends.kubernetes._routes import RouteSettings

    state = _kube_state()

    async def main() -> None:
        router = await _routes(RouteSettings(router_url="http://router:8080", runtime_port=9999))
        pods = await _routes(RouteSettings(data_plane="pod", runtime_port=9999))
        try:
            headers = dict(router.route(state, 3000).headers)
            assert headers[b"x-sandbox-port"] == b"3000"  # the router takes it to the port
            assert dict(router.route(state, 8888).headers)[b"x-sandbox-port"] == b"9999"
            assert (pods.route(state, 3000).host, pods.route(state, 3000).port) == (
                "10.0.0.7",
                3000,
            )
            assert pods.route(state, 8888).port == 9999  # the runtime API
            with pytest.raises(Unroutable, match="runtime's own port"):
                pods.route(state, 9999)  # the runtime's real port is no user port either
        finally:
            await router.close()
            await pods.close()

    asyncio.run(main())


def test_kubernetes_pod_routes_keep_no_connection_to_a_users_server() -> None:
    """Straight to the pod (``data_plane = "pod"``), a port request gets a connection of its
    own, as on the local backend: a user's server is not ours to keep connections to (one
    that answers in several writes stalls 40 ms per request on a kept-alive connection);
    the runtime's API keeps its connections."""
    import asyncio

    from k8s_agent_sandbox_awx.broker.backends.kubernetes._routes import RouteSettings

    async def main() -> None:
        accepted: dict[int, int] = {}

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            port = writer.get_extra_info("sockname")[1]
            accepted[port] = accepted.get(port, 0) + 1
            try:
                while await reader.readuntil(b"\r\n\r\n"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        runtime = await asyncio.start_server(serve, "127.0.0.1", 0)
        user = await asyncio.start_server(serve, "127.0.0.1", 0)
        runtime_port = runtime.sockets[0].getsockname()[1]
        user_port = user.sockets[0].getsockname()[1]
        settings = RouteSettings(
            data_plane="pod", runtime_port=runtime_port, allow_loopback_pod_ips=True
        )
        routes = await _routes(settings)
        state = _kube_state(pod_ips=("127.0.0.1",))
        try:
            for port in (8888, user_port):
                for _ in range(3):
                    route = routes.route(state, port)
                    assert await _get(route) == b"ok"
            assert accepted == {runtime_port: 1, user_port: 3}, accepted
        finally:
            await routes.close()
            runtime.close()
            user.close()

    asyncio.run(main())


async def _get(route: Any) -> bytes:
    """``GET /`` over the route's client: the broker's own pool (a runtime's) or httpx."""
    import httpx

    from k8s_agent_sandbox_awx.broker.backends._http11 import Http11Pool

    if isinstance(route.client, Http11Pool):
        answer = await route.client.send(b"GET", b"/", [], None, httpx.Timeout(5.0))
        return b"".join([chunk async for chunk in answer.aiter_raw()])
    got = await route.client.get(f"http://{route.host}:{route.port}/")
    return bytes(got.content)


# -- wss through an HTTPS router ------------------------------------------------------------------
ROUTER_TOKEN = "router-credential-0123456789"
CALLER_TOKEN = "caller-credential-9876543210"


def _ws_scope(path: bytes = b"/ws") -> Any:
    """The ASGI scope of a caller's handshake, as the broker's server hands it over."""
    headers = [(b"authorization", f"Bearer {CALLER_TOKEN}".encode()), (b"x-sandbox-port", b"3000")]
    return {"type": "websocket", "path": path.decode(), "raw_path": path, "query_string": b"",
            "headers": headers, "subprotocols": []}  # fmt: skip


async def _tls_router(leaf: Any, seen: list[dict[str, str]]) -> Any:
    """A router stand-in over HTTPS (``leaf``: its certificate) taking WebSockets: it records
    the headers of each handshake and echoes every message back (as the port's server would,
    behind it)."""
    import ssl

    from websockets.asyncio.server import serve

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    leaf.configure_cert(context)

    async def echo(ws: Any) -> None:
        seen.append({k.lower(): v for k, v in ws.request.headers.raw_items()})
        async for message in ws:
            await ws.send(message)

    return await serve(echo, "127.0.0.1", 0, ssl=context, compression=None)


def test_wss_through_an_https_router_verifies_it_with_the_routes_ca(tmp_path: Path) -> None:
    """With ``router_ca_file``, a WebSocket through the router is verified against that CA,
    as the HTTP path is: a router whose certificate the CA signed is reached (the broker's
    router credential sent, the caller's not); one it did not sign is a typed ``502
    sandbox_unreachable`` naming TLS verification (and no credential)."""
    pytest.importorskip("websockets", reason="needs the [broker] extra (WebSocket upgrades)")
    trustme = pytest.importorskip("trustme")
    import asyncio

    from starlette.requests import HTTPConnection

    from k8s_agent_sandbox_awx.broker.backends.kubernetes._routes import RouteSettings
    from k8s_agent_sandbox_awx.broker.dataplane._data_request import DataRequest
    from k8s_agent_sandbox_awx.broker.dataplane._target import port_target
    from k8s_agent_sandbox_awx.broker.dataplane._websocket import _open

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "token").write_text(ROUTER_TOKEN)
    stranger = trustme.CA().issue_cert("127.0.0.1")  # a certificate the route's CA did not sign
    data = DataRequest("sbx-1", "team-a", 3000, 30.0, port_target(b"/ws"))
    connection = HTTPConnection(_ws_scope())

    async def main() -> None:
        seen: list[dict[str, str]] = []
        good = await _tls_router(ca.issue_cert("127.0.0.1"), seen)
        bad = await _tls_router(stranger, seen)
        routes = []
        try:
            for server in (good, bad):
                port = server.sockets[0].getsockname()[1]
                settings = RouteSettings(
                    router_url=f"https://127.0.0.1:{port}",
                    router_token_file=tmp_path / "token",
                    router_ca_file=tmp_path / "ca.pem",
                )
                routes.append(await _routes(settings))
            upstream = await _open(routes[0].route(_kube_state(), 3000), data, connection, "c-1")
            await upstream.send("through the router")
            assert await upstream.recv() == "through the router"
            await upstream.close()
            [headers] = seen
            assert headers["authorization"] == f"Bearer {ROUTER_TOKEN}"  # the broker's own
            assert (headers["x-sandbox-id"], headers["x-sandbox-port"]) == ("sbx-1", "3000")
            with pytest.raises(ApiError) as info:
                await _open(routes[1].route(_kube_state(), 3000), data, connection, "c-1")
            error = info.value
            assert (error.status, error.code) == (502, "sandbox_unreachable")
            assert "TLS" in error.detail and "verif" in error.detail, error.detail
            assert "router_ca_file" in error.detail, error.detail  # the setting to check
            assert ROUTER_TOKEN not in error.detail and CALLER_TOKEN not in error.detail
            assert len(seen) == 1  # refused before any handshake reached the stranger
        finally:
            for route in routes:
                await route.close()
            for server in (good, bad):
                server.close()
                await server.wait_closed()

    asyncio.run(main())


def test_a_websocket_while_the_backend_is_unavailable_is_a_503_like_http() -> None:
    """A backend that cannot answer (its API server unreachable) during a WebSocket handshake
    is the broker's ``503 backend_unavailable`` with ``Retry-After``, as for an HTTP request,
    not an error of the server (500 and a traceback)."""
    import asyncio
    import json

    from k8s_agent_sandbox_awx.broker.backends._interface import BackendUnavailable
    from k8s_agent_sandbox_awx.broker.dataplane._forward import Forward
    from k8s_agent_sandbox_awx.broker.dataplane._websocket import WebSocketForward
    from k8s_agent_sandbox_awx.broker.identity._policy import Caller

    class Gate:
        async def authenticate(self, connection: Any) -> Caller:
            return Caller("kubernetes", "https://issuer", "alice", "aud", 2**31)

    class Backend:
        async def get(self, name: str, **_: Any) -> None:
            raise BackendUnavailable("the Kubernetes API server is unreachable (test)")

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    scope = _ws_scope()
    scope["headers"] = [*scope["headers"], (b"x-sandbox-id", b"sbx-1")]
    forward = Forward(Backend(), Gate(), None)  # type: ignore[arg-type]
    asyncio.run(WebSocketForward(forward).handle(scope, receive, send))
    start, body = sent
    assert (start["type"], start["status"]) == ("websocket.http.response.start", 503)
    headers = dict(start["headers"])
    assert headers[b"retry-after"] == b"2" and headers[b"agent-sandbox-broker-error"] == (
        b"backend_unavailable"
    )
    assert json.loads(body["body"]) == {
        "code": "backend_unavailable",
        "detail": "the Kubernetes API server is unreachable (test)",
    }


# -- what failed, through a router (the HTTP and the WebSocket path) ------------------------------
ROUTER_REFUSED = b'{"detail": "Could not connect to the backend sandbox: sbx-1"}'
"""What upstream's routers (the Python and the Go one) answer when they cannot connect to the
sandbox's port: ``502`` with this body (its last word: the X-Sandbox-ID they were sent)."""


async def _answering_router(leaf: Any, status: int, body: bytes) -> Any:
    """A router stand-in over HTTPS (``leaf``: its certificate) answering every request, a
    WebSocket handshake too, with ``status`` and the JSON ``body``."""
    import asyncio
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    leaf.configure_cert(context)
    head = f"HTTP/1.1 {status} Router\r\ncontent-type: application/json\r\n"
    answer = (head + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        except (asyncio.IncompleteReadError, OSError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)


def _forward_app(routes: Any) -> Any:
    """The data plane's forward (:class:`Forward`) over the Kubernetes ``routes``, as the
    broker's app answers it (its errors as JSON), for a caller who owns ``claim-1``."""
    from starlette.requests import Request

    from k8s_agent_sandbox_awx.broker.dataplane._forward import Forward
    from k8s_agent_sandbox_awx.broker.identity._policy import Caller

    class Gate:
        async def authenticate(self, connection: Any) -> Caller:
            return Caller("p", "i", "s", "aud", 2**31)

    class Backend:
        async def get(self, name: str, **_: Any) -> Any:
            return _kube_state()

        async def route(self, state: Any, port: int) -> Any:
            return routes.route(state, port)

    class Policies:
        def policy_for(self, caller: Caller) -> Policy:
            return Policy()

    forward = Forward(Backend(), Gate(), Policies())  # type: ignore[arg-type]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        try:
            await forward.handle(Request(scope, receive), send)
        except ApiError as exc:
            await exc.response()(scope, receive, send)

    return app


PORT_HEADERS = {"X-Sandbox-ID": "claim-1", "X-Sandbox-Namespace": "team-a",
                "X-Sandbox-Port": "3000", "Authorization": f"Bearer {CALLER_TOKEN}"}  # fmt: skip


def _router_settings(tmp_path: Path, port: int) -> Any:
    from k8s_agent_sandbox_awx.broker.backends.kubernetes._routes import RouteSettings

    return RouteSettings(
        router_url=f"https://127.0.0.1:{port}",
        router_token_file=tmp_path / "token",
        router_ca_file=tmp_path / "ca.pem",
    )


def test_a_port_request_through_a_router_names_what_failed(tmp_path: Path) -> None:
    """Through a router, ``port_not_listening`` is only the router's own answer that it could
    not connect to the port; a router whose certificate the CA did not sign is ``502
    sandbox_unreachable`` naming TLS verification and ``router_ca_file``; a router that cannot
    be reached is ``502 sandbox_unreachable`` naming the router's address. Another ``502`` of
    the router (or of the server behind it) is relayed as it came."""
    trustme = pytest.importorskip("trustme")
    import asyncio

    import httpx

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "token").write_text(ROUTER_TOKEN)
    free = free_port()

    async def main() -> dict[str, httpx.Response]:
        servers = {
            "refused": await _answering_router(ca.issue_cert("127.0.0.1"), 502, ROUTER_REFUSED),
            "other": await _answering_router(ca.issue_cert("127.0.0.1"), 502, b'{"detail":"x"}'),
            "stranger": await _answering_router(
                trustme.CA().issue_cert("127.0.0.1"), 502, ROUTER_REFUSED
            ),
        }
        ports = {name: s.sockets[0].getsockname()[1] for name, s in servers.items()}
        answers = {}
        try:
            for name, port in {**ports, "down": free}.items():
                routes = await _routes(_router_settings(tmp_path, port))
                transport = httpx.ASGITransport(app=_forward_app(routes))
                async with httpx.AsyncClient(transport=transport, base_url="http://b") as http:
                    answers[name] = await http.get("/app", headers=PORT_HEADERS)
                await routes.close()
        finally:
            for server in servers.values():
                server.close()
        return answers

    answers = asyncio.run(main())
    codes = {name: a.headers.get("agent-sandbox-broker-error") for name, a in answers.items()}
    assert codes == {
        "refused": "port_not_listening",
        "other": None,  # not the broker's: relayed
        "stranger": "sandbox_unreachable",
        "down": "sandbox_unreachable",
    }, codes
    assert all(a.status_code == 502 for a in answers.values())
    assert "port 3000" in answers["refused"].json()["detail"]
    assert answers["other"].content == b'{"detail":"x"}'
    tls = answers["stranger"].json()["detail"]
    assert "TLS" in tls and "verif" in tls and "router_ca_file" in tls, tls
    down = answers["down"].json()["detail"]
    assert f"router at 127.0.0.1:{free}" in down and "router_url" in down, down
    assert "nothing listens" not in tls + down
    for answer in answers.values():
        assert ROUTER_TOKEN not in answer.text and CALLER_TOKEN not in answer.text


def test_a_websocket_through_a_router_names_what_failed(tmp_path: Path) -> None:
    """The same on the WebSocket path: a router that cannot be reached is ``502
    sandbox_unreachable`` naming its address (it was ``port_not_listening``); a router that
    answers the handshake that it could not connect to the port (upstream's Go router) is
    ``502 port_not_listening``."""
    pytest.importorskip("websockets", reason="needs the [broker] extra (WebSocket upgrades)")
    trustme = pytest.importorskip("trustme")
    import asyncio

    from starlette.requests import HTTPConnection

    from k8s_agent_sandbox_awx.broker.dataplane._data_request import DataRequest
    from k8s_agent_sandbox_awx.broker.dataplane._target import port_target
    from k8s_agent_sandbox_awx.broker.dataplane._websocket import _open

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "token").write_text(ROUTER_TOKEN)
    data = DataRequest("sbx-1", "team-a", 3000, 30.0, port_target(b"/ws"))
    connection = HTTPConnection(_ws_scope())
    free = free_port()

    async def main() -> dict[str, ApiError]:
        refusing = await _answering_router(ca.issue_cert("127.0.0.1"), 502, ROUTER_REFUSED)
        ports = {"refused": refusing.sockets[0].getsockname()[1], "down": free}
        errors = {}
        try:
            for name, port in ports.items():
                routes = await _routes(_router_settings(tmp_path, port))
                try:
                    await _open(routes.route(_kube_state(), 3000), data, connection, "claim-1")
                except ApiError as exc:
                    errors[name] = exc
                finally:
                    await routes.close()
        finally:
            refusing.close()
        return errors

    errors = asyncio.run(main())
    assert {name: (e.status, e.code) for name, e in errors.items()} == {
        "refused": (502, "port_not_listening"),
        "down": (502, "sandbox_unreachable"),
    }
    assert "port 3000" in errors["refused"].detail
    down = errors["down"].detail
    assert f"router at 127.0.0.1:{free}" in down and "nothing listens" not in down, down
