"""Managed commands on a pseudo-terminal (``"pty"``), on the local runtime through the broker
(real HTTPS, real tokens, httpx): the terminal's size, resize (``SIGWINCH``), Ctrl-C through the
line discipline, exact output bytes (``data_base64``), binary stdin, the session killed as a
whole, the refusals, a runtime without ptys, and the scope of the resize route."""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker, Policy
from tests._support.isolation import HOST_PIDS, HOST_TMP, host_processes_only
from tests._support.programs import process_gone as _gone

BASH = ["/bin/bash", "--norc", "--noprofile", "-i"]


class Terminal:
    """One pty command through the broker: its start, input, resize and output bytes."""

    def __init__(self, api: Any, sandbox: dict[str, Any]) -> None:
        self.http: httpx.Client = api.http
        self.headers: dict[str, str] = api.data_headers(sandbox)
        self.command_id = ""
        self.cursor = 0
        self.out = b""
        self.events: list[dict[str, Any]] = []

    def start(self, command: list[str], **body: Any) -> httpx.Response:
        body.setdefault("request_id", str(uuid.uuid4()))
        if body.setdefault("pty", {"cols": 80, "rows": 24}) is None:
            del body["pty"]  # a command on pipes
        resp = self.http.post("/commands", json={"command": command, **body}, headers=self.headers)
        if resp.status_code == 200:
            self.command_id = resp.json()["command_id"]
        return resp

    def started(self, command: list[str], **body: Any) -> Terminal:
        resp = self.start(command, **body)
        assert resp.status_code == 200, resp.text
        return self

    def post(self, tail: str, **body: Any) -> httpx.Response:
        return self.http.post(
            f"/commands/{self.command_id}/{tail}", json=body, headers=self.headers
        )

    def type(self, data: str | bytes) -> None:
        if isinstance(data, bytes):
            resp = self.post("stdin", data_base64=base64.b64encode(data).decode())
        else:
            resp = self.post("stdin", data=data)
        assert resp.status_code == 200, resp.text

    def status(self) -> dict[str, Any]:
        resp = self.http.get(f"/commands/{self.command_id}", headers=self.headers)
        assert resp.status_code == 200, resp.text
        out: dict[str, Any] = resp.json()
        return out

    def read(self, duration: float = 0.5) -> bool:
        """Read the events of ``duration`` s; ``True`` once the exit event came."""
        resp = self.http.get(
            f"/commands/{self.command_id}/events",
            params={"after": self.cursor, "duration": duration},
            headers=self.headers,
        )
        assert resp.status_code == 200, resp.text
        for line in resp.text.splitlines():
            event = json.loads(line)
            if event["type"] == "heartbeat":
                continue
            assert event["seq"] == self.cursor + 1, (event, self.cursor)
            self.cursor = event["seq"]
            self.events.append(event)
            if event["type"] == "exit":
                return True
            assert event["type"] == "stdout", event  # one stream: the terminal
            raw = event.get("data_base64")
            self.out += base64.b64decode(raw) if raw is not None else event["data"].encode()
        return False

    def until(self, pattern: bytes, within: float = 15.0) -> re.Match[bytes]:
        """Read until the output (from its start) matches ``pattern``."""
        deadline = time.monotonic() + within
        while (found := re.search(pattern, self.out)) is None:
            assert time.monotonic() < deadline, (pattern, self.out[-2000:])
            if self.read():
                found = re.search(pattern, self.out)
                assert found is not None, (pattern, self.out[-2000:])
                return found
        return found

    def exit(self, within: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while not (self.events and self.events[-1]["type"] == "exit"):
            assert time.monotonic() < deadline, self.out[-2000:]
            self.read(1.0)
        return self.events[-1]


@pytest.fixture
def term(alice: Any, sandbox: dict[str, Any]) -> Terminal:
    return Terminal(alice, sandbox)


# -- the terminal ------------------------------------------------------------------------------


def test_a_pty_command_runs_on_a_terminal_of_its_size(term: Terminal) -> None:
    term.started(
        ["/bin/sh", "-c", "stty size; tty; echo $TERM; test -t 0 && test -t 2 && echo tty"],
        pty={"cols": 100, "rows": 30},
    )
    end = term.exit()
    assert end == {
        "type": "exit",
        "seq": term.cursor,
        "data": "",
        "exit_code": 0,
        "state": "exited",
    }
    assert term.out.startswith(b"30 100\r\n/dev/pts/"), term.out
    assert term.out.endswith(b"\r\nxterm-256color\r\ntty\r\n"), term.out
    status = term.status()
    assert status["pty"] == {"cols": 100, "rows": 30}
    assert status["timeout"] is None  # a terminal without a timeout has no time limit
    assert status["stderr"] == "" and "30 100" in status["stdout"]


@host_processes_only(HOST_TMP)
def test_a_pty_start_takes_the_usual_fields(term: Terminal, tmp_path: Any) -> None:
    term.started(
        ["/bin/sh", "-c", "pwd; echo $A $TERM"],
        pty={},  # 80 x 24
        envs={"A": "b", "TERM": "vt100"},
        cwd=str(tmp_path),
        timeout=30,
    )
    term.exit()
    assert term.out == f"{tmp_path}\r\nb vt100\r\n".encode()
    status = term.status()
    assert (status["pty"], status["timeout"]) == ({"cols": 80, "rows": 24}, 30)


def test_resize_reaches_the_foreground_process_group(term: Terminal) -> None:
    script = "trap 'stty size' WINCH; echo ready; while :; do sleep 0.05; done"
    term.started(["/bin/bash", "-c", script])
    term.until(b"ready\r\n")
    resp = term.post("resize", cols=132, rows=43)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"command_id": term.command_id, "cols": 132, "rows": 43}
    term.until(b"43 132\r\n")
    assert term.status()["pty"] == {"cols": 132, "rows": 43}
    assert term.post("kill").json()["state"] == "cancelled"


