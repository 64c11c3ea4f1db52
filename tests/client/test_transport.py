"""Transport rules with httpx.MockTransport: auth, 401 refresh, retries, redirects, timeouts."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import (
    BrokerAuthenticationError,
    BrokerError,
    BrokerRedirectError,
    BrokerUnavailableError,
    RequestTimeoutError,
)
from k8s_agent_sandbox_awx.client.wire import _protocol as proto


def test_token_is_fetched_for_the_broker_on_every_request(
    make_client: Any, fake: Any, creds: Any, kit: Any
) -> None:
    client = make_client()
    client.list_sandboxes()
    client.list_sandboxes()
    assert creds.calls == [kit.BROKER, kit.BROKER]
    assert all(r.headers["Authorization"] == f"Bearer {kit.TOKEN}" for r in fake.requests)


def test_healthz_sends_no_token(make_client: Any, fake: Any, kit: Any) -> None:
    fake.route("GET", "/v1/healthz")(lambda r: httpx.Response(200, json={"status": "ok"}))
    make_client().healthz()
    assert "Authorization" not in fake.requests[0].headers


def test_401_invalidates_and_retries_once(make_client: Any, fake: Any, kit: Any) -> None:
    creds = kit.StubCredentials("old-token", "new-token")
    client = make_client()
    client._transport.auth = creds

    @fake.route("GET", "/v1/whoami")
    def whoami(request: httpx.Request) -> httpx.Response:
        if request.headers["Authorization"] == "Bearer old-token":
            return kit.error(401, "token_expired", "expired")
        return httpx.Response(200, json={"subject": "me"})

    assert client.whoami() == {"subject": "me"}
    assert creds.invalidated == [kit.BROKER]
    assert len(fake.requests) == 2


@pytest.mark.parametrize(
    "mark",
    [None, "token_revoked", "TOKEN_EXPIRED", ""],
    ids=["no mark", "mark with another code", "mark not a documented code", "empty mark"],
)
def test_401_without_the_brokers_mark_is_never_replayed(
    make_client: Any, fake: Any, kit: Any, mark: str | None
) -> None:
    """Only the broker's own mark (set on its error answers, stripped from forwarded ones)
    makes a 401 a token rejection: a body alone can be imitated by a sandbox runtime."""
    creds = kit.StubCredentials("old-token", "new-token")
    client = make_client()
    client._transport.auth = creds
    headers = {} if mark is None else {"Agent-Sandbox-Broker-Error": mark}
    fake.route("GET", "/v1/whoami")(
        lambda r: httpx.Response(
            401, json={"detail": "expired", "code": "token_expired"}, headers=headers
        )
    )
    with pytest.raises(BrokerError):
        client.whoami()
    assert len(fake.requests) == 1 and creds.invalidated == []


def test_second_401_raises_with_the_brokers_reason(
    make_client: Any, fake: Any, creds: Any, kit: Any, caplog: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    fake.route("GET", "/v1/whoami")(lambda r: kit.error(401, "audience_mismatch", "bad aud"))
    with pytest.raises(BrokerAuthenticationError) as info:
        make_client().whoami()
    assert info.value.code == "audience_mismatch"
    assert "re-read" in str(info.value)
    assert len(fake.requests) == 2 and len(creds.invalidated) == 1
    assert kit.TOKEN not in str(info.value) and kit.TOKEN not in repr(info.value.__dict__)
    assert kit.TOKEN not in caplog.text


def test_the_client_keeps_no_cookies(make_client: Any, fake: Any) -> None:
    """A Set-Cookie (a sandbox's, passed through the broker) is never stored and sent back."""
    fake.route("GET", "/v1/whoami")(
        lambda r: httpx.Response(
            200, json={"subject": "me"}, headers={"Set-Cookie": "session=sandbox; Path=/"}
        )
    )
    client = make_client()
    client.whoami()
    client.whoami()
    assert [r.headers.get("Cookie") for r in fake.requests] == [None, None]


def test_no_cookie_work_per_answer_and_none_set_by_hand_is_sent(
    make_client: Any, fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """httpx hands every answer to its client's cookies (a urllib request built of it, each
    header copied, ~25 µs per call): the client's cookies skip that, and a cookie set on the
    client by hand is neither kept nor sent."""

    def parsed(self: httpx.Cookies, response: httpx.Response) -> None:
        raise AssertionError("an answer was handed to httpx's cookie jar")

    monkeypatch.setattr(httpx.Cookies, "extract_cookies", parsed)
    fake.route("GET", "/v1/whoami")(
        lambda r: httpx.Response(200, json={"subject": "me"}, headers={"Set-Cookie": "a=b"})
    )
    client = make_client()
    client.whoami()
    http = client._transport._http.client
    http.cookies.set("session", "by-hand")
    http.cookies = {"other": "x"}
    client.whoami()
    assert [r.headers.get("Cookie") for r in fake.requests] == [None, None]
    assert not http.cookies


def test_the_async_client_does_no_cookie_work_per_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    from k8s_agent_sandbox_awx.client.http._client_settings import CookielessAsyncClient

    def parsed(self: httpx.Cookies, response: httpx.Response) -> None:
        raise AssertionError("an answer was handed to httpx's cookie jar")

    monkeypatch.setattr(httpx.Cookies, "extract_cookies", parsed)
    answer = httpx.Response(200, headers={"Set-Cookie": "a=b"})

    async def main() -> tuple[httpx.Request, bool]:
        async with CookielessAsyncClient(transport=httpx.MockTransport(lambda r: answer)) as http:
            http.cookies.set("session", "by-hand")
            sent = (await http.get("http://broker.test/")).request
            return sent, bool(http.cookies)

    sent, kept = asyncio.run(main())
    assert "Cookie" not in sent.headers and not kept


@pytest.mark.parametrize(
    ("method", "path", "params", "headers", "content"),
    [
        ("GET", "/v1/sandboxes", None, {}, None),
        ("GET", "/commands/c1/events", {"after": "3"}, {"X-Sandbox-ID": "s"}, None),
        ("POST", "/commands", None, {"Accept": "application/x-ndjson", "user-agent": "x"}, b"{}"),
        ("DELETE", "/v1/sandboxes/s?x=1", {"y": "2"}, {"ACCEPT": "a", "Accept": "b"}, None),
        ("PUT", "/files/a%20b", None, {"Content-Type": "application/octet-stream"}, b"\x00"),
        ("POST", "/v1/sandboxes/s/extend", None, {}, None),
        ("PATCH", "/x", None, {"X-Sandbox-ID": "s"}, b""),
        ("POST", "/commands", None, {"content-length": "2", "HOST": "h.test"}, b"{}"),
        ("PUT", "/files/f", None, {"Transfer-Encoding": "chunked"}, None),
        ("POST", "/files/f", None, {"Transfer-Encoding": "chunked"}, b"ab"),
        ("GET", "/v1/healthz", None, {"x-extra": "mine"}, b""),
    ],
)
def test_a_pool_client_builds_the_request_httpx_would(
    method: str, path: str, params: Any, headers: dict[str, str], content: bytes | None
) -> None:
    from k8s_agent_sandbox_awx.client.http._client_settings import (
        CookielessAsyncClient,
        CookielessClient,
        build_request,
    )

    timeout = httpx.Timeout(30.0, read=35.0)
    url = "https://broker.test:8443" + path
    for client in (
        CookielessClient(headers={"User-Agent": "ua", "X-Extra": "e"}),
        CookielessClient(headers=[("X-Twice", "1"), ("x-twice", "2")]),
        CookielessAsyncClient(headers={"Host": "default.test", "Content-Length": "9"}),
        CookielessAsyncClient(headers={"User-Agent": "ua"}),
    ):
        built = build_request(
            client, method, url, params=params, headers=headers, content=content, timeout=timeout
        )
        expected = client.build_request(
            method, url, params=params, headers=headers, content=content, timeout=timeout
        )
        assert (built.method, built.url, built.headers.raw, built.extensions) == (
            expected.method,
            expected.url,
            expected.headers.raw,
            expected.extensions,
        )
        assert built.content == expected.content
        assert list(built.stream) == list(expected.stream)  # type: ignore[arg-type]


def test_a_pool_client_request_follows_its_client_headers_as_they_change() -> None:
    # the normalised headers are kept per kind of request: never those of the client's headers
    # before they changed, nor another request's Content-Length
    from k8s_agent_sandbox_awx.client.http._client_settings import (
        CookielessAsyncClient,
        build_request,
    )

    client = CookielessAsyncClient(headers={"User-Agent": "ua"})
    timeout = httpx.Timeout(5.0)

    def both(headers: dict[str, str], content: bytes | None) -> tuple[Any, Any]:
        url = "https://broker.test/commands"
        built = build_request(
            client, "POST", url, params=None, headers=headers, content=content, timeout=timeout
        )
        expected = client.build_request(
            "POST", url, headers=headers, content=content, timeout=timeout
        )
        return built.headers.raw, expected.headers.raw

    for content in (b"{}", b"{}", b"[1,2]", None, b"{}"):
        built, expected = both({"X-Sandbox-ID": "s"}, content)
        assert built == expected
    client.headers["User-Agent"] = "changed"
    client.headers["X-New"] = "n"
    built, expected = both({"X-Sandbox-ID": "s"}, b"{}")
    assert built == expected and (b"X-New", b"n") in built
    client.headers = {"Only": "this"}  # type: ignore[assignment]
    assert both({}, b"{}")[0] == both({}, b"{}")[1]


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (200, {"Content-Type": "application/json"}),
        (307, {"Location": "https://other.example/v1/x"}),
        (302, {"Location": "/v1/elsewhere"}),
        (404, {}),
    ],
)
def test_a_pool_client_sends_streamed_as_httpx_send_does(
    status: int, headers: dict[str, str]
) -> None:
    # send_streamed skips httpx's auth and redirect layers, which the pool's clients do not use:
    # the answer is the one send(request, stream=True) gives (a redirect's next_request too)
    from k8s_agent_sandbox_awx.client.http._client_settings import CookielessAsyncClient

    class Body(httpx.AsyncByteStream):  # read from the transport, as a network answer is
        async def __aiter__(self) -> Any:
            yield b'{"a": 1}'

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers=headers, stream=Body())

    async def both(http: CookielessAsyncClient) -> list[Any]:
        seen = []
        for send in (http.send_streamed, lambda r: http.send(r, stream=True)):
            request = http.build_request("GET", "https://broker.test/v1/x", timeout=5.0)
            response = await send(request)
            body = await response.aread()
            await response.aclose()
            following = response.next_request
            seen.append(
                (
                    response.status_code,
                    response.headers.raw,
                    body,
                    response.request is request,
                    response.history,
                    response.elapsed.total_seconds() >= 0,
                    None if following is None else (following.method, str(following.url)),
                )
            )
        return seen

    async def main() -> None:
        async with CookielessAsyncClient(transport=httpx.MockTransport(answer)) as http:
            direct, through_send = await both(http)
            assert direct == through_send
            assert (direct[-1] is None) == (status not in (302, 307))

    asyncio.run(main())


