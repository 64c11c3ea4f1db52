"""The MCP server's pieces without a broker: argument checks, output bounds, file pages, the
default sandbox of a session (one create however many calls race; none outlives the end)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from k8s_agent_sandbox_awx.mcp._bounds import LinePager, cut_middle, sniff
from k8s_agent_sandbox_awx.mcp._sessions import Session, SessionEnded
from k8s_agent_sandbox_awx.mcp._tools import TOOLS, ArgumentError, check_arguments, tool


def test_arguments_are_checked_with_messages_that_name_the_fix() -> None:
    run = tool("run_command")
    assert check_arguments(run, {"command": "ls", "timeout_seconds": 2.0, "cwd": None}) == {
        "command": "ls",
        "timeout_seconds": 2.0,
    }
    cases = [
        ({"command": "ls", "envs": {"A": 1}}, "the value of 'A' must be a string"),
        ({"command": "ls", "envs": ["A=1"]}, "must be an object of variable names"),
        ({"command": "ls", "background": "yes"}, "background must be true or false"),
        ({"command": "ls", "timeout_seconds": -1}, "timeout_seconds must be at least 0"),
        ({"command": "ls", "timeout_seconds": float("nan")}, "must be a number"),
        ({"command": 7}, "command must be a string, not 7"),
        ({"cmd": "ls"}, "unknown argument 'cmd'; it takes background, command, cwd"),
    ]
    for arguments, says in cases:
        with pytest.raises(ArgumentError, match="run_command") as info:
            check_arguments(run, arguments)
        assert says in str(info.value), (arguments, str(info.value))
    read = tool("read_file")
    assert check_arguments(read, {"path": "a", "start_line": 3.0})["start_line"] == 3
    for bad in (0, 2.5, True):
        with pytest.raises(ArgumentError, match="start_line"):
            check_arguments(read, {"path": "a", "start_line": bad})
    with pytest.raises(ArgumentError, match="timeout_seconds must be greater than 0"):
        check_arguments(tool("create_sandbox"), {"timeout_seconds": 0})


def test_every_schema_says_what_check_arguments_enforces() -> None:
    for spec in TOOLS:
        schema = spec.input_schema()
        assert set(schema["properties"]) == {p.name for p in spec.params}
        assert schema["required"] == [p.name for p in spec.params if p.required]
        sample = {p.name: _sample(p.kind, p.choices) for p in spec.params}
        assert check_arguments(spec, sample) == sample


def _sample(kind: str, choices: tuple[str, ...]) -> Any:
    return {"string": choices[0] if choices else "x", "integer": 5, "number": 1.5,
            "boolean": False, "env": {"A": "b"}}[kind]  # fmt: skip


def test_cut_middle_keeps_both_ends_within_the_limit() -> None:
    assert cut_middle("short", 100, "stdout") == ("short", False)
    text = "A" * 5000 + "Z" * 5000
    cut, was_cut = cut_middle(text, 1000, "stdout")
    assert was_cut and len(cut) <= 1000
    assert cut.startswith("A" * 500) and cut.endswith("Z" * 250)
    assert "9,200 characters of stdout cut here: the output limit is 1,000" in cut


def test_line_pager_pages_by_whole_lines_across_chunks() -> None:
    data = "".join(f"{n}\r\n" for n in range(1, 101)).encode()
    pager = LinePager(10, 5, 10_000)
    for i in range(0, len(data), 7):  # chunks split lines (and \r\n) anywhere
        pager.feed(data[i : i + 7])
        if pager.full:
            break
    assert pager.text() == "10\r\n11\r\n12\r\n13\r\n14\r\n"
    assert pager.note(ended=False) == (
        "[the file goes on: call read_file again with start_line=15 to read on]"
    )
    tail = LinePager(99, None, 10_000)
    tail.feed(data)
    tail.feed(b"", final=True)
    assert (tail.text(), tail.note(ended=True)) == ("99\r\n100\r\n", None)
    one = LinePager(1, None, 10)
    one.feed(b"x" * 50)
    assert one.text() == "x" * 10 and "line 1 is cut at the output limit" in (one.note(False) or "")
    utf8 = LinePager(1, None, 100)
    for byte in "é€\n".encode():  # multi-byte characters fed a byte at a time
        utf8.feed(bytes([byte]))
    assert utf8.text() == "é€\n"


def test_sniff() -> None:
    assert sniff(b"\x89PNG\r\n\x1a\nrest") == "image/png"
    assert sniff(b"\xff\xd8\xff\xe0") == "image/jpeg"
    assert sniff(b"GIF89a...") == "image/gif"
    assert sniff(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "image/webp"
    assert sniff(b"plain text\n") == "text" and sniff(b"") == "text"
    assert sniff("naïve\n".encode()[:3]) == "text"  # a character cut at the chunk's end
    assert sniff(b"\x00\x01\x02") == "binary" and sniff(b"\xff\xfe\xfa") == "binary"


class _Handle:
    def __init__(self, name: str) -> None:
        self.name = name


class _Sandboxes:
    """Sandboxes that take ``delay`` seconds to create, recording creates and kills."""

    def __init__(self, delay: float = 0.05) -> None:
        self.delay, self.created, self.killed = delay, [], []

    async def create(self) -> _Handle:
        await asyncio.sleep(self.delay)
        self.created.append(f"sbx-{len(self.created)}")
        return _Handle(self.created[-1])

    async def kill(self, name: str) -> bool:
        self.killed.append(name)
        return True

    def forget(self, name: str) -> None:
        pass


@pytest.mark.asyncio
async def test_racing_calls_share_one_default_sandbox_and_the_end_deletes_it() -> None:
    sandboxes = _Sandboxes()
    session = Session(sandboxes, "test")  # type: ignore[arg-type]
    got = await asyncio.gather(*(session.default() for _ in range(5)))
    assert {h.name for h in got} == {"sbx-0"} and sandboxes.created == ["sbx-0"]
    assert session.forget_default("sbx-0") and session.default_name is None
    assert (await session.default()).name == "sbx-1"
    await session.close()
    assert sandboxes.killed == ["sbx-1"]
    with pytest.raises(SessionEnded):
        await session.default()


@pytest.mark.asyncio
async def test_a_session_that_ends_during_the_create_leaves_no_sandbox() -> None:
    """The create still running when the session ends is cancelled (AsyncSandbox.create then
    deletes its claim); one that completes anyway is deleted at once."""
    sandboxes = _Sandboxes(delay=0.5)
    session = Session(sandboxes, "test")  # type: ignore[arg-type]
    waiting = asyncio.ensure_future(session.default())
    await asyncio.sleep(0.05)
    await session.close()
    with pytest.raises((asyncio.CancelledError, SessionEnded)):
        await waiting
    assert sandboxes.created == [] and sandboxes.killed == []
