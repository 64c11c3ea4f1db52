"""``agent-sandbox-awx mcp`` end to end on the local broker, with the ``mcp`` package's client:
over stdio (launched as an agent launches it) and over streamable HTTP."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp", reason="needs the [mcp] extra")

from mcp_types import ImageContent

from tests._support.mcp_servers import HttpServer, server_env, stdio_client_of, texts

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]


def _names(claims: list[dict[str, Any]]) -> list[str]:
    return sorted(c["metadata"]["name"] for c in claims)


async def _settled(broker: Any, *names: str, within: float = 10.0) -> list[str]:
    """The broker's live sandboxes once they are ``names`` (or after ``within``), waiting on
    the event loop (the server's deletions are asynchronous)."""
    expected = sorted(broker.sandbox_name(name) for name in names)
    deadline = asyncio.get_running_loop().time() + within
    while True:
        now = _names([c for c in broker.claims() if not c["metadata"].get("deletionTimestamp")])
        if now == expected or asyncio.get_running_loop().time() > deadline:
            return now
        await asyncio.sleep(0.05)


async def _gone(broker: Any, name: str, within: float = 30.0) -> bool:
    """Whether claim ``name`` is gone, Terminating included, within ``within`` seconds."""
    deadline = asyncio.get_running_loop().time() + within
    while broker.sandbox_name(name) in _names(broker.claims()):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


TOOLS = {
    "create_sandbox",
    "run_command",
    "run_code",
    "read_file",
    "write_file",
    "list_files",
    "list_sandboxes",
    "kill_sandbox",
}


async def test_stdio_lists_the_tools_with_their_schemas(broker: Any, tmp_path: Path) -> None:
    env = server_env(broker.environ("kubernetes"))
    async with stdio_client_of(env, tmp_path / "server.log") as server:
        tools = (await server.client.list_tools()).tools
    assert {t.name for t in tools} >= TOOLS
    for t in tools:
        assert t.description and len(t.description) > 60, t.name
        schema = t.input_schema
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        for name, prop in schema["properties"].items():
            assert prop.get("description"), (t.name, name)
    run = next(t for t in tools if t.name == "run_command")
    assert run.input_schema["required"] == ["command"]


async def test_stdio_default_sandbox_runs_and_keeps_files_and_is_deleted_at_the_end(
    broker: Any, tmp_path: Path, live: Any
) -> None:
    env = server_env(broker.environ("kubernetes"))
    async with stdio_client_of(env, tmp_path / "server.log") as server:
        ran = await server.ok("run_command", command="echo hello; echo oops >&2; exit 3")
        assert (ran["exit_code"], ran["stdout"], ran["stderr"]) == (3, "hello\n", "oops\n")
        default = ran["sandbox"]
        wrote = await server.ok("write_file", path="notes/a.txt", content="one\ntwo\n")
        assert (wrote["sandbox"], wrote["size"]) == (default, 8)
        read = await server.call("read_file", path="notes/a.txt")
        assert not read.is_error and texts(read) == "one\ntwo\n"
        listed = await server.ok("list_files", path="notes")
        assert [(e["name"], e["type"], e["size"]) for e in listed["entries"]] == [
            ("a.txt", "file", 8)
        ]
        again = await server.ok("run_command", command="cat notes/a.txt | wc -l")
        assert (again["sandbox"], again["stdout"].strip()) == (default, "2")
        mine = await server.ok("list_sandboxes")
        assert [(s["sandbox"], s["default"]) for s in mine["sandboxes"]] == [(default, True)]
        assert await _settled(broker, default) == [broker.sandbox_name(default)]
    assert live(broker) == []  # the session ended: its default sandbox is gone


async def test_every_mistake_is_a_tool_result_that_says_what_to_do(
    broker: Any, tmp_path: Path, live: Any
) -> None:
    """Unknown tools and arguments, wrong types, a missing file, a sandbox that is not there,
    a time limit: each an ``isError`` result naming the fix; the session goes on."""
    env = server_env(broker.environ("kubernetes"))
    async with stdio_client_of(env, tmp_path / "server.log") as server:
        said = await server.error("run_shell", command="ls")
        assert "There is no tool 'run_shell'; the tools are create_sandbox," in said
        said = await server.error("run_command", command="ls", timeout=3)
        assert "unknown argument 'timeout'; it takes background, command, cwd," in said
        said = await server.error("run_command")
        assert "the argument 'command' is required" in said
        said = await server.error("run_command", command="ls", timeout_seconds="10")
        assert "timeout_seconds must be a number, not '10'" in said
        said = await server.error("write_file", path="x", content="y", encoding="latin-1")
        assert "encoding must be one of 'utf-8', 'base64'" in said
        said = await server.error("run_command", command="sleep 5", timeout_seconds=0)
        assert "timeout_seconds=0 (no time limit) is for background=true" in said
        said = await server.error("read_file", path="nope.txt")
        assert "nope.txt" in said and "SandboxFileNotFoundError" in said
        said = await server.error("run_command", command="ls", sandbox="sbx-not-mine")
        assert "sbx-not-mine" in said and "list_sandboxes shows the sandboxes there are" in said
        slow = await server.call("run_command", command="echo started; sleep 10", timeout_seconds=1)
        assert slow.is_error and slow.structured_content is not None
        assert slow.structured_content["stdout"] == "started\n"
        assert "ran longer than timeout_seconds=1 and was killed" in texts(slow)
        assert (await server.ok("run_command", command="echo still here"))["exit_code"] == 0
    assert live(broker) == []


async def test_background_commands_explicit_sandboxes_and_kill(
    broker: Any, tmp_path: Path, live: Any
) -> None:
    """A background command returns its id and goes on; kill_sandbox with command_id stops
    it; a sandbox made with create_sandbox is named by every tool and outlives the session
    (deleted with kill_sandbox); killing the default one makes the next call create another."""
    env = server_env(broker.environ("kubernetes"))
    async with stdio_client_of(env, tmp_path / "server.log") as server:
        made = await server.ok("create_sandbox", timeout_seconds=120, envs={"GREETING": "hi"})
        name = made["sandbox"]
        assert made["expires_at"]
        ran = await server.ok(
            "run_command", command="echo $GREETING $X", sandbox=name, envs={"X": "x"}
        )
        assert (ran["sandbox"], ran["stdout"]) == (name, "hi x\n")
        started = await server.ok(
            "run_command", command="echo up > up.txt; exec sleep 300", sandbox=name,
            background=True, timeout_seconds=0,
        )  # fmt: skip
        assert (started["sandbox"], started["timeout_seconds"]) == (name, None)
        stopped = await server.ok("kill_sandbox", sandbox=name, command_id=started["command_id"])
        assert stopped["state"] == "cancelled"
        default = (await server.ok("run_command", command="true"))["sandbox"]
        assert default != name
        assert (await server.ok("kill_sandbox")) == {"sandbox": default, "killed": True}
        fresh = (await server.ok("run_command", command="true"))["sandbox"]
        assert fresh not in (default, name)
    assert await _settled(broker, name) == [broker.sandbox_name(name)]
    async with stdio_client_of(env, tmp_path / "again.log") as server:
        assert await server.ok("kill_sandbox", sandbox=name) == {"sandbox": name, "killed": True}
        # a claim held by finalizers is Terminating a while: a kill then is still a delete
        # (202); "already gone" is for a sandbox that no longer exists
        assert await _gone(broker, name)
        assert await server.ok("kill_sandbox", sandbox=name) == {"sandbox": name, "killed": False}
    assert live(broker) == []


# a 1x1 PNG (a red pixel), made by hand: no imaging library needed
PNG = base64.b64encode(
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02\x00\x00\x00"
    b"\x90wS\xde\x00\x00\x00\x0cIDATx\x9cc\xf8\xcf\xc0\x00\x00\x03\x01\x01\x00\xc9\xfe\x92\xef"
    b"\x00\x00\x00\x00IEND\xaeB`\x82"
).decode()


async def test_outputs_and_files_are_bounded_with_a_note(broker: Any, tmp_path: Path) -> None:
    """A huge output keeps its start and its end around a note; a long file is paged by
    start_line; an image comes back as an image; another binary file is described."""
    env = server_env(broker.environ("kubernetes"))
    async with stdio_client_of(
        env, tmp_path / "server.log", "--max-output-chars", "2000"
    ) as server:
        ran = await server.ok(
            "run_command",
            command="echo FIRST; head -c 500000 /dev/zero | tr '\\0' x; echo; echo LAST",
        )
        out = ran["stdout"]
        assert len(out) <= 2000 and ran["output_cut"] is True
        assert out.startswith("FIRST\nxxx") and out.endswith("xxx\nLAST\n")
        assert "characters of stdout cut here: the output limit is 2,000" in out
        lines = "".join(f"line {n}\n" for n in range(1, 1001))  # 8,893 characters
        await server.ok("write_file", path="long.txt", content=lines)
        first = await server.call("read_file", path="long.txt")
        text = texts(first)
        assert text.startswith("line 1\nline 2\n") and len(first.content[0].text) <= 2000
        go_on = int(re.search(r"start_line=(\d+)", text).group(1))
        assert first.content[0].text.endswith(f"line {go_on - 1}\n")
        page = await server.call("read_file", path="long.txt", start_line=go_on, line_count=3)
        assert page.content[0].text == f"line {go_on}\nline {go_on + 1}\nline {go_on + 2}\n"
        tail = await server.call("read_file", path="long.txt", start_line=999)
        assert texts(tail) == "line 999\nline 1000\n"  # the end: no note
        await server.ok("write_file", path="dot.png", content=PNG, encoding="base64")
        image = await server.call("read_file", path="dot.png")
        assert not image.is_error
        pictures = [b for b in image.content if isinstance(b, ImageContent)]
        assert [(p.mime_type, p.data) for p in pictures] == [("image/png", PNG)]
        await server.ok("write_file", path="blob.bin", content="AAECAwQ=", encoding="base64")
        blob = texts(await server.call("read_file", path="blob.bin"))
        assert "blob.bin is a binary file, 5 bytes; its content is not shown" in blob
        for n in range(3):
            await server.ok("write_file", path=f"many/{n}.txt", content="")
        listed = await server.ok("list_files", path="many")
        assert [e["name"] for e in listed["entries"]] == ["0.txt", "1.txt", "2.txt"]


async def test_no_tool_result_carries_the_token(broker: Any, tmp_path: Path, live: Any) -> None:
    """The server holds the caller's token (a GitLab id token here); no result shows it, nor
    a refused token's error; the sandbox's environment does not have it either."""
    env = broker.environ("gitlab")
    token = env["AGENT_SANDBOX_TOKEN"]
    seen: list[str] = []
    async with stdio_client_of(server_env(env), tmp_path / "server.log") as server:
        for name, arguments in [
            ("run_command", {"command": "env; cat /proc/self/environ | tr '\\0' '\\n'"}),
            ("list_sandboxes", {}),
            ("list_files", {"path": "/app"}),
            ("read_file", {"path": "/proc/self/environ"}),
            ("run_command", {"command": "ls", "sandbox": "sbx-nope"}),
        ]:
            seen.append(json.dumps((await server.call(name, **arguments)).model_dump()))
    wrong = broker.issue_kubernetes_token("default", "default", audience="https://elsewhere")
    refused = server_env(broker.environ("gitlab"), AGENT_SANDBOX_TOKEN=wrong)
    async with stdio_client_of(refused, tmp_path / "refused.log") as server:
        said = await server.error("run_command", command="true")
        assert "elsewhere" in said or "audience" in said, said
        seen.append(said)
    assert seen and not any(token in text or wrong in text for text in seen)
    logs = (tmp_path / "server.log").read_text() + (tmp_path / "refused.log").read_text()
    assert token not in logs and wrong not in logs
    assert live(broker) == []


async def test_sigterm_over_stdio_deletes_the_default_sandbox_mid_command(
    broker: Any, tmp_path: Path, live: Any, process_gone: Any
) -> None:
    """SIGTERM while a command runs in the default sandbox: the server deletes the sandbox and
    exits, with the agent still connected (standard input open)."""
    env = server_env(broker.environ("kubernetes"))
    log = tmp_path / "server.log"
    async with stdio_client_of(env, log) as server:
        default = (await server.ok("run_command", command="true"))["sandbox"]
        long = asyncio.ensure_future(server.call("run_command", command="sleep 60"))
        await asyncio.sleep(1)
        assert await _settled(broker, default) == [broker.sandbox_name(default)]
        assert not long.done()
        pid = server.pid()
        os.kill(pid, signal.SIGTERM)
        assert await asyncio.to_thread(process_gone, pid, 30)
        assert live(broker) == []
        with contextlib.suppress(Exception):
            await long  # the connection is gone: the call fails, however the client says so
    text = log.read_text()
    assert "SIGTERM: stopping" in text and f"default sandbox {default} deleted" in text


async def test_http_each_session_has_its_own_default_sandbox_ended_with_the_session(
    broker: Any, tmp_path: Path, live: Any
) -> None:
    """Over HTTP each session (Mcp-Session-Id) gets its own default sandbox; the client's
    DELETE at its end deletes that one only; SIGTERM ends the rest, and the server exits 0."""
    env = server_env(broker.environ("kubernetes"))
    with HttpServer(env, tmp_path / "server.log") as http:
        async with http.client() as first:
            one = (await first.ok("run_command", command="echo 1 > mine.txt"))["sandbox"]
            async with http.client() as second:
                two = (await second.ok("run_command", command="ls"))["sandbox"]
                assert one != two
                assert (await first.ok("run_command", command="cat mine.txt"))["stdout"] == "1\n"
                listed = (await second.ok("list_sandboxes"))["sandboxes"]
                assert {s["sandbox"]: s["default"] for s in listed} == {one: False, two: True}
            assert await _settled(broker, one) == [broker.sandbox_name(one)]
        assert live(broker) == []
        seen: dict[str, Any] = {}
        with contextlib.suppress(Exception):  # its end cannot reach the server: it is gone
            async with http.client() as third:
                seen["three"] = (await third.ok("run_command", command="true"))["sandbox"]
                seen["before"] = await _settled(broker, seen["three"])
                seen["code"] = await asyncio.to_thread(http.stop, signal.SIGTERM)
                seen["after"] = live(broker)
    three = seen["three"]
    assert (seen["before"], seen["code"], seen["after"]) == ([broker.sandbox_name(three)], 0, [])
    assert f"default sandbox {three} deleted" in (tmp_path / "server.log").read_text()


async def test_http_idle_session_ends_and_sessionless_calls_name_their_sandbox(
    broker: Any, tmp_path: Path, live: Any
) -> None:
    """A client that vanished without ending its session: the session ends after the idle
    timeout, deleting its default sandbox. The sessionless 2026-07-28 protocol has no default
    sandbox: the call says to create one and name it."""
    env = server_env(broker.environ("kubernetes"))
    with HttpServer(env, tmp_path / "server.log", "--idle-timeout", "1") as http:
        async with http.client(terminate=False) as gone:
            default = (await gone.ok("run_command", command="true"))["sandbox"]
            assert await _settled(broker, default) == [broker.sandbox_name(default)]
        assert live(broker, timeout=30) == []
        async with http.client(mode="auto") as modern:
            said = await modern.error("run_command", command="true")
            assert "this connection has no MCP session" in said and "create_sandbox" in said
            made = (await modern.ok("create_sandbox"))["sandbox"]
            ran = await modern.ok("run_command", command="echo named", sandbox=made)
            assert ran["stdout"] == "named\n"
            assert (await modern.ok("kill_sandbox", sandbox=made))["killed"] is True
    assert live(broker) == []


# an object with _repr_png_: the display protocol gives an image without any imaging library
SHOWS_A_PNG = f"""
import base64
class Dot:
    def _repr_png_(self):
        return base64.b64decode({PNG!r})
    def __repr__(self):
        return "<a red dot>"
Dot()
"""


async def test_run_code_keeps_state_returns_errors_and_images(
    broker: Any, tmp_path: Path, live: Any
) -> None:
    """run_code: state kept across calls (and per named context), an exception in the code a
    result (not a failure of the tool), a value with _repr_png_ an image, a runaway cell cut
    at its time limit with the state kept."""
    env = server_env(broker.environ("kubernetes"))
    async with stdio_client_of(env, tmp_path / "server.log") as server:
        assert "run_code" in {t.name for t in (await server.client.list_tools()).tools}
        first = await server.ok("run_code", code="x = 41\nprint('set')")
        assert (first["stdout"], first["text"], first["error"]) == ("set\n", None, None)
        second = await server.ok("run_code", code="x + 1")
        assert (second["text"], second["sandbox"]) == ("42", first["sandbox"])
        assert second["results"][0]["main"] is True
        await server.ok("run_code", code="x = 'other'", context="scratch")
        assert (await server.ok("run_code", code="x", context="scratch"))["text"] == "'other'"
        assert (await server.ok("run_code", code="x"))["text"] == "41"
        failed = await server.ok("run_code", code="1 / 0")
        error = failed["error"]
        assert (error["name"], error["value"]) == ("ZeroDivisionError", "division by zero")
        assert "ZeroDivisionError" in error["traceback"]
        shown = await server.call("run_code", code=SHOWS_A_PNG)
        assert not shown.is_error, texts(shown)
        assert [(b.mime_type, b.data) for b in shown.content if isinstance(b, ImageContent)] == [
            ("image/png", PNG)
        ]
        structured = shown.structured_content or {}
        assert structured["text"] == "<a red dot>" and "png" in structured["results"][0]["formats"]
        stuck = await server.call("run_code", code="while True:\n    pass", timeout_seconds=1)
        assert stuck.is_error and (stuck.structured_content or {})["timed_out"] is True
        assert (await server.ok("run_code", code="x"))["text"] == "41"
    assert live(broker) == []


async def test_run_code_on_a_runtime_without_it_is_an_error_result_naming_it(
    legacy_broker: Any, tmp_path: Path
) -> None:
    env = server_env(legacy_broker.environ("kubernetes"))
    async with stdio_client_of(env, tmp_path / "server.log") as server:
        said = await server.error("run_code", code="1 + 1")
        assert "UnsupportedByRuntimeError" in said and "run_code" in said, said
        assert (await server.ok("list_sandboxes"))["sandboxes"]  # the session goes on