def test_send_streamed_goes_through_send_when_the_client_has_what_send_does() -> None:
    from k8s_agent_sandbox_awx.client.http._client_settings import CookielessAsyncClient

    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) % 2:
            return httpx.Response(307, headers={"Location": "/next"})
        return httpx.Response(200)

    hooked: list[str] = []

    async def hook(request: httpx.Request) -> None:
        hooked.append(request.url.path)

    async def main() -> None:
        transport = httpx.MockTransport(answer)
        async with CookielessAsyncClient(transport=transport, auth=("u", "p")) as http:
            await http.send_streamed(http.build_request("GET", "https://b.test/a"))
            assert seen[-1].headers["Authorization"].startswith("Basic ")
        async with CookielessAsyncClient(transport=transport) as http:
            await http.send_streamed(http.build_request("GET", "https://u:p@b.test/a"))
            assert seen[-1].headers["Authorization"].startswith("Basic ")
        async with CookielessAsyncClient(transport=transport, follow_redirects=True) as http:
            followed = await http.send_streamed(http.build_request("GET", "https://b.test/a"))
            assert followed.status_code == 200 and len(followed.history) == 1
        hooks = {"request": [hook]}
        async with CookielessAsyncClient(transport=transport, event_hooks=hooks) as http:
            await http.send_streamed(http.build_request("GET", "https://b.test/h"))
            assert hooked == ["/h"]
        http = CookielessAsyncClient(transport=transport)
        await http.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            await http.send_streamed(http.build_request("GET", "https://b.test/a"))

    asyncio.run(main())


