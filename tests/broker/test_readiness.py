"""``/readyz`` and one issuer's outage (issue 22's review): every replica sees the same
outage, so one external issuer whose keys went stale must not take the broker out of its
Service for every caller. Ready = the backend is ready and every issuer has had keys once
since start; an issuer whose keys went stale later is named in the body (``degraded``) and in
the metrics, and its tokens are refused ``503 issuer_unavailable``; the other issuers' callers
go on.

Two real HTTPS issuers (``ScriptedIssuer``, keys generated at test time) and the app ``broker
serve`` runs (``app_factory``, the local backend), probes in front, over ASGI."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

pytest.importorskip("starlette", reason="needs the [broker] extra")

from k8s_agent_sandbox_awx.broker._app_factory import ConfiguredBroker, app_factory
from k8s_agent_sandbox_awx.broker.config import load_config
from k8s_agent_sandbox_awx.broker.server._probes import with_probes
from tests._support.oidc_issuer import JWKS, ScriptedIssuer
from tests._support.scripted_https import Reply

PUBLIC_URL = "https://sandbox-broker.example.com"
CACHE_SECONDS = 1.0
STALE_SECONDS = 2.0


def _issuer(name: str, issuer: ScriptedIssuer) -> str:
    return f"""
[[issuers]]
name = "{name}"
url = "{issuer.url}"
provider = "{name}"
audiences = ["{PUBLIC_URL}"]
jwks_url = "{issuer.url}{JWKS}"
ca_file = "{issuer.ca_file}"
jwks_cache_seconds = {CACHE_SECONDS}
jwks_min_refetch_seconds = 0
jwks_max_stale_seconds = {STALE_SECONDS}

[[policies]]
name = "{name}"
issuer = "{name}"
warm_pools = ["python"]
namespace = "team-a"
"""


class Broker:
    def __init__(self, folder: Path, issuers: dict[str, ScriptedIssuer]) -> None:
        for name in ("tls.crt", "tls.key"):
            (folder / name).write_text("made by the test\n")
        config = folder / "broker.toml"
        config.write_text(
            f'[server]\npublic_url = "{PUBLIC_URL}"\ntls_cert_file = "tls.crt"\n'
            'tls_key_file = "tls.key"\n'
            + "".join(_issuer(name, issuer) for name, issuer in issuers.items())
            + '\n[backend]\nkind = "local"\n'
        )
        served = app_factory(load_config(config))
        assert isinstance(served.app, ConfiguredBroker)
        self.broker = served.app
        self.issuers = issuers
        app = with_probes(served.app, served.ready, served.degraded)
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=PUBLIC_URL)

    async def readyz(self) -> tuple[int, dict[str, Any]]:
        answer = await self.http.get("/readyz")
        return answer.status_code, answer.json()

    async def whoami(self, name: str) -> httpx.Response:
        token = self.issuers[name].token(f"{name}-caller", aud=PUBLIC_URL)
        return await self.http.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"})

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while (answer := await self.readyz())[0] != 200:
            assert time.monotonic() < deadline, answer
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture
async def issuers(tmp_path: Path) -> AsyncIterator[dict[str, ScriptedIssuer]]:
    async with ScriptedIssuer(tmp_path) as cluster, ScriptedIssuer(tmp_path) as github:
        yield {"cluster": cluster, "github": github}


@pytest_asyncio.fixture
async def configured(tmp_path: Path, issuers: dict[str, ScriptedIssuer]) -> AsyncIterator[Broker]:
    broker = Broker(tmp_path, issuers)
    await broker.broker.startup()
    try:
        yield broker
    finally:
        await broker.http.aclose()
        await broker.broker.shutdown()


@pytest.mark.asyncio
async def test_an_idle_broker_stays_ready_while_its_issuers_are_up(configured: Broker) -> None:
    """The keys were refreshed only when a token needed them: a broker without callers for
    longer than jwks_max_stale_seconds (1 hour by default) had every issuer "not ready" and
    /readyz 503 on every replica, with every issuer up."""
    await configured.wait_ready()
    await asyncio.sleep(2 * STALE_SECONDS + 0.5)  # no token in the meantime
    assert await configured.readyz() == (200, {"status": "ready"})
    assert (await configured.whoami("github")).status_code == 200


@pytest.mark.asyncio
async def test_an_issuers_later_outage_degrades_only_its_callers(configured: Broker) -> None:
    await configured.wait_ready()
    assert await configured.readyz() == (200, {"status": "ready"})
    configured.issuers["github"].replies[JWKS] = Reply(503, {"error": "down"})
    await asyncio.sleep(STALE_SECONDS + 0.2)  # its last good keys are past their bound

    refused = await configured.whoami("github")
    assert refused.status_code == 503, refused.text
    body = refused.json()
    assert body["code"] == "issuer_unavailable"
    assert "issuer 'github'" in body["detail"] and "answered 503" in body["detail"]
    assert refused.headers["retry-after"].isdigit()
    assert (await configured.whoami("cluster")).status_code == 200  # the other issuer goes on

    status, ready = await configured.readyz()
    assert status == 200 and ready["status"] == "ready", ready
    assert list(ready["degraded"]) == ["issuer github"]
    assert "answered 503" in ready["degraded"]["issuer github"]

    del configured.issuers["github"].replies[JWKS]  # the issuer is back
    deadline = time.monotonic() + 10
    while (answer := await configured.whoami("github")).status_code != 200:
        assert time.monotonic() < deadline, answer.text
        await asyncio.sleep(0.1)
    assert await configured.readyz() == (200, {"status": "ready"})


@pytest.mark.asyncio
async def test_a_replica_whose_issuer_never_had_keys_is_not_ready(
    tmp_path: Path, issuers: dict[str, ScriptedIssuer]
) -> None:
    issuers["github"].replies[JWKS] = Reply(503, {"error": "down"})
    broker = Broker(tmp_path, issuers)
    await broker.broker.startup()
    try:
        deadline = time.monotonic() + 10

        def settled(body: dict[str, Any]) -> bool:  # both issuers' first fetches have ended
            waiting = body.get("not_ready", {})
            return "issuer cluster" not in waiting and "no keys loaded yet" not in str(waiting)

        while not settled((answer := await broker.readyz())[1]):
            assert time.monotonic() < deadline, answer
            await asyncio.sleep(0.05)
        status, body = answer
        assert status == 503 and list(body["not_ready"]) == ["issuer github"], body
        assert "answered 503" in body["not_ready"]["issuer github"]
        # a misconfigured or unreachable issuer that never had keys: its tokens are refused
        # as before (401 bad_signature, with the reason), not as an outage
        refused = await broker.whoami("github")
        assert (refused.status_code, refused.json()["code"]) == (401, "bad_signature")
    finally:
        await broker.http.aclose()
        await broker.broker.shutdown()
