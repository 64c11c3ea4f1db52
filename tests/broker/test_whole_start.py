"""The streamed start answered whole (``Prefer: no-live-output``): the local runtime holds the
answer of a start whose reader shows no output live until the command's exit, and sends it with
a ``Content-Length``; past the hold (the heartbeat interval) or 256 KiB of events it streams as
usual. Through the broker (real HTTPS, real tokens, httpx)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

STREAMED = "application/x-ndjson, application/json;q=0.5"


def _start(
    api: Any, sandbox: dict[str, Any], script: str, prefer: str | None
) -> tuple[httpx.Response, list[dict[str, Any]]]:
    headers = {**api.data_headers(sandbox), "Accept": STREAMED}
    if prefer is not None:
        headers["Prefer"] = prefer
    body = {"command": ["/bin/bash", "-c", script], "request_id": str(uuid.uuid4())}
    resp = api.http.post("/commands", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    return resp, [json.loads(line) for line in resp.text.splitlines()]


def _outcome(lines: list[dict[str, Any]]) -> tuple[str, Any]:
    """The output and the exit code of a streamed start's lines (checked contiguous)."""
    assert set(lines[0]) == {"command_id"}
    events = [event for event in lines[1:] if event["type"] != "heartbeat"]
    assert [event["seq"] for event in events] == list(range(1, len(events) + 1))
    assert events[-1]["type"] == "exit"
    return "".join(e["data"] for e in events if e["type"] == "stdout"), events[-1]["exit_code"]


@pytest.mark.parametrize("prefer", ["no-live-output", "respond-async, No-Live-Output"])
def test_a_start_that_shows_no_output_live_is_answered_whole_at_the_exit(
    alice: Any, sandbox: dict[str, Any], prefer: str
) -> None:
    resp, lines = _start(alice, sandbox, "echo one; echo two >&2; exit 3", prefer)
    assert resp.headers["content-length"] == str(len(resp.content))
    assert "transfer-encoding" not in resp.headers
    assert resp.headers["preference-applied"] == "no-live-output"
    assert _outcome(lines) == ("one\n", 3)
    assert [event["type"] for event in lines[1:]].count("stderr") == 1


def test_without_the_preference_the_start_streams_as_before(
    alice: Any, sandbox: dict[str, Any]
) -> None:
    resp, lines = _start(alice, sandbox, "echo one; exit 3", None)
    assert resp.headers["transfer-encoding"] == "chunked"
    assert "preference-applied" not in resp.headers
    assert _outcome(lines) == ("one\n", 3)


def test_a_held_start_streams_once_its_hold_has_passed(alice: Any) -> None:
    """The hold is the heartbeat interval: a command that runs longer streams from then on."""
    sandbox = alice.ready(env={"SANDBOX_COMMAND_HEARTBEAT_SECONDS": "0.2"})
    resp, lines = _start(alice, sandbox, "echo early; sleep 0.8; echo late", "no-live-output")
    assert resp.headers["transfer-encoding"] == "chunked"
    assert "preference-applied" not in resp.headers
    assert _outcome(lines) == ("early\nlate\n", 0)


def test_a_held_start_streams_once_it_holds_more_than_a_batch(
    alice: Any, sandbox: dict[str, Any]
) -> None:
    """Output beyond 256 KiB is not held (the runtime's memory per start stays bounded)."""
    script = "head -c 600000 /dev/zero | tr '\\0' a"
    resp, lines = _start(alice, sandbox, script, "no-live-output")
    assert resp.headers["transfer-encoding"] == "chunked"
    assert _outcome(lines) == ("a" * 600000, 0)
