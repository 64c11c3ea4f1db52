"""The local broker runs in its caller's test process, where tests patch the ``time`` module:
its event loop's timers and its answers' ``Date`` keep to the clocks the process had at import.

A test that patched ``time.monotonic`` (asyncio's clock) a minute ahead for a moment held every
timer the broker's loop armed meanwhile for that minute, uvicorn's tick among them: the answers
kept the Date of before the patch, and ``doctor`` 62 s later failed its clock-skew check."""

from __future__ import annotations

import asyncio
import ssl
import threading
import time
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import pytest


def _on_loop(broker: Any, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, broker._loop).result(10)


def test_a_patched_monotonic_clock_holds_no_timer_of_the_broker(broker: Any) -> None:
    fired = threading.Event()

    async def arm() -> None:
        asyncio.get_running_loop().call_later(0.01, fired.set)

    now = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "monotonic", lambda: now + 3600)
        _on_loop(broker, arm())  # armed while the clock reads an hour ahead
    assert fired.wait(30), "the broker's timer followed the patched clock"


def test_a_patched_wall_clock_never_dates_the_brokers_answers(broker: Any) -> None:
    real = time.time()
    context = ssl.create_default_context(cafile=broker.ca_bundle)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "time", lambda: 0.0)  # 1970
        _on_loop(broker, broker._server.on_tick(0))  # a tick that re-makes uvicorn's Date
        answer = httpx.get(broker.url + "/healthz", verify=context)
    dated = parsedate_to_datetime(answer.headers["date"]).timestamp()
    assert abs(dated - real) < 60, answer.headers["date"]
