"""A response consumed as a stream: NDJSON events as their lines complete, sync and async,
through the one exchange (auth, errors) — the room for command output and directory watches."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import AsyncBrokerSandboxClient, BrokerSandboxClient, OIDCTokenAuth
from k8s_agent_sandbox_awx.client.http._exchange import Answered
from k8s_agent_sandbox_awx.client.wire._protocol import NdjsonDecoder, RequestSpec
from k8s_agent_sandbox_awx.errors import (
    BrokerNotFoundError,
    BrokerProtocolError,
    BrokerUnavailableError,
)

BROKER = "https://broker.test"
CHUNKS = [b'{"seq": 1, "data": "a"}\n{"se', b'q": 2, "data": "b"}\n', b"\n", b'{"seq": 3}']
EVENTS = [{"seq": 1, "data": "a"}, {"seq": 2, "data": "b"}, {"seq": 3}]


class Chunks(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __iter__(self) -> Iterator[bytes]:
        yield from CHUNKS

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in CHUNKS:
            yield chunk


def answer(request: httpx.Request) -> httpx.Response:
    assert request.headers["Authorization"] == "Bearer opaque"
    if request.url.path == "/missing":
        return httpx.Response(404, json={"code": "not_found", "detail": "gone"})
    return httpx.Response(200, stream=Chunks(), headers={"Content-Type": "application/x-ndjson"})


def test_ndjson_decoder_splits_lines_across_chunks() -> None:
    decoder = NdjsonDecoder("follow events")
    assert [v for chunk in CHUNKS for v in decoder.feed(chunk)] + decoder.end() == EVENTS
    with pytest.raises(BrokerProtocolError, match="follow events"):
        NdjsonDecoder("follow events").feed(b"not json\n")
    with pytest.raises(BrokerProtocolError, match="longer than"):
        NdjsonDecoder("follow events", max_line=4).feed(b"12345")


def test_events_stream_sync() -> None:
    client = BrokerSandboxClient(
        broker_url=BROKER, auth=OIDCTokenAuth("opaque"), http_transport=httpx.MockTransport(answer)
    )
    try:
        assert list(client._transport.events(RequestSpec("GET", "/events", "follow"))) == EVENTS
        with pytest.raises(BrokerNotFoundError):
            list(client._transport.events(RequestSpec("GET", "/missing", "follow")))
    finally:
        client.close()


def test_events_stream_async() -> None:
    async def main() -> list[Any]:
        client = AsyncBrokerSandboxClient(
            broker_url=BROKER,
            auth=OIDCTokenAuth("opaque"),
            http_transport=httpx.MockTransport(answer),
        )
        try:
            with pytest.raises(BrokerNotFoundError):
                async for _ in client._transport.events(RequestSpec("GET", "/missing", "x")):
                    pass
            return [e async for e in client._transport.events(RequestSpec("GET", "/e", "x"))]
        finally:
            await client.close()

    assert asyncio.run(main()) == EVENTS


class BreaksAfterTwoLines(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield CHUNKS[0]
        yield CHUNKS[1]
        raise httpx.ReadError("connection reset")


def whole(request: httpx.Request) -> httpx.Response:
    """An answer with a ``Content-Length`` (what ``Prefer: no-live-output`` gets), whole or
    broken after two lines."""
    body = b"".join(CHUNKS)
    headers = {"Content-Type": "application/x-ndjson", "Content-Length": str(len(body))}
    if request.url.path == "/broken":
        return httpx.Response(200, stream=BreaksAfterTwoLines(), headers=headers)
    return httpx.Response(200, stream=Chunks(), headers=headers)


def test_an_answer_with_a_content_length_is_read_whole_its_break_after_its_values() -> None:
    """``open_events`` reads such an answer at once (an ``Answered``, no stream to close); a
    read that breaks gives the values that arrived first, then the typed error, as the stream
    does; a chunked answer is the stream."""

    async def main() -> None:
        client = AsyncBrokerSandboxClient(
            broker_url=BROKER,
            auth=OIDCTokenAuth("opaque"),
            http_transport=httpx.MockTransport(whole),
        )
        transport = client._transport
        try:
            answered = await transport.open_events(RequestSpec("GET", "/e", "x"))
            assert isinstance(answered, Answered)
            assert [answered.next() for _ in range(4)] == [*EVENTS, None]
            broken = await transport.open_events(RequestSpec("GET", "/broken", "x"))
            assert isinstance(broken, Answered)
            assert [broken.next(), broken.next()] == EVENTS[:2]
            with pytest.raises(BrokerUnavailableError):
                broken.next()
            assert broken.next() is None  # raised once
        finally:
            await client.close()
        streamed = AsyncBrokerSandboxClient(
            broker_url=BROKER,
            auth=OIDCTokenAuth("opaque"),
            http_transport=httpx.MockTransport(answer),
        )
        try:
            values = await streamed._transport.open_events(RequestSpec("GET", "/e", "x"))
            assert not isinstance(values, Answered)
            assert [e async for e in values] == EVENTS
        finally:
            await streamed.close()

    asyncio.run(main())


@pytest.mark.e2e
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_events_stream_through_the_local_broker_sync_and_async(broker: Any) -> None:
    """A managed command's NDJSON events, streamed through the broker over real HTTPS by the
    one exchange (auth, the dialect's data-plane headers), sync and async."""
    from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox
    from k8s_agent_sandbox_awx.client.wire._dataplane import data_request
    from k8s_agent_sandbox_awx.client.wire._protocol import json_body

    env = broker.environ("kubernetes")

    def specs(target: Any) -> tuple[RequestSpec, Any]:
        start = json_body(
            data_request("POST", "/commands", "start a command", target),
            {"command": ["sh", "-c", "echo one; echo two >&2"], "timeout": 30},
        )
        return start, lambda cid: data_request(
            "GET", f"/commands/{cid}/events", "follow a command", target
        )

    def check(events: list[Any]) -> None:
        kinds = [e["type"] for e in events if e["type"] != "heartbeat"]
        assert kinds[-1] == "exit" and "stdout" in kinds and "stderr" in kinds
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(seqs)
        assert "".join(e["data"] for e in events if e["type"] == "stdout") == "one\n"

    with Sandbox.create(environ=env) as sandbox:
        transport = sandbox.client._transport
        start, follow = specs(sandbox.client.dialect.data_target(sandbox.info))
        cid = json.loads(transport.send(start).content)["command_id"]
        check(list(transport.events(follow(cid))))

    async def main() -> None:
        async with await AsyncSandbox.create(environ=env) as sandbox:
            transport = sandbox.client._transport
            start, follow = specs(sandbox.client.dialect.data_target(sandbox.info))
            cid = json.loads((await transport.send(start)).content)["command_id"]
            check([e async for e in transport.events(follow(cid))])

    asyncio.run(main())


EVENTS_HI = (
    b'{"type":"stdout","seq":1,"data":"hi\\n"}\n'
    b'{"type":"exit","seq":2,"data":"","exit_code":0,"state":"exited"}\n'
)
"""The events of ``echo hi`` (what GET events answers in the streamed-start tests)."""


def run_echo_hi(start: httpx.Response) -> tuple[Any, list[str]]:
    """A foreground ``echo hi`` against a runtime that answers the start with ``start`` and
    GET events with :data:`EVENTS_HI`: its result and the requests sent."""
    from k8s_agent_sandbox_awx.client._commands import _Performer
    from k8s_agent_sandbox_awx.client.core import _command_ops as ops
    from k8s_agent_sandbox_awx.client.core._command_rules import StartPlan
    from k8s_agent_sandbox_awx.client.core._command_start import RuntimeFeatures
    from k8s_agent_sandbox_awx.client.core._steps import learning
    from k8s_agent_sandbox_awx.client.wire._protocol import RouterTarget

    seen: list[str] = []

    def runtime(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        if request.method == "POST":
            return start
        ndjson = {"Content-Type": "application/x-ndjson"}
        return httpx.Response(200, headers=ndjson, content=EVENTS_HI)

    client = BrokerSandboxClient(
        broker_url=BROKER, auth=OIDCTokenAuth("opaque"), http_transport=httpx.MockTransport(runtime)
    )
    client._transport._sleep = lambda _s: None
    try:
        features = RuntimeFeatures()
        op = learning(
            ops.foreground(RouterTarget("sbx"), StartPlan.make("echo hi", 5), features),
            features.record,
        )
        return _Performer(client._transport, None, None).drive(op), seen
    finally:
        client.close()


def test_a_stream_that_ends_inside_a_line_is_a_drop_and_a_run_resumes() -> None:
    """A close-delimited answer (an HTTP/1.0 proxy) that is cut ends cleanly for httpx, inside
    a line: that is a dropped connection (resumed from the cursor), not a malformed answer
    (which would kill a running command). Here the streamed start is cut after the command id
    and one event's first half; the run resumes with GET events?after=0 and nothing is killed."""
    from k8s_agent_sandbox_awx.errors import BrokerUnavailableError

    decoder = NdjsonDecoder("follow events")
    assert decoder.feed(b'{"seq": 1}\n{"se') == [{"seq": 1}]
    with pytest.raises(BrokerUnavailableError, match="inside a line"):
        decoder.end()
    decoder.feed(b"<html><body>Sign in</body></html>")  # not a cut event: malformed
    with pytest.raises(BrokerProtocolError, match="not JSON"):
        decoder.end()
    cut = b'{"command_id":"c1"}\n{"type":"stdout","seq":1,"da'
    ndjson = {"Content-Type": "application/x-ndjson"}
    result, seen = run_echo_hi(httpx.Response(200, headers=ndjson, content=cut))
    assert (result.stdout, result.exit_code) == ("hi\n", 0)
    assert seen == ["POST /commands", "GET /commands/c1/events"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/problem+json"])
def test_a_start_answer_not_labelled_ndjson_is_one_json_value(content_type: str | None) -> None:
    """Only an answer labelled ``application/x-ndjson`` is the streamed start; any other
    answer to the start is read whole as one JSON value, as the plain start always read it
    (here pretty-printed, over several lines): the run goes on with GET events instead of
    failing with the command started and its id unknown."""
    headers = {"Content-Type": content_type} if content_type else {}
    pretty = b'{\n  "command_id": "c1"\n}\n'
    result, seen = run_echo_hi(httpx.Response(200, headers=headers, content=pretty))
    assert (result.stdout, result.exit_code) == ("hi\n", 0)
    assert seen == ["POST /commands", "GET /commands/c1/events"]