def test_ctrl_c_interrupts_the_foreground_program(term: Terminal) -> None:
    term.started(BASH, envs={"PS1": "$ "})
    term.type("sleep 100; echo after-$((40+2))\r")
    term.until(b"sleep 100")
    time.sleep(0.3)  # sleep runs: its SIGINT ends it, not the line
    started = time.monotonic()
    term.type("\x03")
    term.type("echo RC$?\r")
    term.until(b"RC130\r\n")
    assert time.monotonic() - started < 10
    assert b"after-42" not in term.out  # the whole line was interrupted
    term.type("exit 3\r")
    assert term.exit()["exit_code"] == 3


def test_output_bytes_stay_exact(term: Terminal) -> None:
    script = (
        r"printf '\377\376ok\n'; printf '\342'; sleep 0.3; printf '\202\254\n'; printf '\342\202'"
    )
    term.started(["/bin/bash", "-c", script])
    term.exit()
    assert term.out == b"\xff\xfeok\r\n\xe2\x82\xac\r\n\xe2\x82"
    exact = [e for e in term.events if "data_base64" in e]
    assert exact and all("\ufffd" in e["data"] for e in exact)
    euro = [e for e in term.events if "\u20ac" in e.get("data", "")]
    assert euro and all("data_base64" not in e for e in euro)  # split, whole, valid: text only


def test_stdin_takes_bytes_on_a_pty_and_on_a_pipe(term: Terminal, alice: Any, sandbox: Any) -> None:
    term.started(["/bin/sh", "-c", "stty raw -echo; echo ready; head -c 4 | od -An -tx1"])
    term.until(b"ready")
    term.type(b"\xff\x00\x80\x03")  # raw: Ctrl-C is a byte like another
    term.exit()
    assert term.out.split() == [b"ready", b"ff", b"00", b"80", b"03"]
    pipe = Terminal(alice, sandbox)
    pipe.started(["od", "-An", "-tx1"], pty=None, stdin=True)
    resp = pipe.post("stdin", data_base64=base64.b64encode(b"\xfe\x01").decode(), eof=True)
    assert resp.status_code == 200 and resp.json()["written"] == 2, resp.text
    pipe.exit()
    assert pipe.out.split() == [b"fe", b"01"]


@host_processes_only(HOST_PIDS)
def test_kill_ends_the_terminals_whole_session(term: Terminal) -> None:
    term.started(BASH, envs={"PS1": "$ "})
    term.type("sleep 1000 & echo job=$!\r")
    job = int(term.until(rb"job=(\d+)\r\n").group(1))
    leader = term.status()["pid"]
    assert os.getsid(job) == leader and os.getpgid(job) != leader  # a job of its own
    final = term.post("kill").json()
    assert (final["state"], final["exit_code"]) == ("cancelled", 137)
    assert _gone(job) and _gone(leader)


