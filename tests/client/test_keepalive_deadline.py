"""The keepalive's one short attempt is bounded in all, not per read (issue 19 item 10, as the
review found it: a control plane trickling its answer a byte a second held the data-plane call
for the whole answer). Async and sync, and after a
trickled extension the keepalive still works: the next opportunity extends the sandbox."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from starlette.responses import StreamingResponse

from k8s_agent_sandbox_awx import AsyncSandbox, KubernetesAuth, Sandbox
from k8s_agent_sandbox_awx.client.wire._protocol import rfc3339_seconds

pytestmark = pytest.mark.e2e


def _options(broker: Any) -> dict[str, Any]:
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    auth = KubernetesAuth(env.pop("AGENT_SANDBOX_TOKEN_FILE"))
    return {"auth": auth, "environ": env}


def _trickling(extend: Callable[..., Any], seconds: int = 8) -> Callable[..., Any]:
    """The broker's extension, answered a byte a second for ``seconds`` bytes."""

    async def trickle(*args: Any) -> Any:
        answer = await extend(*args)
        body = bytes(answer.body)

        async def slowly() -> AsyncIterator[bytes]:
            for i in range(len(body)):
                if i < seconds:
                    await asyncio.sleep(1.0)
                yield body[i : i + 1]

        return StreamingResponse(slowly(), media_type="application/json")

    return trickle


def _deadline(broker: Any, name: str) -> float:
    [claim] = [c for c in broker.claims() if c["metadata"]["name"] == name]
    return rfc3339_seconds(claim["spec"]["lifecycle"]["shutdownTime"]) or 0


def test_an_async_call_waits_for_a_trickling_extension_two_seconds_at_most(
    files_broker: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    app = files_broker._require_app().v1
    extend = app._extend

    async def main() -> float:
        sb = await AsyncSandbox.create(timeout=30, keepalive=100, **_options(files_broker))
        async with sb:
            monkeypatch.setattr(app, "_extend", _trickling(extend))
            started = time.monotonic()
            assert await sb.files.exists("nothing") is False
            took = time.monotonic() - started
            monkeypatch.setattr(app, "_extend", extend)
            return took

    with caplog.at_level("WARNING", logger="k8s_agent_sandbox_awx.transport"):
        took = asyncio.run(main())
    assert took < 3.0, f"the data-plane call waited {took:.1f} s for the keepalive"
    assert "failed (ignored): no answer within 2 s in all" in caplog.text, caplog.text


def test_after_a_trickled_extension_the_next_opportunity_extends(
    files_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = files_broker._require_app().v1
    extend = app._extend
    with Sandbox.create(timeout=30, keepalive=100, **_options(files_broker)) as sb:
        monkeypatch.setattr(app, "_extend", _trickling(extend))
        started = time.monotonic()
        assert sb.files.exists("nothing") is False
        assert time.monotonic() - started < 3.0
        monkeypatch.setattr(app, "_extend", extend)
        keepalive = sb.files._api.target.keepalive
        applied = _deadline(files_broker, sb.name)  # the broker extended before it trickled
        assert (keepalive.deadline or 0) < applied  # but its answer never came
        until = time.monotonic() + 10  # the late attempt gives up at its deadline, then ends
        while (keepalive.deadline or 0) < applied:
            assert time.monotonic() < until, "the keepalive never extended the sandbox again"
            assert sb.files.exists("nothing") is False
            time.sleep(0.2)
        assert _deadline(files_broker, sb.name) == keepalive.deadline


@pytest.mark.slow
def test_a_trickling_control_plane_never_holds_the_call(
    files_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = files_broker._require_app().v1
    extend = app._extend

    async def trickle(*args: Any) -> Any:
        answer = await extend(*args)  # the real extension, answered slowly
        body = bytes(answer.body)

        async def slowly() -> Any:
            for i in range(len(body)):
                if i < 10:
                    await asyncio.sleep(1.0)
                yield body[i : i + 1]

        return StreamingResponse(slowly(), media_type="application/json")

    with Sandbox.create(timeout=30, keepalive=100, **_options(files_broker)) as sb:
        monkeypatch.setattr(app, "_extend", trickle)
        started = time.monotonic()
        assert sb.files.exists("nothing") is False
        took = time.monotonic() - started
        monkeypatch.setattr(app, "_extend", extend)
    assert took < 3.0, f"the data-plane call waited {took:.1f} s for the keepalive"
