"""Managed commands on the local runtime, through the broker (real HTTPS, real tokens, httpx).

Start, status, events (contiguous seq, resume, heartbeats, live chunks, UTF-8 across reads), kill
(whole process group), stdin, list, request-id deduplication, envs/cwd, limits (16 running, output
cap, retained handles, retention time), event-stream fault injection and live streaming through
the broker.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.isolation import HOST_PIDS, HOST_TMP, host_processes_only
from tests._support.programs import process_gone


class Commands:
    """``/commands`` requests through the broker for one sandbox, with the documented headers."""

    def __init__(self, api: Any, sandbox: dict[str, Any]) -> None:
        self.http: httpx.Client = api.http
        self.headers: dict[str, str] = api.data_headers(sandbox)

    def start(self, command: list[str] | str, **body: Any) -> httpx.Response:
        argv = ["/bin/bash", "-c", command] if isinstance(command, str) else command
        body.setdefault("request_id", str(uuid.uuid4()))
        return self.http.post("/commands", json={"command": argv, **body}, headers=self.headers)

    def start_id(self, command: list[str] | str, **body: Any) -> str:
        resp = self.start(command, **body)
        assert resp.status_code == 200, resp.text
        command_id: str = resp.json()["command_id"]
        return command_id

    def status(self, command_id: str) -> dict[str, Any]:
        resp = self.http.get(f"/commands/{command_id}", headers=self.headers)
        assert resp.status_code == 200, resp.text
        out: dict[str, Any] = resp.json()
        return out

    def list(self) -> list[dict[str, Any]]:
        resp = self.http.get("/commands", headers=self.headers)
        assert resp.status_code == 200, resp.text
        out: list[dict[str, Any]] = resp.json()["commands"]
        return out

    def events_response(
        self, command_id: str, after: int = 0, duration: float = 20
    ) -> httpx.Response:
        return self.http.get(
            f"/commands/{command_id}/events",
            params={"after": after, "duration": duration},
            headers=self.headers,
        )

    def events(self, command_id: str, after: int = 0, duration: float = 20) -> list[dict[str, Any]]:
        resp = self.events_response(command_id, after, duration)
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in resp.text.splitlines()]

    def follow(self, command_id: str, duration: float = 20) -> list[dict[str, Any]]:
        """Every event until ``exit``, reconnecting with the cursor; checks seq contiguity."""
        cursor = 0
        out: list[dict[str, Any]] = []
        for _ in range(1000):
            for event in self.events(command_id, cursor, duration):
                if event["type"] == "heartbeat":
                    assert event["seq"] == cursor, (event, cursor)
                    continue
                assert event["seq"] == cursor + 1, (event, cursor)
                cursor = event["seq"]
                out.append(event)
                if event["type"] == "exit":
                    return out
        raise AssertionError("no exit event after 1000 requests")

    def kill(self, command_id: str) -> httpx.Response:
        return self.http.post(f"/commands/{command_id}/kill", headers=self.headers)

    def stdin(self, command_id: str, data: str = "", *, eof: bool = False) -> httpx.Response:
        return self.http.post(
            f"/commands/{command_id}/stdin",
            json={"data": data, "eof": eof},
            headers=self.headers,
        )

    def wait(self, command_id: str) -> dict[str, Any]:
        """The status once the command ended (polls the status, never the event stream)."""
        for _ in range(2000):
            status = self.status(command_id)
            if status["state"] != "running":
                return status
            time.sleep(0.02)
        raise AssertionError(f"command {command_id} still running")


def output(events: list[dict[str, Any]], kind: str = "stdout") -> str:
    return "".join(e["data"] for e in events if e["type"] == kind)


@pytest.fixture
def cmds(alice: Any, sandbox: dict[str, Any]) -> Commands:
    return Commands(alice, sandbox)


def configured(alice: Any, **env: str) -> Commands:
    """A Commands client for a new sandbox whose runtime has these ``SANDBOX_COMMAND_*`` limits."""
    return Commands(alice, alice.ready(env=env))


# -- start, status, events --------------------------------------------------------------------


def test_start_status_and_events(cmds: Commands) -> None:
    command_id = cmds.start_id("echo out; echo err >&2; exit 3")
    events = cmds.follow(command_id)
    assert output(events) == "out\n"
    assert output(events, "stderr") == "err\n"
    assert events[-1] == {"type": "exit", "seq": 3, "data": "", "exit_code": 3, "state": "exited"}
    status = cmds.status(command_id)
    assert status["command_id"] == command_id
    assert status["state"] == "exited"
    assert status["exit_code"] == 3
    assert (status["stdout"], status["stderr"]) == ("out\n", "err\n")
    assert status["last_seq"] == 3
    assert status["output_truncated"] is False
    assert status["command"] == ["/bin/bash", "-c", "echo out; echo err >&2; exit 3"]
    assert status["started_at"].endswith("Z") and status["ended_at"].endswith("Z")
    assert status["timeout"] == 60  # the default


def test_argv_runs_without_a_shell(cmds: Commands) -> None:
    status = cmds.wait(cmds.start_id(["echo", "$HOME", "|", "`id`"]))
    assert status["stdout"] == "$HOME | `id`\n"


def test_command_that_cannot_start_is_a_result(cmds: Commands) -> None:
    status = cmds.wait(cmds.start_id(["/nonexistent/program"]))
    assert (status["state"], status["exit_code"]) == ("exited", 127)
    assert "cannot start '/nonexistent/program'" in status["stderr"]


def test_list_shows_every_command_with_its_state(cmds: Commands) -> None:
    done = cmds.start_id("true")
    cmds.wait(done)
    running = cmds.start_id("sleep 30")
    listed = {c["command_id"]: c for c in cmds.list()}
    assert set(listed) == {done, running}
    assert listed[done]["state"] == "exited"
    assert listed[running]["state"] == "running"
    assert "stdout" not in listed[running]
    assert cmds.kill(running).json()["state"] == "cancelled"
    assert {c["command_id"]: c["state"] for c in cmds.list()}[running] == "cancelled"


@host_processes_only(HOST_TMP)
def test_repeated_request_id_returns_the_same_command(cmds: Commands, tmp_path: Any) -> None:
    marker = tmp_path / "runs"
    request_id = str(uuid.uuid4())
    script = f"echo x >> {marker}"
    first = cmds.start_id(script, request_id=request_id)
    second = cmds.start_id(script, request_id=request_id)
    assert first == second
    cmds.wait(first)
    assert marker.read_text() == "x\n"  # it ran once
    assert [c["command_id"] for c in cmds.list()] == [first]
    other = cmds.start("echo other", request_id=request_id)
    assert other.status_code == 409
    assert "request_id" in other.json()["detail"]


@host_processes_only(HOST_TMP)
def test_the_list_by_request_id_is_the_one_command_its_start_carried(
    cmds: Commands, tmp_path: Any
) -> None:
    """``GET /commands?request_id=R``: the command whose start carried ``R`` (how a client whose
    start's answer was lost finds it), an empty list for an id no start carried, ``400`` for an
    empty or too long one. Two starts with one request id, even at the same time, run once."""
    marker = tmp_path / "runs"
    mine, other = str(uuid.uuid4()), str(uuid.uuid4())
    starts: list[httpx.Response] = []
    threads = [
        threading.Thread(
            target=lambda: starts.append(cmds.start(f"echo x >> {marker}", request_id=mine))
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    cmds.start_id("sleep 0", request_id=other)
    [command_id] = {resp.json()["command_id"] for resp in starts}

    def by_request(request_id: str) -> httpx.Response:
        params = {"request_id": request_id}
        return cmds.http.get("/commands", params=params, headers=cmds.headers)

    found = by_request(mine)
    assert found.status_code == 200, found.text
    assert [(c["command_id"], c["request_id"]) for c in found.json()["commands"]] == [
        (command_id, mine)
    ]
    assert by_request(str(uuid.uuid4())).json() == {"commands": []}
    for bad in ("", "x" * 256):
        refused = by_request(bad)
        assert refused.status_code == 400 and "request_id" in refused.json()["detail"]
    cmds.wait(command_id)
    assert marker.read_text() == "x\n"  # it ran once
    assert len(cmds.list()) == 2


def test_events_are_sent_as_produced_not_line_buffered(cmds: Commands) -> None:
    command_id = cmds.start_id("printf partial; sleep 30")
    events = cmds.events(command_id, 0, duration=1)
    assert events[0] == {"type": "stdout", "seq": 1, "data": "partial"}
    assert cmds.status(command_id)["state"] == "running"


def test_utf8_split_across_reads_stays_whole_and_invalid_bytes_are_replaced(
    cmds: Commands,
) -> None:
    command_id = cmds.start_id(r"printf '\xc3'; sleep 0.5; printf '\xa9|\xff|'")
    events = cmds.follow(command_id)
    assert output(events) == "\u00e9|\ufffd|"
    assert events[0]["data"].startswith("\u00e9")  # no event holds half of the é


def test_resume_with_after_has_no_gap_and_no_duplicate(cmds: Commands) -> None:
    command_id = cmds.start_id("for i in $(seq 1 300); do echo line-$i; sleep 0.002; done")
    seen: list[dict[str, Any]] = []
    cursor = 0
    requests = 0
    while not seen or seen[-1]["type"] != "exit":
        requests += 1
        batch = [e for e in cmds.events(command_id, cursor, 0.05) if e["type"] != "heartbeat"]
        for event in batch[:3]:  # take a few, then resume from our cursor
            assert event["seq"] == cursor + 1
            cursor = event["seq"]
            seen.append(event)
    assert requests > 10
    assert output(seen) == "".join(f"line-{i}\n" for i in range(1, 301))
    assert [e["seq"] for e in seen] == list(range(1, len(seen) + 1))
    assert output(seen) == cmds.status(command_id)["stdout"]


def test_heartbeats_carry_the_cursor_and_the_stream_ends_at_duration(alice: Any) -> None:
    cmds = configured(alice, SANDBOX_COMMAND_HEARTBEAT_SECONDS="0.1")
    command_id = cmds.start_id("echo started; sleep 30")
    events = cmds.events(command_id, 0, duration=1)
    assert events[0]["type"] == "stdout"
    beats = events[1:]
    assert len(beats) >= 3
    assert all(b == {"type": "heartbeat", "seq": 1, "data": ""} for b in beats)
    assert cmds.status(command_id)["state"] == "running"  # ended by duration, not by exit


def test_events_query_validation(cmds: Commands) -> None:
    command_id = cmds.start_id("echo a")
    cmds.wait(command_id)
    for params in ({"after": -1}, {"after": "x"}, {"duration": 21}, {"after": 99}):
        resp = cmds.http.get(f"/commands/{command_id}/events", params=params, headers=cmds.headers)
        assert resp.status_code == 400, params
        assert resp.json()["detail"]
    assert cmds.http.get("/commands/nope", headers=cmds.headers).status_code == 404
    assert cmds.events_response("nope").status_code == 404
    assert cmds.kill("nope").status_code == 404


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"command": []}, "'command'"),
        ({"command": "echo hi"}, "'command'"),
        ({"command": ["echo", "a\x00b"]}, "NUL"),
        ({"command": ["true"], "timeout": 0}, "'timeout'"),
        ({"command": ["true"], "timeout": 301}, "at most 300"),
        ({"command": ["true"], "stdin": "yes"}, "'stdin'"),
        ({"command": ["true"], "envs": {"A": 1}}, "'envs'"),
        ({"command": ["true"], "envs": {"A=B": "1"}}, "'envs'"),
        ({"command": ["true"], "cwd": "relative/dir"}, "absolute"),
        ({"command": ["true"], "cwd": "/nonexistent/dir"}, "not an existing directory"),
        ({"command": ["true"], "shell": True}, "unknown field"),
    ],
)
def test_bad_start_requests_are_400(cmds: Commands, body: dict[str, Any], needle: str) -> None:
    resp = cmds.http.post("/commands", json=body, headers=cmds.headers)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["detail"]
    assert cmds.list() == []


# -- envs and cwd -----------------------------------------------------------------------------


@host_processes_only(HOST_TMP)
def test_envs_are_merged_over_the_runtime_environment_and_cwd_is_used(
    cmds: Commands, tmp_path: Any
) -> None:
    status = cmds.wait(
        cmds.start_id(
            'echo "$GREETING"; echo "$SANDBOX_BASE_DIR"; pwd',
            envs={"GREETING": "hello", "PATH": os.environ["PATH"]},
            cwd=str(tmp_path),
        )
    )
    greeting, base, cwd = status["stdout"].splitlines()
    assert greeting == "hello"
    assert base  # the runtime's own variable is still there
    assert cwd == str(tmp_path)
    assert status["cwd"] == str(tmp_path)


def test_default_cwd_is_the_sandbox_directory(cmds: Commands) -> None:
    status = cmds.wait(cmds.start_id('pwd; echo "$SANDBOX_BASE_DIR"'))
    pwd, base = status["stdout"].split()
    assert os.path.realpath(pwd) == os.path.realpath(base)


# -- timeout, kill, process groups ------------------------------------------------------------


@host_processes_only(HOST_PIDS)
def test_timeout_kills_the_group_and_is_timed_out(cmds: Commands) -> None:
    command_id = cmds.start_id("sleep 300 & echo $!; wait", timeout=1)
    events = cmds.follow(command_id)
    grandchild = int(output(events).split()[0])
    assert events[-1]["state"] == "timed_out"
    status = cmds.status(command_id)
    assert (status["state"], status["exit_code"]) == ("timed_out", 124)
    assert process_gone(grandchild)


@host_processes_only(HOST_PIDS)
def test_a_command_without_a_time_limit_outlives_the_cap_and_ends_with_its_sandbox(
    alice: Any,
) -> None:
    """``"timeout": "none"``: no time limit (past the runtime's cap, here 1 s, which still holds
    for a number); the running limit still counts it; deleting the sandbox ends its group."""
    sandbox = alice.ready(
        env={"SANDBOX_EXEC_TIMEOUT_SECONDS": "1", "SANDBOX_COMMAND_MAX_RUNNING": "1"}
    )
    cmds = Commands(alice, sandbox)
    assert "at most 1" in cmds.start(["true"], timeout=2).json()["detail"]
    command_id = cmds.start_id("sleep 300 & echo $!; wait", timeout="none")
    grandchild = int(cmds.events(command_id, 0, 5)[0]["data"].split()[0])
    time.sleep(2.5)  # past the cap (and the default, min(60 s, the cap))
    status = cmds.status(command_id)
    assert (status["state"], status["timeout"]) == ("running", None)
    assert cmds.start(["true"]).status_code == 429  # SANDBOX_COMMAND_MAX_RUNNING=1 holds
    assert not process_gone(grandchild, within=0.2)
    assert alice.http.delete(f"/v1/sandboxes/{sandbox['name']}").status_code == 202
    assert process_gone(status["pid"])
    assert process_gone(grandchild)


@pytest.mark.parametrize("value", ["None", "nope", 0, -1])
def test_a_timeout_that_is_not_a_number_or_none_is_400(cmds: Commands, value: Any) -> None:
    resp = cmds.start(["true"], timeout=value)
    assert resp.status_code == 400, resp.text
    assert (
        "'timeout'" in resp.json()["detail"] and "'none' for no time limit" in resp.json()["detail"]
    )


@host_processes_only(HOST_PIDS)
def test_kill_kills_a_grandchild_in_the_group_and_is_safe_to_repeat(cmds: Commands) -> None:
    command_id = cmds.start_id("sleep 300 & echo $!; wait")
    first = cmds.events(command_id, 0, 5)[0]
    grandchild = int(first["data"].split()[0])
    assert not process_gone(grandchild, within=0.2)
    killed = cmds.kill(command_id)
    assert killed.status_code == 200
    final = killed.json()
    assert (final["state"], final["exit_code"]) == ("cancelled", 137)
    assert final["stdout"] == first["data"]
    assert process_gone(grandchild)
    again = cmds.kill(command_id)
    assert again.status_code == 200
    assert again.json() == final
    assert cmds.follow(command_id)[-1]["state"] == "cancelled"


def test_kill_of_a_finished_command_keeps_its_result(cmds: Commands) -> None:
    command_id = cmds.start_id("exit 5")
    cmds.wait(command_id)
    final = cmds.kill(command_id).json()
    assert (final["state"], final["exit_code"]) == ("exited", 5)


@host_processes_only(HOST_PIDS)
def test_leftovers_in_the_group_end_with_the_command(cmds: Commands) -> None:
    status = cmds.wait(cmds.start_id("sleep 300 & echo $!"))
    assert status["state"] == "exited"
    assert process_gone(int(status["stdout"].split()[0]))


# -- stdin --------------------------------------------------------------------------------------


def test_stdin_pipe_and_eof(cmds: Commands) -> None:
    command_id = cmds.start_id(["cat"], stdin=True)
    assert cmds.status(command_id)["stdin"] is True
    sent = cmds.stdin(command_id, "héllo\n")
    assert sent.status_code == 200, sent.text
    assert sent.json() == {"command_id": command_id, "written": 7, "stdin": True}
    first = cmds.events(command_id, 0, 5)[0]
    assert first["data"] == "héllo\n"
    assert cmds.status(command_id)["state"] == "running"
    assert cmds.stdin(command_id, "bye", eof=True).status_code == 200
    status = cmds.wait(command_id)
    assert (status["state"], status["exit_code"], status["stdout"]) == ("exited", 0, "héllo\nbye")
    after = cmds.stdin(command_id, "more")
    assert after.status_code == 409
    assert "exited" in after.json()["detail"]


def test_stdin_needs_a_stdin_command(cmds: Commands) -> None:
    command_id = cmds.start_id("sleep 30")
    resp = cmds.stdin(command_id, "x")
    assert resp.status_code == 409
    assert '"stdin": true' in resp.json()["detail"]
    bad = cmds.http.post(f"/commands/{command_id}/stdin", json={"data": 5}, headers=cmds.headers)
    assert bad.status_code == 400


# -- limits -------------------------------------------------------------------------------------


def test_sixteen_running_commands_then_429(cmds: Commands) -> None:
    ids = [cmds.start_id("sleep 60") for _ in range(16)]
    refused = cmds.start("true")
    assert refused.status_code == 429
    body = refused.json()
    assert body["limit"] == 16
    assert "at most 16" in body["detail"]
    same = cmds.start("sleep 60", request_id=cmds.status(ids[0])["request_id"])
    assert same.status_code == 200  # a repeated request is answered, even at the limit
    assert same.json()["command_id"] == ids[0]
    cmds.kill(ids[0])
    assert cmds.start("true").status_code == 200


def test_output_cap_truncates_retention_but_a_follower_gets_everything(cmds: Commands) -> None:
    size = 1024 * 1024 + 200_000
    command_id = cmds.start_id(f"sleep 0.5; head -c {size} /dev/zero | tr '\\0' a")
    events = cmds.follow(command_id)
    assert output(events) == "a" * size
    status = cmds.status(command_id)
    assert status["output_truncated"] is True
    assert 0 < len(status["stdout"]) <= 1024 * 1024
    assert "a" * size != status["stdout"]


def test_the_retained_output_is_exactly_the_first_bytes_up_to_the_cap(alice: Any) -> None:
    """One read that crosses the cap is split there: the status keeps exactly the first
    ``output_bytes`` (never half a character), a follower still gets everything."""
    cmds = configured(
        alice,
        SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES="100001",
        SANDBOX_COMMAND_LIVE_WINDOW_BYTES="1000000",
    )
    script = "import sys; sys.stdout.write('\u00e9' * 60000)"  # 120000 bytes in one write
    command_id = cmds.start_id([sys.executable, "-c", script])
    events = cmds.follow(command_id)
    assert output(events) == "\u00e9" * 60000
    status = cmds.status(command_id)
    assert status["stdout"] == "\u00e9" * 50000 and status["output_truncated"] is True


def test_replay_beyond_the_cap_and_window_is_410_with_the_cursor_to_resume(alice: Any) -> None:
    cmds = configured(
        alice,
        SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES="100000",
        SANDBOX_COMMAND_LIVE_WINDOW_BYTES="100000",
    )
    command_id = cmds.start_id("head -c 1000000 /dev/zero | tr '\\0' b; echo; echo tail")
    status = cmds.wait(command_id)
    assert status["output_truncated"] is True
    replay = [e for e in cmds.events(command_id, 0, 0) if e["type"] != "heartbeat"]
    assert [e["seq"] for e in replay] == list(range(1, len(replay) + 1))
    assert output(replay) == status["stdout"]
    lost = cmds.events_response(command_id, replay[-1]["seq"], 0)
    assert lost.status_code == 410
    resume = lost.json()["resume_after"]
    assert resume > replay[-1]["seq"]
    assert f"after={resume}" in lost.json()["detail"]
    rest = cmds.events(command_id, resume, 0)
    assert rest[0]["seq"] == resume + 1
    assert rest[-1]["type"] == "exit"
    assert output(rest).endswith("\ntail\n")


def test_finished_commands_are_forgotten_after_the_retention_time(alice: Any) -> None:
    cmds = configured(alice, SANDBOX_COMMAND_RETENTION_SECONDS="0.5")
    finished = cmds.start_id("true")
    running = cmds.start_id("sleep 30")
    cmds.wait(finished)
    time.sleep(1.0)
    assert cmds.http.get(f"/commands/{finished}", headers=cmds.headers).status_code == 404
    assert [c["command_id"] for c in cmds.list()] == [running]


def test_oldest_finished_handle_makes_room(alice: Any) -> None:
    cmds = configured(alice, SANDBOX_COMMAND_MAX_HANDLES="3", SANDBOX_COMMAND_MAX_RUNNING="2")
    ids = []
    for _ in range(3):
        ids.append(cmds.start_id("true"))
        cmds.wait(ids[-1])
    newest = cmds.start_id("true")
    assert [c["command_id"] for c in cmds.list()] == [*ids[1:], newest]
    assert cmds.http.get(f"/commands/{ids[0]}", headers=cmds.headers).status_code == 404


def test_bad_limit_variable_fails_the_sandbox(alice: Any) -> None:
    name = alice.create(env={"SANDBOX_COMMAND_MAX_RUNNING": "lots"}).json()["name"]
    got = alice.http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20}).json()
    assert got["phase"] == "Failed"
    assert "SANDBOX_COMMAND_MAX_RUNNING='lots'" in got["message"]


# -- through the broker: live streaming and fault injection -----------------------------------


def test_event_stream_is_live_through_the_broker(cmds: Commands) -> None:
    """One open stream carries a line, then the answer to what we send after reading it: a
    broker that buffered the response would deliver nothing before the stream ended."""
    command_id = cmds.start_id("echo first; read line; echo got-$line", stdin=True)
    with cmds.http.stream(
        "GET", f"/commands/{command_id}/events", params={"after": 0}, headers=cmds.headers
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert json.loads(next(lines)) == {"type": "stdout", "seq": 1, "data": "first\n"}
        assert cmds.stdin(command_id, "reply\n").status_code == 200
        rest = [json.loads(line) for line in lines if line]
    events = [e for e in rest if e["type"] != "heartbeat"]
    assert events[0] == {"type": "stdout", "seq": 2, "data": "got-reply\n"}
    assert events[-1]["type"] == "exit"


def test_cut_event_streams_after_n_events(broker: LocalBroker, cmds: Commands) -> None:
    command_id = cmds.start_id("for i in $(seq 1 20); do echo $i; sleep 0.01; done")
    cmds.wait(command_id)
    whole = cmds.events(command_id)
    assert len(whole) > 6
    broker.cut_event_streams(after_events=5)
    resp = cmds.events_response(command_id)
    assert resp.status_code == 200
    assert [json.loads(line) for line in resp.text.splitlines()] == whole[:5]
    events = cmds.follow(command_id)  # reconnecting with the cursor still gets everything
    assert events == whole
    broker.clear_faults()
    assert cmds.events(command_id) == whole


def test_cut_event_streams_after_seconds(broker: LocalBroker, alice: Any) -> None:
    cmds = configured(alice, SANDBOX_COMMAND_HEARTBEAT_SECONDS="0.1")
    command_id = cmds.start_id("echo started; sleep 3; echo done")
    broker.cut_event_streams(after_seconds=0.5, sandbox=cmds.headers["X-Sandbox-ID"])
    events = cmds.events(command_id, 0, duration=20)  # uncut, it would end with the exit event
    assert events[0] == {"type": "stdout", "seq": 1, "data": "started\n"}
    assert events[1:] and all(e["type"] == "heartbeat" for e in events[1:])
    assert output(cmds.follow(command_id)) == "started\ndone\n"


def test_cut_only_applies_to_its_sandbox(broker: LocalBroker, cmds: Commands) -> None:
    command_id = cmds.start_id("echo a; sleep 0.1; echo b")
    cmds.wait(command_id)
    broker.cut_event_streams(after_events=1, sandbox="sbx-other")
    assert len(cmds.events(command_id)) == 3


def test_drop_event_stream_mid_line(broker: LocalBroker, cmds: Commands) -> None:
    command_id = cmds.start_id("for i in $(seq 1 10); do echo $i; sleep 0.01; done")
    cmds.wait(command_id)
    whole = cmds.events(command_id)
    assert len(whole) > 4
    broker.drop_event_stream_mid_line(1, after_events=3)
    received = b""
    with pytest.raises(httpx.RemoteProtocolError):
        with cmds.http.stream(
            "GET", f"/commands/{command_id}/events", params={"after": 0}, headers=cmds.headers
        ) as resp:
            for chunk in resp.iter_raw():
                received += chunk
    lines, _, partial = received.rpartition(b"\n")
    assert [json.loads(line) for line in lines.split(b"\n")] == whole[:3]
    assert partial and not partial.endswith(b"}")  # half of line 4
    assert cmds.events(command_id) == whole  # used up: the next stream is whole


def test_fault_arguments_are_checked(broker: LocalBroker) -> None:
    with pytest.raises(ValueError, match="after_events"):
        broker.cut_event_streams()
    with pytest.raises(ValueError, match="after_events"):
        broker.cut_event_streams(after_events=0)
    with pytest.raises(ValueError, match="after_seconds"):
        broker.cut_event_streams(after_seconds=-1)
    with pytest.raises(ValueError, match="after_events"):
        broker.drop_event_stream_mid_line(after_events=-1)


def test_dropped_start_answer_still_started_once(broker: LocalBroker, cmds: Commands) -> None:
    name = cmds.headers["X-Sandbox-ID"]
    broker.drop_connection_after_execute(1, sandbox=name)
    request_id = str(uuid.uuid4())
    with pytest.raises(httpx.RemoteProtocolError):
        cmds.start("echo once", request_id=request_id)
    assert broker.execution_count(name) == 1
    again = cmds.start_id("echo once", request_id=request_id)  # dedup finds it
    assert [c["command_id"] for c in cmds.list()] == [again]


def test_concurrent_followers_see_the_same_events(cmds: Commands) -> None:
    command_id = cmds.start_id("for i in $(seq 1 50); do echo $i; sleep 0.01; done")
    results: list[list[dict[str, Any]]] = []

    def follow() -> None:
        results.append(cmds.follow(command_id))

    threads = [threading.Thread(target=follow) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 3
    assert results[0] == results[1] == results[2]


@host_processes_only(HOST_PIDS)
def test_deleting_the_sandbox_kills_its_commands(alice: Any, cmds: Commands) -> None:
    command_id = cmds.start_id("sleep 300 & echo $!; wait")
    grandchild = int(cmds.events(command_id, 0, 5)[0]["data"].split()[0])
    leader = cmds.status(command_id)["pid"]
    assert not process_gone(leader, within=0.2)
    deleted = alice.http.delete(f"/v1/sandboxes/{cmds.headers['X-Sandbox-ID']}")
    assert deleted.status_code == 202
    assert process_gone(leader)
    assert process_gone(grandchild)


def test_a_failing_output_reader_still_ends_the_command(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """In process (the runtime's module is standard library only): a bug in the reader thread
    kills the command's group and ends it visibly instead of leaving it 'running' forever."""
    from k8s_agent_sandbox_awx.broker.runtime import _command, _commands

    manager = _commands.CommandManager(str(tmp_path), _command.Limits())

    def broken(*_: Any) -> bool:
        raise RuntimeError("injected reader failure")

    monkeypatch.setattr(manager.runner, "_read_into_events", broken)
    command = manager.start({"command": ["/bin/sh", "-c", "echo hi; sleep 300"]})
    assert command.done.wait(30)
    status = command.status()
    assert status["state"] == "exited"
    assert "the runtime failed while reading" in status["stderr"]
    assert "injected reader failure" in capfd.readouterr().err  # logged, not swallowed
    assert process_gone(status["pid"])
    manager.kill_all()


def test_a_slow_follower_gets_every_byte_beyond_the_cap(alice: Any) -> None:
    """Backpressure: while a stream follows the command, the live window never drops an event it
    has not sent; the command waits on its pipe instead (without a follower it would be 410)."""
    cmds = configured(
        alice,
        SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES="20000",
        SANDBOX_COMMAND_LIVE_WINDOW_BYTES="100000",
    )
    script = "for i in $(seq 1 3000); do printf '%0200d\\n' $i; done; echo end"
    command_id = cmds.start_id(script)
    received: list[dict[str, Any]] = []
    cursor = 0
    while not received or received[-1]["type"] != "exit":
        for event in cmds.events(command_id, cursor, 0.3):
            if event["type"] != "heartbeat":
                assert event["seq"] == cursor + 1
                cursor = event["seq"]
                received.append(event)
        time.sleep(0.05)  # slower than the command
    expected = "".join(f"{i:0200d}\n" for i in range(1, 3001)) + "end\n"
    assert output(received) == expected
    assert cmds.status(command_id)["output_truncated"] is True


def test_a_follower_cut_by_the_broker_still_gets_every_byte(
    broker: LocalBroker, alice: Any
) -> None:
    """Reconnects forced by the broker (streams cut every 7 lines, one dropped mid-line) while
    the output runs far beyond the cap: what the runtime sent on a broken connection is still
    in the window when the follower comes back with its cursor."""
    cmds = configured(
        alice,
        SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES="20000",
        # a loaded machine may take seconds between two requests of this loop: the window is
        # what is tested here, not the grace time
        SANDBOX_COMMAND_FOLLOWER_GRACE_SECONDS="120",
    )
    broker.cut_event_streams(after_events=7)
    broker.drop_event_stream_mid_line(1, after_events=3)
    script = "for i in $(seq 1 8000); do printf '%0200d\\n' $i; done; echo end"
    command_id = cmds.start_id(script)
    received: list[dict[str, Any]] = []
    cursor = 0
    drops = 0
    while not received or received[-1]["type"] != "exit":
        try:
            events = cmds.events(command_id, cursor)
        except httpx.RemoteProtocolError:
            drops += 1
            continue
        for event in events:
            if event["type"] != "heartbeat":
                assert event["seq"] == cursor + 1
                cursor = event["seq"]
                received.append(event)
    assert drops == 1
    expected = "".join(f"{i:0200d}\n" for i in range(1, 8001)) + "end\n"
    assert output(received) == expected
    assert cmds.status(command_id)["output_truncated"] is True


def small_window(alice: Any, **env: str) -> Commands:
    """A sandbox whose runtime keeps 4 KiB for replay and a 64 KiB live window (reads of 8 KiB):
    a few MB of output are far beyond both."""
    return configured(
        alice,
        SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES="4096",
        SANDBOX_COMMAND_LIVE_WINDOW_BYTES="65536",
        **env,
    )


def test_a_cut_after_a_burst_larger_than_the_window_loses_nothing(
    broker: LocalBroker, alice: Any
) -> None:
    """The runtime sends far more than the live window (64 KiB here) before the broker cuts the
    stream after 2 events (the rest is in socket buffers and the broker, lost with the cut):
    a follower that comes back with its cursor still gets every byte after it, because nothing
    sent on a stream is dropped before a new request acknowledges it with its cursor."""
    cmds = small_window(
        alice,
        SANDBOX_COMMAND_FOLLOWER_GRACE_SECONDS="120",
    )
    broker.cut_event_streams(after_events=2)
    script = "head -c 3000000 /dev/zero | tr '\\0' x; echo; echo end"
    command_id = cmds.start_id(script)
    time.sleep(0.3)  # the command has written ahead: the first stream sends a large burst
    received: list[dict[str, Any]] = []
    cursor = 0
    while not received or received[-1]["type"] != "exit":
        resp = cmds.events_response(command_id, cursor)
        assert resp.status_code == 200, resp.text  # not 410: nothing after the cursor was lost
        for event in (json.loads(line) for line in resp.text.splitlines()):
            if event["type"] != "heartbeat":
                assert event["seq"] == cursor + 1
                cursor = event["seq"]
                received.append(event)
    assert output(received) == "x" * 3000000 + "\nend\n"
    assert cmds.status(command_id)["output_truncated"] is True


def test_a_stream_ends_after_its_unacknowledged_bound_and_the_next_request_continues(
    alice: Any,
) -> None:
    """What one stream sends beyond the cap past its cursor is bounded
    (``SANDBOX_COMMAND_UNACKED_BYTES``): the stream then ends cleanly before ``duration``, and
    the next request, continuing from its cursor, acknowledges it and gets the rest."""
    cmds = small_window(
        alice,
        SANDBOX_COMMAND_UNACKED_BYTES="100000",
    )
    command_id = cmds.start_id("head -c 2000000 /dev/zero | tr '\\0' y; echo end")
    received: list[dict[str, Any]] = []
    streams: list[int] = []  # output bytes beyond the cap each stream sent
    cursor = 0
    while not received or received[-1]["type"] != "exit":
        sent = 0
        for event in cmds.events(command_id, cursor):
            if event["type"] != "heartbeat":
                assert event["seq"] == cursor + 1
                cursor = event["seq"]
                received.append(event)
                before = sum(len(e["data"]) for e in received[:-1])
                sent += max(0, before + len(event["data"]) - max(before, 4096))
        streams.append(sent)
    assert output(received) == "y" * 2000000 + "end\n"
    assert len(streams) >= 2000000 // (100000 + 8192)
    assert max(streams) <= 100000 + 8192  # the bound, passed by one read (an eighth of 64 KiB)


def test_a_follower_that_never_comes_back_holds_the_command_only_for_the_grace_time(
    alice: Any,
) -> None:
    """A stream ends at its unacknowledged bound and its follower never continues: the window
    keeps what it sent (the command waits on its pipe) for the grace time only, then drops it
    as before (a request from the old cursor is ``410``) and the command runs to its end."""
    cmds = small_window(
        alice,
        SANDBOX_COMMAND_UNACKED_BYTES="100000",
        SANDBOX_COMMAND_FOLLOWER_GRACE_SECONDS="0.5",
    )
    command_id = cmds.start_id("head -c 2000000 /dev/zero | tr '\\0' z; echo end")
    first = cmds.events(command_id, 0)
    assert first[-1]["type"] != "exit"  # ended at the bound, not at the command's end
    status = cmds.wait(command_id)
    assert status["exit_code"] == 0 and status["output_truncated"] is True
    resp = cmds.events_response(command_id, 1)
    assert resp.status_code == 410, resp.text


def test_after_the_exit_the_window_returns_to_its_size_when_the_grace_ends(alice: Any) -> None:
    """A stream sent a command's whole output (1 MB, beyond a 64 KiB window) and its follower
    never acknowledged it: the window keeps it all for the grace time, then, with the command
    ended, drops back to its size (a request for the old events is ``410``)."""
    cmds = small_window(
        alice,
        SANDBOX_COMMAND_FOLLOWER_GRACE_SECONDS="0.5",
    )
    command_id = cmds.start_id("head -c 1000000 /dev/zero | tr '\\0' w; echo end")
    events = cmds.events(command_id, 0)
    assert events[-1]["type"] == "exit" and output(events) == "w" * 1000000 + "end\n"
    assert cmds.events_response(command_id, 1).status_code == 200  # within the grace: kept
    time.sleep(3)  # the grace (0.5 s, from the end of that request, itself a follower) ends
    resp = cmds.events_response(command_id, 1)
    assert resp.status_code == 410, resp.text[:200]
    assert cmds.events(command_id, resp.json()["resume_after"])[-1]["type"] == "exit"


def test_sixty_four_commands_followed_at_once(alice: Any) -> None:
    """64 running commands (the limit raised for this sandbox), each followed by its own open
    event stream at the same time, all through the broker."""
    import asyncio
    import ssl

    cmds = configured(alice, SANDBOX_COMMAND_MAX_RUNNING="64")
    ids = [cmds.start_id(f"read go; echo out-{i}", stdin=True) for i in range(64)]

    async def follow_all() -> list[str]:
        ctx = ssl.create_default_context(cafile=alice.broker.ca_bundle)
        async with httpx.AsyncClient(
            base_url=alice.broker.url,
            verify=ctx,
            headers={"Authorization": f"Bearer {alice.token}", **cmds.headers},
            timeout=30,
            limits=httpx.Limits(max_connections=100),
        ) as http:

            async def follow(command_id: str) -> str:
                out = ""
                async with http.stream(
                    "GET", f"/commands/{command_id}/events", params={"after": 0}
                ) as resp:
                    async for line in resp.aiter_lines():
                        event = json.loads(line)
                        assert "type" in event, (resp.status_code, event)
                        if event["type"] == "stdout":
                            out += event["data"]
                return out

            tasks = [asyncio.create_task(follow(c)) for c in ids]
            await asyncio.sleep(0.5)  # every stream is open and waiting
            for command_id in ids:
                resp = await http.post(f"/commands/{command_id}/stdin", json={"data": "\n"})
                assert resp.status_code == 200, resp.text
            return list(await asyncio.gather(*tasks))

    outputs = asyncio.run(follow_all())
    assert outputs == [f"out-{i}\n" for i in range(64)]
    assert all(c["state"] == "exited" for c in cmds.list())


# -- followers that overlap, and followers that do not read ------------------------------------


@contextlib.contextmanager
def local_runtime(
    tmp_path: Any, sndbuf: int | None = None, **limits: Any
) -> Iterator[tuple[Any, int]]:
    """The runtime's HTTP server in this process (its module is standard library only), with a
    ``CommandManager`` of these ``Limits`` (``sndbuf``: the send buffer of its connections, so
    that a reader that stops reading blocks its sends soon)."""
    from k8s_agent_sandbox_awx.broker.runtime import _command, _commands, _server

    manager = _commands.CommandManager(str(tmp_path), _command.Limits(**limits))

    def setup(self: Any) -> None:
        if sndbuf is not None:
            self.request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        _server.Handler.setup(self)

    attributes = {"base_dir": str(tmp_path), "commands": manager, "setup": setup}
    handler = type("Handler", (_server.Handler,), attributes)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        yield manager, int(server.server_address[1])
    finally:
        manager.kill_all()
        server.shutdown()
        server.server_close()
        thread.join(10)


class RawStream:
    """One ``GET .../events`` (plain HTTP/1.1 to the runtime) on its own socket, read only as
    far as asked: its reader stops reading there. ``cut()`` resets the connection."""

    def __init__(self, port: int, path: str, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket()
        self.sock.settimeout(30)
        if rcvbuf is not None:  # before the connection: a small receive window
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: runtime\r\n\r\n".encode())
        self.raw = b""
        self.body = b""
        self.head: bytes | None = None
        self.chunk_left = 0
        self.events: list[dict[str, Any]] = []

    def read_until(self, seq: int) -> RawStream:
        while not self.events or self.events[-1]["seq"] < seq:
            data = self.sock.recv(65536)
            assert data, f"the stream ended before seq {seq}"
            self.raw += data
            self._parse()
        return self

    def _parse(self) -> None:
        """De-chunk what arrived (a chunk's part too: a reader gets its lines as they come)."""
        if self.head is None:
            if b"\r\n\r\n" not in self.raw:
                return
            self.head, self.raw = self.raw.split(b"\r\n\r\n", 1)
            assert self.head.startswith(b"HTTP/1.1 200"), self.head
        while self.raw:
            if self.chunk_left == 0:
                if b"\r\n" not in self.raw:
                    break
                size_line, self.raw = self.raw.split(b"\r\n", 1)
                self.chunk_left = int(size_line, 16) + 2  # its data and its CRLF
            part, self.raw = self.raw[: self.chunk_left], self.raw[self.chunk_left :]
            self.chunk_left -= len(part)
            self.body += part[: max(0, len(part) - max(0, 2 - self.chunk_left))]
        lines, _, self.body = self.body.rpartition(b"\n")
        self.events += [json.loads(line) for line in lines.split(b"\n") if line.strip()]

    def drain(self) -> bytes:
        """Read to the end of the connection; the last bytes read (the body's end, if any)."""
        tail = b""
        while data := self.sock.recv(65536):
            self.raw += data
            tail = (tail + data)[-16:]
            self._parse()
        return tail

    def sizes(self) -> dict[int, int]:
        return {e["seq"]: len(e["data"]) for e in self.events if e["type"] != "heartbeat"}

    def cut(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def read_to_exit(port: int, command_id: str, after: int, out: dict[str, Any]) -> None:
    """Follow from ``after`` to the exit event (plain HTTP), checking every stream's status
    and the contiguity; ``out``: the first seq, the output bytes, the statuses."""
    cursor, out["bytes"], out["statuses"] = after, 0, []
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", f"/commands/{command_id}/events?after={cursor}")
        resp = conn.getresponse()
        out["statuses"].append(resp.status)
        if resp.status != 200:
            out["detail"] = resp.read().decode()
            return
        for line in resp.read().splitlines():
            event = json.loads(line)
            if event["type"] == "heartbeat":
                continue
            assert event["seq"] == cursor + 1, (event["seq"], cursor)
            out.setdefault("first", event["seq"])
            cursor = event["seq"]
            out["bytes"] += len(event["data"])
            if event["type"] == "exit":
                return
        conn.close()


def test_two_followers_with_overlapping_ranges_cut_at_once_lose_nothing(tmp_path: Any) -> None:
    """A was sent events 1 to 60 and more from cursor 0; B continued from 20 (another reader,
    within what A was sent) and was sent up to 50 and more; both connections are reset at the
    same moment while their readers had only 5 and 30. Each comes back with its own cursor and
    gets every byte after it: nothing a follower had not acknowledged left the live window
    (before: B's cursor within A's range made A look continued, and the events between 5 and
    20 were dropped: A's request was 410)."""
    size = 3_000_000
    with local_runtime(
        tmp_path, output_bytes=4096, window_bytes=65536, follower_grace_seconds=120
    ) as (manager, port):
        command = manager.start(
            {"command": ["/bin/sh", "-c", f"head -c {size} /dev/zero | tr '\\0' x"]}
        )
        path = f"/commands/{command.command_id}/events"
        a = RawStream(port, f"{path}?after=0").read_until(60)
        b = RawStream(port, f"{path}?after=20").read_until(50)
        sizes = {**a.sizes(), **b.sizes()}
        a.cut()
        b.cut()
        time.sleep(3)  # both streams notice (a send fails, or the next heartbeat's)
        results: list[dict[str, Any]] = [{}, {}]
        readers = [
            threading.Thread(target=read_to_exit, args=(port, command.command_id, after, out))
            for after, out in ((5, results[0]), (30, results[1]))
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(120)
        for after, out in ((5, results[0]), (30, results[1])):
            assert out["statuses"] == [200] * len(out["statuses"]), out.get("detail")
            assert out["first"] == after + 1
            assert out["bytes"] == size - sum(sizes[seq] for seq in range(1, after + 1))


def test_a_follower_that_stops_reading_never_holds_the_command(
    tmp_path: Any, logging_server: Any
) -> None:
    """A raw follower reads the first line of a background dev server's event stream (its
    port), then stops reading with its connection open. The server goes on serving and logging
    far beyond every buffer on the way to that reader: once the stream's send has made no
    progress for the grace time (0.5 s here) it no longer holds the command's pipe, and its pin
    on the window gives way beyond the bound (window + unacknowledged bytes). At its duration
    (2 s) plus the grace the runtime ends the stream: the reader finds its connection closed
    without the end of the body and continues from its cursor: what it was not sent and the
    window no longer holds is a 410 naming the lost events, and after them it goes on (before:
    the runtime blocked in its send for good, and the server stopped serving)."""
    grace, duration = 0.5, 2.0
    window, unacked = 65536, 262144
    with local_runtime(
        tmp_path,
        sndbuf=16384,
        output_bytes=4096,
        window_bytes=window,
        unacked_bytes=unacked,
        follower_grace_seconds=grace,
    ) as (manager, port):
        command = manager.start({"command": logging_server.argv})
        path = f"/commands/{command.command_id}/events"
        opened = time.monotonic()
        raw = RawStream(port, f"{path}?after=0&duration={duration:g}", rcvbuf=8192).read_until(1)
        server = int(raw.events[0]["data"])
        assert (
            logging_server.serves(server, 100) < 5.0
        )  # 12.5 MiB of log while the stream is not read
        with command.cond:
            assert command.window_size <= window + unacked
        time.sleep(max(0.0, opened + duration + grace + 1.0 - time.monotonic()))
        assert not raw.drain().endswith(b"0\r\n\r\n")  # closed by the runtime, not finished
        cursor = raw.events[-1]["seq"]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", f"{path}?after={cursor}&duration=1")
        lost = conn.getresponse()
        body = json.loads(lost.read())
        assert lost.status == 410 and body["resume_after"] > cursor, body
        assert f"events {cursor + 1} to {body['resume_after']} were dropped" in body["detail"]
        conn.request("GET", f"{path}?after={body['resume_after']}&duration=1")
        rest = conn.getresponse()
        assert rest.status == 200
        assert json.loads(rest.read().splitlines()[0])["seq"] == body["resume_after"] + 1
        assert logging_server.serves(server, 1) < 5.0 and command.state == "running"