def test_redirect_is_not_followed(make_client: Any, fake: Any) -> None:
    fake.route("GET", "/v1/sandboxes")(
        lambda r: httpx.Response(307, headers={"Location": "https://other.example/v1/sandboxes"})
    )
    with pytest.raises(BrokerRedirectError, match="never followed"):
        make_client().list_sandboxes()
    assert len(fake.requests) == 1


def test_token_is_never_sent_to_another_origin(make_client: Any, creds: Any) -> None:
    spec = proto.RequestSpec("GET", "@other.example/", "probe")  # would become userinfo
    with pytest.raises(BrokerError, match="Refusing"):
        make_client()._transport.send(spec)
    assert creds.calls == []


def test_get_is_retried_on_503_and_connect_errors(make_client: Any, fake: Any) -> None:
    answers = iter(
        [
            httpx.ConnectError("refused"),
            httpx.Response(
                503, json={"detail": "x", "code": "unavailable"}, headers={"Retry-After": "0"}
            ),
            httpx.Response(200, json={"items": []}),
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    fake.route("GET", "/v1/sandboxes")(handler)
    assert make_client().list_sandboxes() == []
    assert len(fake.requests) == 3


def test_retries_are_bounded(make_client: Any, fake: Any, kit: Any) -> None:
    fake.route("GET", "/v1/sandboxes")(lambda r: kit.error(502, "sandbox_unreachable", "down"))
    with pytest.raises(BrokerUnavailableError):
        make_client(max_attempts=3).list_sandboxes()
    assert len(fake.requests) == 3


def test_execute_is_never_retried(make_client: Any, fake: Any, kit: Any) -> None:
    client = make_client()
    sandbox = client.create_sandbox()
    before = len(fake.requests)
    fake.route("POST", "/execute")(
        lambda r: kit.error(503, "unavailable", "busy", **{"Retry-After": "0"})
    )
    with pytest.raises(BrokerUnavailableError):
        sandbox.commands.run("echo hi")
    # POST /commands: 404 without a code (a runtime without managed commands), then /execute once
    assert [r.url.path for r in fake.requests[before:]] == ["/commands", "/execute"]
    before += 1

    def drop(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("connection dropped")

    fake.route("POST", "/execute")(drop)
    with pytest.raises(BrokerUnavailableError, match="not idempotent"):
        sandbox.commands.run("echo hi")
    assert len(fake.requests) == before + 2


def test_create_retries_reuse_the_idempotency_key(make_client: Any, fake: Any, kit: Any) -> None:
    first = [True]

    @fake.route("POST", "/v1/sandboxes")
    def create(request: httpx.Request) -> httpx.Response:
        if first[0]:
            first[0] = False
            return kit.error(503, "unavailable", "busy", **{"Retry-After": "0"})
        fake.sandboxes["sbx-1"] = kit.sandbox_obj("sbx-1")
        return httpx.Response(201, json=fake.sandboxes["sbx-1"])

    make_client().create_sandbox()
    keys = [r.headers["Idempotency-Key"] for r in fake.requests if r.method == "POST"]
    assert len(keys) == 2 and keys[0] == keys[1] and len(keys[0]) >= 32


def test_upload_retry_depends_on_replayable_body(make_client: Any, fake: Any, kit: Any) -> None:
    client = make_client()
    sandbox = client.create_sandbox()
    calls: list[bytes] = []

    @fake.route("POST", "/upload")
    def upload(request: httpx.Request) -> httpx.Response:
        calls.append(request.content)
        if len(calls) % 2:
            return kit.error(503, "unavailable", "busy", **{"Retry-After": "0"})
        return httpx.Response(200, json={"path": "x", "size": 3})

    source = io.BytesIO(b"xxabc")
    source.seek(2)
    sandbox.files.write("a/b.txt", source)  # seekable: rewound to position 2 and re-sent
    assert len(calls) == 2 and calls[0] == calls[1] and b"\r\n\r\nabc\r\n--" in calls[1]
    assert b'filename="a/b.txt"' in calls[1]

    class Pipe(io.RawIOBase):
        def __init__(self) -> None:
            self.data = [b"abc"]

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            return self.data.pop() if self.data else b""

    with pytest.raises(BrokerUnavailableError):
        sandbox.files.write("c.txt", Pipe())  # type: ignore[arg-type]
    assert len(calls) == 3
    assert "chunked" in fake.requests[-1].headers.get("Transfer-Encoding", "")


def test_request_timeout_is_named(make_client: Any, fake: Any) -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow")

    fake.route("GET", "/v1/whoami")(slow)
    with pytest.raises(RequestTimeoutError, match="request_timeout"):
        make_client(request_timeout=2).whoami()


def test_401_on_a_consumed_upload_stream_is_not_resent(
    make_client: Any, fake: Any, creds: Any, kit: Any
) -> None:
    sandbox = make_client().create_sandbox()
    fake.route("POST", "/upload")(lambda r: kit.error(401, "token_expired", "expired"))

    class Pipe(io.RawIOBase):
        def __init__(self) -> None:
            self.data = [b"abc"]

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            return self.data.pop() if self.data else b""

    sandbox.files._api.has_fs = False  # a legacy runtime (known): no probe request
    before = len(fake.requests)
    with pytest.raises(BrokerAuthenticationError):
        sandbox.files.write("x.bin", Pipe())  # type: ignore[arg-type]
    assert len(fake.requests) == before + 1
    assert creds.invalidated == [kit.BROKER]  # the next request re-reads the credential


def test_template_from_the_environment(make_client: Any, fake: Any) -> None:
    make_client(template="go").create_sandbox()
    make_client(template="go").create_sandbox(template="python")
    creates = [
        json.loads(b) for r, b in zip(fake.requests, fake.bodies, strict=True) if r.method == "POST"
    ]
    assert creates == [
        {"template": "go", "lifetime_seconds": 300},  # the default timeout
        {"template": "python", "lifetime_seconds": 300},
    ]
