"""The broker's own HTTP/1.1 codec (``backends._h1``), which replaced h11 in the pool: the
request's head as bytes (what it refuses before anything is sent), and the answer's parser on
its edge cases (obsolete folding, status lines, chunk sizes and extensions, trailers, the head's
bound, ``Content-Length`` and ``Transfer-Encoding``, HTTP/1.0, the answers without a body), then
a few of them through the pool (``backends._http11``) on loopback. Found while writing them: the
first version of the pool moved every received byte to the parser at each body read, so a
slow reader of an endless answer of small chunks let the parser's buffer grow by a read per
chunk (78 MB in the last test); bytes are now moved only when the parser needs more.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from k8s_agent_sandbox_awx.broker.backends._h1 import (
    CHUNKED,
    MAX_HEAD,
    UNTIL_CLOSE,
    Head,
    Parser,
    body_framing,
    request_head,
)
from k8s_agent_sandbox_awx.broker.backends._http11 import READ_BUFFER
from tests._support.loopback_runtime import LoopbackRuntime

HOST = b"host: runtime\r\n"
TIMEOUT = httpx.Timeout(connect=5.0, read=5.0, write=5.0, pool=10.0)


def _answer(raw: bytes, method: bytes = b"GET", closed: bool = False) -> tuple[Head, bytes, bytes]:
    """``raw`` parsed at once: the head, the body (to its end) and what is left after it."""
    parser = Parser()
    parser.buffer += raw
    parser.closed = closed
    head = parser.head()
    assert head is not None
    parser.begin(body_framing(method, head))
    parts = []
    while part := parser.body():
        parts.append(part)
    assert part == b"" and parser.done
    return head, b"".join(parts), bytes(parser.buffer)


def _refused(raw: bytes, match: str, method: bytes = b"GET", closed: bool = False) -> None:
    with pytest.raises(httpx.RemoteProtocolError, match=match):
        _answer(raw, method, closed)


# ------------------------------------------------------------------------------ the head


def test_a_plain_answer_and_what_follows_it() -> None:
    head, body, rest = _answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b\r\n\r\nokNEXT")
    assert (head.status, head.keep_alive, head.length, head.chunked) == (200, True, 2, False)
    assert head.headers == [(b"Content-Length", b"2"), (b"X-A", b"b")]
    assert (body, rest) == (b"ok", b"NEXT")


def test_obsolete_line_folding_is_joined_with_a_space_but_not_at_the_start() -> None:
    head, _, _ = _answer(
        b"HTTP/1.1 204 No Content\r\nX-A: one\r\n  two\r\n\tthree\r\nX-B: c\r\n\r\n"
    )
    assert head.headers == [(b"X-A", b"one two three"), (b"X-B", b"c")]
    _refused(b"HTTP/1.1 204 No Content\r\n folded: x\r\n\r\n", "continuation line")


@pytest.mark.parametrize(
    "line",
    [
        b"HTTP/1.1 20 OK",
        b"HTTP/1.1 2000 OK",
        b"HTTP/11 200 OK",
        b"HTTP/1.1 200OK",
        b"http/1.1 200 OK",
        b"ICY 200 OK",
        b"HTTP/1.1  200 OK",
        b"HTTP/1.1 099 Too Low",
        b"HTTP/1.1 200 O\x00K",
    ],
)
def test_a_bad_status_line_is_refused(line: bytes) -> None:
    _refused(line + b"\r\nContent-Length: 0\r\n\r\n", "status")


def test_a_status_line_without_reason_and_bare_line_feeds_are_taken() -> None:
    head, body, _ = _answer(b"HTTP/1.1 404\nContent-Length: 1\n\nx")
    assert (head.status, head.headers, body) == (404, [(b"Content-Length", b"1")], b"x")


def test_a_blank_before_the_status_line_is_refused_before_the_head_ends() -> None:
    parser = Parser()
    parser.buffer += b"\r\nHTTP/1.1 200 OK"  # not complete: refused all the same
    with pytest.raises(httpx.RemoteProtocolError, match="blank"):
        parser.head()


@pytest.mark.parametrize(
    "line", [b"X A: b", b": b", b"X-A b", b"X-A: b\x00c", b"X-A: b\rc", b"X\x7f: b"]
)
def test_a_bad_header_line_is_refused(line: bytes) -> None:
    _refused(b"HTTP/1.1 200 OK\r\n" + line + b"\r\nContent-Length: 0\r\n\r\n", "header line")


def test_a_head_over_the_bound_is_refused_whole_or_not() -> None:
    parser = Parser()
    parser.buffer += b"HTTP/1.1 200 OK\r\n"
    line = b"X-Pad: " + b"p" * 1000 + b"\r\n"
    while len(parser.buffer) <= MAX_HEAD - len(line):
        parser.buffer += line
        assert parser.head() is None  # incomplete, within the bound: more is awaited
    parser.buffer += line
    with pytest.raises(httpx.RemoteProtocolError, match="longer than"):
        parser.head()
    whole = b"HTTP/1.1 200 OK\r\n" + line * (MAX_HEAD // len(line) + 1) + b"\r\n"
    _refused(whole, "longer than")


def test_a_head_that_comes_a_byte_at_a_time_is_parsed_once_whole() -> None:
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    parser = Parser()
    got: list[bytes] = []
    head = None
    for byte in raw:
        parser.buffer.append(byte)
        if head is None:
            head = parser.head()
            if head is not None:
                parser.begin(body_framing(b"GET", head))
            continue
        while part := parser.body():
            got.append(part)
    assert head is not None and head.status == 200
    assert parser.done and b"".join(got) == b"abc" and not parser.buffer


# ------------------------------------------------------------------------------ framing


@pytest.mark.parametrize("value", [b"-1", b"+5", b"5x", b"", b"0x5", b"1" * 21, b"5 5"])
def test_a_bad_content_length_is_refused(value: bytes) -> None:
    _refused(b"HTTP/1.1 200 OK\r\nContent-Length: " + value + b"\r\n\r\n", "Content-Length")


@pytest.mark.parametrize(
    "lengths", [[b"5", b"6"], [b"5, 6"], [b"5", b"5, 6"]], ids=["two", "a list", "both"]
)
def test_conflicting_content_lengths_are_refused(lengths: list[bytes]) -> None:
    fields = b"".join(b"Content-Length: %s\r\n" % value for value in lengths)
    _refused(b"HTTP/1.1 200 OK\r\n" + fields + b"\r\nhello!", "conflicting")


def test_equal_content_lengths_are_one_and_leading_zeros_are_read_as_decimal() -> None:
    head, body, rest = _answer(
        b"HTTP/1.1 200 OK\r\nContent-Length: 005\r\ncontent-length: 005, 005\r\n\r\nhello!"
    )
    assert head.headers == [(b"Content-Length", b"005")] and head.length == 5
    assert (body, rest) == (b"hello", b"!")
    _refused(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 05\r\n\r\nhello", "conflict")


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"chunked, gzip", b"gzip", b"identity"])
def test_a_transfer_coding_other_than_chunked_alone_is_refused(coding: bytes) -> None:
    _refused(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + coding + b"\r\n\r\n0\r\n\r\n", "chunked")


def test_transfer_encoding_twice_is_refused_and_its_case_does_not_matter() -> None:
    two = b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n"
    _refused(b"HTTP/1.1 200 OK\r\n" + two + b"\r\n0\r\n\r\n", "chunked")
    head, body, _ = _answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: CHUNKED\r\n\r\n0\r\n\r\n")
    assert head.chunked and head.headers == [(b"Transfer-Encoding", b"chunked")] and body == b""


def test_chunked_beats_content_length() -> None:
    head, body, rest = _answer(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
    )
    assert body_framing(b"GET", head) == CHUNKED and (body, rest) == (b"hello", b"")


def test_chunk_extensions_and_trailers_are_read_and_dropped() -> None:
    _, body, rest = _answer(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value;x\r\nhello\r\n1 \r\n!\r\nA;last\r\n0123456789\r\n"
        b"0;end\r\nX-Checksum: 1\r\nX-More: 2\r\n\r\nNEXT"
    )
    assert (body, rest) == (b"hello!0123456789", b"NEXT")


@pytest.mark.parametrize(
    "chunks", [b"zz\r\n", b"-1\r\n", b"0x5\r\n", b"1" * 21 + b"\r\n", b"5\nhello\r\n", b"\r\n"]
)
def test_a_bad_chunk_size_is_refused(chunks: bytes) -> None:
    _refused(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks, "chunk header")


@pytest.mark.parametrize("after", [b"helloXX0\r\n\r\n", b"hello\n0\r\n\r\n"])
def test_a_chunk_without_its_crlf_is_refused(after: bytes) -> None:
    _refused(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n" + after, "footer")


def test_a_bad_trailer_is_refused() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    _refused(head + b"0\r\nbad trailer\r\n\r\n", "header line")
    _refused(head + b"0\r\nContent-Length: x\r\n\r\n", "Content-Length")


def test_a_body_cut_by_the_close_fails_unless_the_close_frames_it() -> None:
    _refused(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel", "received 3 bytes", closed=True)
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    for cut in (b"5\r\nhel", b"5\r\nhello\r\n3", b"5\r\nhello\r", b"0\r\nX-T: 1\r\n"):
        _refused(chunked + cut, "incomplete chunked read", closed=True)
    head, body, _ = _answer(b"HTTP/1.1 200 OK\r\n\r\nto the end", closed=True)
    assert body_framing(b"GET", head) == UNTIL_CLOSE and body == b"to the end"


def test_no_body_after_head_204_and_304_whatever_the_headers_say() -> None:
    for status, method in ((b"204", b"GET"), (b"304", b"GET"), (b"200", b"HEAD")):
        head, body, rest = _answer(
            b"HTTP/1.1 " + status + b" X\r\nContent-Length: 5\r\n\r\nhello", method
        )
        assert body_framing(method, head) == 0 and (body, rest) == (b"", b"hello")


def test_keep_alive_only_for_http_1_1_without_close() -> None:
    def kept(raw: bytes) -> bool:
        return _answer(raw + b"Content-Length: 0\r\n\r\n")[0].keep_alive

    assert kept(b"HTTP/1.1 200 OK\r\n")
    assert kept(b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n")
    assert not kept(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n")
    assert not kept(b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\n")
    assert not kept(b"HTTP/1.1 200 OK\r\nConnection: upgrade\r\nConnection: close\r\n")


# ------------------------------------------------------------------------------ the request


def test_the_request_head_host_first_and_the_framing_httpx_gives() -> None:
    head, framing, close = request_head(b"GET", b"/a?b=c", HOST, [(b"accept", b"*/*")], None)
    assert head == b"GET /a?b=c HTTP/1.1\r\nhost: runtime\r\naccept: */*\r\n\r\n"
    assert (framing, close) == (None, False)
    head, framing, _ = request_head(b"POST", b"/x", HOST, [], b"")
    assert head.endswith(b"\r\ncontent-length: 0\r\n\r\n") and framing == 0
    head, framing, _ = request_head(b"DELETE", b"/x", HOST, [], b"")
    assert b"content-length" not in head and framing == 0
    head, framing, _ = request_head(b"PUT", b"/x", HOST, [], _chunks())
    assert head.endswith(b"\r\ntransfer-encoding: chunked\r\n\r\n") and framing == CHUNKED
    given = [(b"Content-Length", b"7, 7"), (b"content-length", b"7")]
    head, framing, _ = request_head(b"PUT", b"/x", HOST, given, _chunks())
    assert b"\r\nContent-Length: 7\r\n" in head and head.count(b"ength:") == 1
    assert framing == 7 and b"chunked" not in head
    _, _, close = request_head(b"GET", b"/", HOST, [(b"Connection", b"Keep-Alive, close")], None)
    assert close
    odd = [(b"x-a", b"a\tb \x80\x01")]  # h11 took these: tabs and spaces within, obs-text, CTLs
    assert b"\r\nx-a: a\tb \x80\x01\r\n" in request_head(b"GET", b"/", HOST, odd, None)[0]


def _chunks() -> object:
    async def chunks():  # type: ignore[no-untyped-def]
        yield b"x"

    return chunks()


@pytest.mark.parametrize(
    ("method", "target", "headers", "match"),
    [
        (b"GE T", b"/", [], "method"),
        (b"", b"/", [], "method"),
        (b"GET", b"/a b", [], "target"),
        (b"GET", b"/\r\nX: y", [], "target"),
        (b"GET", b"", [], "target"),
        (b"GET", b"/", [(b"x-a", b"b\r\nx-injected: 1")], "value"),
        (b"GET", b"/", [(b"x-a", b"b\nc")], "value"),
        (b"GET", b"/", [(b"x-a", b"b\x00")], "value"),
        (b"GET", b"/", [(b"x a", b"b")], "name"),
        (b"GET", b"/", [(b"", b"b")], "name"),
        (b"GET", b"/", [(b"x-a:", b"b")], "name"),
        (b"GET", b"/", [(b"x-a:x-b", b"b")], "name"),
        (b"GET", b"/", [(b"x-a", b"b"), (b"x-b:x-c", b"d")], "name"),
        (b"GET", b"/", [(b"x-a", b" b")], "value"),
        (b"GET", b"/", [(b"x-a", b"b\t")], "value"),
        (b"GET", b"/", [(b"x-a", b"b\x0cc")], "value"),
        (b"GET", b"/", [(b"x-a", b"b"), (b"x-b", b"c\nd")], "value"),
        (b"POST", b"/", [(b"content-length", b"4")], "length"),
        (b"POST", b"/", [(b"content-length", b"1, 1"), (b"content-length", b"1")], "length"),
        (b"GET", b"/", [(b"x-a\r\nx-b", b"b")], "name"),
        (b"GET", b"/", [(b"x-a", b"b"), (b"x\x00", b"b")], "name"),
        (b"GET", b"/", [(b"content-length", b"-1")], "Content-Length"),
        (b"GET", b"/", [(b"content-length", b"1"), (b"content-length", b"2")], "conflicting"),
        (b"GET", b"/", [(b"transfer-encoding", b"gzip, chunked")], "chunked"),
        (b"GET", b"/", [(b"transfer-encoding", b"chunked"), (b"content-length", b"1")], "both"),
    ],
)
def test_a_request_part_http_does_not_allow_is_refused(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], match: str
) -> None:
    body = b"abc" if method == b"POST" else None
    with pytest.raises(httpx.LocalProtocolError, match=match):
        request_head(method, target, HOST, headers, body)


# ------------------------------------------------------------------------------ the pool


def _exchange(answers: list[bytes], requests: list[tuple[bytes, bytes | None]]) -> list[object]:
    """Each request (method, body) sent in turn through one pool to a runtime that answers each
    request with the next of ``answers``; per request its answer's status and body, or the
    exception's type. Last: how many connections the runtime saw."""

    async def main() -> list[object]:
        queue = list(answers)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while queue:
                head = await reader.readuntil(b"\r\n\r\n")
                if b"content-length: " in head.lower():
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    await reader.readexactly(length)
                writer.write(queue.pop(0))
                await writer.drain()
            await reader.read()

        got: list[object] = []
        async with LoopbackRuntime(serve) as server:
            pool = server.pool()
            for method, body in requests:
                try:
                    answer = await pool.send(method, b"/", [], body, TIMEOUT)
                    parts = [part async for part in answer.aiter_raw()]
                    got.append((answer.status_code, b"".join(parts)))
                except httpx.HTTPError as exc:
                    got.append(type(exc))
            got.append(server.connections)
            await pool.aclose()
        return got

    return asyncio.run(main())


