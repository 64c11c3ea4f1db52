"""A caller's ways to break a command, held off by the runtime: a lone surrogate in its argv or
environment is refused (no broken answer, no ghost command filling ``max_running``), its
``cwd="/workspace"`` never follows a replaced root, and a reader that replays from ``after=0``
again and again does not hold it (the bookkeeping: tests/broker/test_follower_repeats.py)."""

from __future__ import annotations

import json
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.isolation import ROOTS_ARE_MOUNTS, host_processes_only

# -- a lone surrogate: a refusal, not a broken runtime answer and a ghost command -----------------


@pytest.mark.parametrize("where", ["argv", "envs"])
def test_a_lone_surrogate_is_refused_and_leaves_no_ghost_command(alice: Any, where: str) -> None:
    """JSON can carry ``"\\ud800"``; the runtime must refuse it (400, like a NUL byte), not die
    in the answer (the broker's 502 tells the client to create a new sandbox) and leave a
    command ``running`` with no process: it cannot be killed, is never swept, and counts
    against ``SANDBOX_COMMAND_MAX_RUNNING``, so the sandbox soon refuses every command."""
    sandbox = alice.ready(env={"SANDBOX_COMMAND_MAX_RUNNING": "1"})
    headers = alice.data_headers(sandbox)
    bad: dict[str, Any] = {"command": ["echo", "\ud800"]}
    if where == "envs":
        bad = {"command": ["true"], "envs": {"A": "\ud800"}}
    # json.dumps escapes the surrogate as \ud800: a valid JSON body
    started = alice.http.post("/commands", content=json.dumps(bad), headers=headers)
    assert started.status_code == 400, started.text
    after = alice.http.post("/commands", json={"command": ["true"]}, headers=headers)
    assert after.status_code == 200, after.text  # max_running (1) is not taken by a ghost
    listed = alice.http.get("/commands", headers=headers).json()["commands"]
    assert [c for c in listed if c["state"] == "running" and c["pid"] is None] == []


# -- item 5: a command's cwd under a replaced root ------------------------------------------------


@host_processes_only(ROOTS_ARE_MOUNTS)
def test_a_command_cwd_never_follows_a_replaced_root(alice: Any, tmp_path: Path) -> None:
    sandbox = alice.ready()
    outside = tmp_path / "outside"
    outside.mkdir()
    swapped = alice.run(
        sandbox,
        f'sh -c "rm -rf $SANDBOX_WORKSPACE_DIR && ln -s {outside} $SANDBOX_WORKSPACE_DIR"',
    ).json()
    assert swapped["exit_code"] == 0, swapped
    headers = alice.data_headers(sandbox)
    refused = alice.http.get("/fs/list", params={"path": "/workspace"}, headers=headers)
    assert refused.json()["code"] == "root_replaced"  # the file API's rule
    started = alice.http.post(
        "/commands",
        json={"command": ["touch", "written-through-cwd"], "cwd": "/workspace"},
        headers=headers,
    )
    time.sleep(0.5)
    assert not (outside / "written-through-cwd").exists()
    assert started.status_code in (400, 403), started.text


# -- item 2: a reader that never acknowledges -----------------------------------------------------

SMALL_WINDOW = {
    "SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES": "4096",
    "SANDBOX_COMMAND_LIVE_WINDOW_BYTES": "16384",
    "SANDBOX_COMMAND_UNACKED_BYTES": "65536",
}
CHATTY = [
    "python3",
    "-u",
    "-c",
    "import time\nwhile True:\n    print('x' * 60)\n    time.sleep(0.0005)",
]


@pytest.mark.slow
def test_a_reader_replaying_from_the_start_does_not_hold_the_command(
    broker: LocalBroker, alice: Any
) -> None:
    """Reading is not acknowledging: a raw client that reads every stream to its end and then
    asks for ``after=0`` again never moves its pin, so nothing after the retained output may
    leave the window and the window's bound (its size plus ``SANDBOX_COMMAND_UNACKED_BYTES``)
    becomes a wall the command waits at, indefinitely. The command must keep running (a pin
    that never moves should give way at that bound, as a stalled reader's does)."""
    sandbox = alice.ready(env=SMALL_WINDOW)
    headers = alice.data_headers(sandbox)
    started = alice.http.post("/commands", json={"command": CHATTY, "timeout": 60}, headers=headers)
    command_id = started.json()["command_id"]

    def last_seq() -> int:
        status = alice.http.get(f"/commands/{command_id}", headers=headers).json()
        return int(status["last_seq"])

    stop = threading.Event()

    def replay_from_zero() -> None:
        with httpx.Client(
            base_url=broker.url,
            verify=ssl.create_default_context(cafile=broker.ca_bundle),
            headers={"Authorization": f"Bearer {alice.token}", **headers},
            timeout=30,
        ) as http:
            while not stop.is_set():
                params = {"after": 0, "duration": 2}
                with http.stream("GET", f"/commands/{command_id}/events", params=params) as r:
                    for _ in r.iter_bytes():
                        pass

    reader = threading.Thread(target=replay_from_zero, daemon=True)
    reader.start()
    try:
        time.sleep(7)  # past the start's own 5 s hold
        before = last_seq()
        time.sleep(3)
        progressed = last_seq() - before
    finally:
        stop.set()
        reader.join(15)
        alice.http.post(f"/commands/{command_id}/kill", headers=headers)
    assert progressed > 100, progressed  # unheld it prints more than 1,000 lines a second
