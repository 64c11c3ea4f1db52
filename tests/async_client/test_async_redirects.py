"""The async client follows no redirect, and no Authorization reaches another origin (own
loopback HTTPS servers)."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import (
    AsyncBrokerSandboxClient,
    AsyncSandbox,
    BrokerConnectionConfig,
    BrokerRedirectError,
)
from k8s_agent_sandbox_awx._credential import Credential
from k8s_agent_sandbox_awx._protocol import RouterTarget, SandboxInfo

pytestmark = pytest.mark.e2e

TOKEN = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ0ZXN0In0.c2VjcmV0LXNpZ25hdHVyZQ"


class Source:
    def get_credential(self, audience: str) -> Credential:
        raise AssertionError("async path only")

    async def aget_credential(self, audience: str) -> Credential:
        return Credential(token=TOKEN, provider="stub", source="test")

    def invalidate(self, audience: str) -> None:
        pass


class _Server:
    def __init__(self, context: ssl.SSLContext, redirect_to: str | None) -> None:
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
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[_Server, _Server, str]]:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    recorder = _Server(context, None)
    redirector = _Server(context, recorder.url)
    yield redirector, recorder, str(ca_path)
    redirector.close()
    recorder.close()


def test_no_redirect_is_followed(servers: Any, tmp_path: Path) -> None:
    redirector, recorder, ca = servers
    config = BrokerConnectionConfig(broker_url=redirector.url, ca_cert=ca, max_attempts=1)

    async def main() -> None:
        async with AsyncBrokerSandboxClient(config, auth=Source()) as client:
            calls = (client.whoami, client.list_sandboxes, lambda: client.create_sandbox("py"))
            for call in calls:
                with pytest.raises(BrokerRedirectError) as info:
                    await call()
                assert info.value.location and info.value.location.startswith(recorder.url)
            sandbox = AsyncSandbox(
                client, SandboxInfo("s", "default", None, "Ready", True, RouterTarget("s"))
            )
            with pytest.raises(BrokerRedirectError):
                await sandbox.commands.run("echo hi")
            with pytest.raises(BrokerRedirectError):
                await sandbox.files.write("a.txt", b"data")
            with pytest.raises(BrokerRedirectError):
                await sandbox.files.read_to("a.txt", tmp_path / "out")
            sandbox._killed = True  # nothing to delete on exit

    asyncio.run(main())
    assert len(redirector.seen) == 6
    assert all(s["Authorization"] == f"Bearer {TOKEN}" for s in redirector.seen)
    assert recorder.seen == []  # the token never reached the other origin