def test_head_204_and_304_answers_keep_their_connection() -> None:
    got = _exchange(
        [
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 304 Not Modified\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        ],
        [(b"HEAD", None), (b"GET", None), (b"GET", None), (b"POST", b"body")],
    )
    assert got == [(200, b""), (204, b""), (304, b""), (200, b"ok"), 1]


def test_an_http_1_0_answer_is_not_kept_even_if_it_says_keep_alive() -> None:
    ten = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"
    got = _exchange([ten, ten], [(b"GET", None), (b"GET", None)])
    assert got == [(200, b"ok"), (200, b"ok"), 2], got


def test_a_101_is_refused_and_an_informational_answer_skipped() -> None:
    got = _exchange(
        [
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\n"
            b"Content-Length: 2\r\n\r\nok",
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
        ],
        [(b"GET", None), (b"GET", None)],
    )
    assert got == [(200, b"ok"), httpx.RemoteProtocolError, 1]


def test_the_request_goes_out_framed_and_a_refused_one_not_at_all() -> None:
    async def main() -> tuple[bytes, int, int]:
        seen = bytearray()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.extend(await reader.readuntil(b"0\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()

        async def body():  # type: ignore[no-untyped-def]
            yield b"hello"
            yield b""
            yield b", world"

        async with LoopbackRuntime(serve) as server:
            pool = server.pool()
            with pytest.raises(httpx.LocalProtocolError):
                await pool.send(b"GET", b"/", [(b"x", b"a\r\nb: c")], None, TIMEOUT)
            answer = await pool.send(b"POST", b"/up", [(b"x-a", b"b")], body(), TIMEOUT)
            assert [part async for part in answer.aiter_raw()] == []
            await pool.aclose()
            return bytes(seen), server.connections, server.port

    seen, connections, port = asyncio.run(main())
    assert seen == (
        b"POST /up HTTP/1.1\r\nhost: 127.0.0.1:%d\r\nx-a: b\r\ntransfer-encoding: chunked\r\n"
        b"\r\n5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n" % port
    )
    assert connections == 1  # the refused request was refused before a connection was made


def test_an_endless_chunked_answer_to_a_slow_reader_is_not_buffered() -> None:
    """Small chunks without end to a reader that keeps taking one now and then: what waits in
    the broker stays within its read buffer (and a read), however many the reader took (the
    parser's buffer is refilled only when it holds no whole chunk)."""

    async def main() -> int:
        async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"100\r\n" + b"c" * 256 + b"\r\n")
                await writer.drain()

        held = 0
        async with LoopbackRuntime(endless) as server:
            pool = server.pool()
            answer = await pool.send(b"GET", b"/", [], None, TIMEOUT)
            chunks = answer.aiter_raw()
            for _ in range(300):
                await chunks.__anext__()
                await asyncio.sleep(0.001)
                (connection,) = pool._open
                held = max(held, len(connection.received) + len(connection.parser.buffer))
            await answer.aclose()
        return held

    held = asyncio.run(main())
    assert held <= READ_BUFFER + 256 * 1024, held