@host_processes_only(HOST_PIDS)
def test_a_jobs_left_behind_end_with_the_terminal(term: Terminal) -> None:
    term.started(BASH, envs={"PS1": "$ "})
    term.type("sleep 1000 & echo job=$!; exit 4\r")
    job = int(term.until(rb"job=(\d+)\r\n").group(1))
    assert term.exit()["exit_code"] == 4
    assert _gone(job)


def test_a_program_that_cannot_start_says_so_on_the_terminal(term: Terminal) -> None:
    term.started(["/nonexistent/program"])
    assert term.exit()["exit_code"] == 127
    assert b"cannot start '/nonexistent/program'" in term.out


def test_a_pty_command_with_a_timeout_times_out(term: Terminal) -> None:
    term.started(["sleep", "30"], timeout=0.5)
    end = term.exit()
    assert (end["state"], end["exit_code"]) == ("timed_out", 124)


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pty", "extra", "says"),
    [
        ({"cols": 0, "rows": 24}, {}, "cols is 0"),
        ({"cols": 80, "rows": 70000}, {}, "rows is 70000"),
        ({"cols": True}, {}, "cols is True"),
        ({"cols": 80, "depth": 1}, {}, "field 'pty' must be an object"),
        ("80x24", {}, "field 'pty' must be an object"),
        ({}, {"stdin": False}, "field 'stdin' cannot be false with 'pty'"),
    ],
)
def test_a_bad_pty_start_is_refused(term: Terminal, pty: Any, extra: Any, says: str) -> None:
    resp = term.start(["true"], pty=pty, **extra)
    assert resp.status_code == 400, resp.text
    assert says in resp.json()["detail"]


def test_bad_input_and_resizes_are_refused(term: Terminal, alice: Any, sandbox: Any) -> None:
    term.started(["cat"])
    for body, says in (
        ({"data": "x", "eof": True}, "send Ctrl-D"),
        ({"data": "x", "data_base64": "eA=="}, "not both"),
        ({"data_base64": "not base64!"}, "must be a base64 string"),
        ({"data_base64": 5}, "must be a base64 string"),
    ):
        resp = term.post("stdin", **body)
        assert resp.status_code == 400 and says in resp.json()["detail"], resp.text
    for body, says in (
        ({"cols": 80}, "rows is None"),
        ({"cols": 80, "rows": 0}, "rows is 0"),
        ({"cols": 80, "rows": 24, "x": 1}, "must be an object"),
    ):
        resp = term.post("resize", **body)
        assert resp.status_code == 400 and says in resp.json()["detail"], resp.text
    term.post("kill")
    resp = term.post("resize", cols=80, rows=24)
    assert resp.status_code == 409 and "cancelled" in resp.json()["detail"], resp.text
    pipe = Terminal(alice, sandbox).started(["sleep", "30"], pty=None)
    resp = pipe.post("resize", cols=80, rows=24)
    assert resp.status_code == 409 and "without a pty" in resp.json()["detail"], resp.text
    pipe.post("kill")
    pipe.command_id = "missing"
    assert pipe.post("resize", cols=80, rows=24).status_code == 404


def test_a_runtime_without_ptys_refuses_them_as_unknown(alice: Any) -> None:
    sandbox = alice.ready(env={"SANDBOX_COMMAND_PTY": "0"})
    term = Terminal(alice, sandbox)
    resp = term.start(["true"])
    assert resp.status_code == 400, resp.text
    assert "unknown field(s) ['pty']" in resp.json()["detail"]
    term.started(["sleep", "30"], pty=None)
    assert term.post("resize", cols=80, rows=24).status_code == 404
    term.post("kill")


def test_resize_needs_the_commands_scope(api: Callable[..., Any]) -> None:
    with LocalBroker(warn=False) as scoped:
        scoped.add_issuer("files-only", policy=Policy(namespace="files-only", scopes=("files",)))
        token = scoped.issuers["files-only"].issue_token("robot")
        with httpx.Client(
            base_url=scoped.url,
            verify=ssl.create_default_context(cafile=scoped.ca_bundle),
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        ) as http:
            name = http.post("/v1/sandboxes", json={}).json()["name"]
            http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20})
            headers = {"X-Sandbox-ID": name, "X-Sandbox-Namespace": "files-only"}
            resp = http.post("/commands/x/resize", json={"cols": 1, "rows": 1}, headers=headers)
    assert resp.status_code == 403, resp.text
    assert resp.json()["code"] == "scope_denied"
