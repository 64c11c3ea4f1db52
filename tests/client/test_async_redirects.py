"""The async client follows no redirect, and no Authorization reaches another origin (own
loopback HTTPS servers)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import (
    AsyncBrokerSandboxClient,
    AsyncSandbox,
    BrokerConnectionConfig,
    BrokerRedirectError,
)
from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget, SandboxInfo
from k8s_agent_sandbox_awx.credentials._credential import Credential

pytestmark = pytest.mark.e2e

TOKEN = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ0ZXN0In0.c2VjcmV0LXNpZ25hdHVyZQ"


class Source:
    def get_credential(self, audience: str) -> Credential:
        raise AssertionError("async path only")

    async def aget_credential(self, audience: str) -> Credential:
        return Credential(token=TOKEN, provider="stub", source="test")

    def invalidate(self, audience: str) -> None:
        pass


def test_no_redirect_is_followed(redirect_servers: Any, tmp_path: Path) -> None:
    redirector, recorder, ca = redirect_servers
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
