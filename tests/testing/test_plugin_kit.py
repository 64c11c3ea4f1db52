"""The plugin authors' testing utilities: ScriptedEndpoint, unsigned_jwt, call_concurrently."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from k8s_agent_sandbox_awx import (
    Credential,
    CredentialRequest,
    CredentialSourceError,
    DefaultCredentials,
    clear_credential_cache,
    hookimpl,
    testing,
)
from k8s_agent_sandbox_awx.testing import (
    SDK_VARIABLES,
    RecordedRequest,
    Reply,
    ScriptedEndpoint,
    call_concurrently,
    check_cached_then_refreshed,
    check_entry_point,
    unsigned_jwt,
    unverified_claims,
)

SRC = Path(testing.__file__).resolve().parent.parent


@pytest.fixture
def endpoint() -> Iterator[ScriptedEndpoint]:
    with ScriptedEndpoint() as server:
        yield server


def get(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(url, headers=headers, timeout=5.0)


# --- ScriptedEndpoint ------------------------------------------------------------------------


def test_binds_loopback_and_answers_404_when_nothing_is_scripted(
    endpoint: ScriptedEndpoint,
) -> None:
    assert endpoint.origin == f"http://127.0.0.1:{endpoint.port}"
    assert endpoint.host == f"127.0.0.1:{endpoint.port}"
    assert endpoint.url("/a?b=1") == f"{endpoint.origin}/a?b=1"
    assert endpoint.url("a") == f"{endpoint.origin}/a"
    response = get(endpoint.url("/nothing"))
    assert (response.status_code, response.content) == (404, b"{}")


def test_queued_replies_answer_in_order_then_the_responder(endpoint: ScriptedEndpoint) -> None:
    first = endpoint.add(b"one")
    assert isinstance(first, Reply)
    endpoint.add("two", status=201)
    endpoint.responder = lambda seen: endpoint.reply(f"auto {seen.url_path}", status=202)
    assert endpoint.pending == 2
    answers = [get(endpoint.url(f"/p{i}")) for i in range(3)]
    assert [(r.status_code, r.content) for r in answers] == [
        (200, b"one"),
        (201, b"two"),
        (202, b"auto /p2"),
    ]
    assert endpoint.pending == 0


def test_records_method_path_query_headers_body_and_time(endpoint: ScriptedEndpoint) -> None:
    before = time.time()
    endpoint.add()
    endpoint.add()
    get(endpoint.url("/idtoken?api-version=2.0&audience=https%3A%2F%2Fb"), headers={"X-A": "1"})
    httpx.post(endpoint.url("/token"), content=b"grant=x", timeout=5.0)
    first, second = endpoint.requests
    assert isinstance(first, RecordedRequest)
    assert (first.method, first.url_path, first.body) == ("GET", "/idtoken", b"")
    assert first.path == "/idtoken?api-version=2.0&audience=https%3A%2F%2Fb"
    assert first.query == {"api-version": ["2.0"], "audience": ["https://b"]}
    assert first.headers["X-A"] == "1"
    assert before <= first.at <= second.at <= time.time()
    assert (second.method, second.body) == ("POST", b"grant=x")


def test_requests_is_a_snapshot(endpoint: ScriptedEndpoint) -> None:
    snapshot = endpoint.requests
    get(endpoint.origin)
    assert snapshot == []
    assert len(endpoint.requests) == 1


def test_default_headers_apply_unless_a_reply_gives_its_own() -> None:
    with ScriptedEndpoint(default_headers={"Metadata-Flavor": "Google"}) as endpoint:
        endpoint.add(b"a")
        endpoint.add(b"b", headers={})
        endpoint.add(b"c", status=302, headers={"Location": "/elsewhere"})
        first = get(endpoint.origin)
        second = get(endpoint.origin)
        third = get(endpoint.origin)
    assert first.headers["Metadata-Flavor"] == "Google"
    assert "Metadata-Flavor" not in second.headers
    assert third.status_code == 302 and "Metadata-Flavor" not in third.headers
    assert third.headers["Location"] == "/elsewhere"
    assert len(endpoint.requests) == 3  # redirects are not followed by httpx.get


def test_delay_lets_a_client_time_out(endpoint: ScriptedEndpoint) -> None:
    endpoint.add(b"late", delay=1.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(endpoint.origin, timeout=httpx.Timeout(5.0, read=0.2))
    assert len(endpoint.requests) == 1


def test_drop_closes_the_connection_without_an_answer(endpoint: ScriptedEndpoint) -> None:
    endpoint.add(drop=True)
    with pytest.raises(httpx.RemoteProtocolError):
        get(endpoint.origin)
    assert get(endpoint.origin).status_code == 404  # the endpoint keeps serving


def test_a_failing_responder_is_a_500_and_is_kept(endpoint: ScriptedEndpoint) -> None:
    def broken(seen: RecordedRequest) -> Reply:
        raise KeyError("audience")

    endpoint.responder = broken
    response = get(endpoint.origin)
    assert response.status_code == 500
    assert b"KeyError" in response.content
    [error] = endpoint.errors
    assert isinstance(error, KeyError)


def test_serves_concurrent_requests(endpoint: ScriptedEndpoint) -> None:
    endpoint.responder = lambda seen: endpoint.reply(b"ok", delay=0.2)
    with httpx.Client(timeout=5.0) as client:
        statuses = call_concurrently(lambda: client.get(endpoint.origin).status_code, 8)
    assert statuses == [200] * 8
    assert len(endpoint.requests) == 8


def test_close_releases_the_port_and_is_idempotent() -> None:
    endpoint = ScriptedEndpoint()
    origin = endpoint.origin
    assert "requests=0" in repr(endpoint)
    endpoint.close()
    endpoint.close()
    with pytest.raises(httpx.ConnectError):
        get(origin)


# --- tokens ----------------------------------------------------------------------------------


def test_unsigned_jwt_round_trips_through_unverified_claims() -> None:
    before = int(time.time())
    token = unsigned_jwt({"aud": "https://b.example", "sub": "me", "exp": before + 42})
    assert re.fullmatch(r"[\w-]+\.[\w-]+\.[\w-]+", token)
    claims = unverified_claims(token)
    assert claims["aud"] == "https://b.example" and claims["sub"] == "me"
    assert claims["exp"] == before + 42  # claims override the defaults
    default = unverified_claims(unsigned_jwt(ttl=60))
    assert before <= default["iat"] <= int(time.time())
    assert default["exp"] - default["iat"] == 60


def test_unsigned_jwt_passes_the_sdk_checks_only_with_the_right_audience() -> None:
    from k8s_agent_sandbox_awx import AudienceMismatchError, OIDCTokenAuth, TokenExpiredError

    broker = "https://sandbox-broker.example"
    token = unsigned_jwt({"aud": broker})
    assert OIDCTokenAuth(token).get_credential(broker).token == token
    with pytest.raises(AudienceMismatchError):
        OIDCTokenAuth(unsigned_jwt({"aud": "https://other.example"})).get_credential(broker)
    with pytest.raises(TokenExpiredError):
        OIDCTokenAuth(unsigned_jwt({"aud": broker}, ttl=-600)).get_credential(broker)


@pytest.mark.parametrize(
    ("token", "expect"),
    [
        ("secret-opaque-token", "3 dot-separated parts, got 1"),
        ("a.secret!!.c", "not base64url-encoded JSON"),
        (f"a.{unsigned_jwt().split('.')[0][:4]}.c", "not base64url-encoded JSON"),
        ("a.WzEsMl0.c", "JSON list, not an object"),
    ],
)
def test_unverified_claims_errors_never_contain_the_token(token: str, expect: str) -> None:
    with pytest.raises(ValueError, match=expect) as info:
        unverified_claims(token)
    assert token not in str(info.value)
    assert "secret" not in str(info.value)


# --- call_concurrently -----------------------------------------------------------------------


def test_call_concurrently_releases_all_callers_together() -> None:
    peak = {"now": 0, "max": 0}
    lock = threading.Lock()

    def call() -> int:
        with lock:
            peak["now"] += 1
            peak["max"] = max(peak["max"], peak["now"])
        time.sleep(0.1)
        with lock:
            peak["now"] -= 1
        return 7

    assert call_concurrently(call, 6) == [7] * 6
    assert peak["max"] > 1


def test_call_concurrently_reraises_the_first_error_after_all_finished() -> None:
    finished: list[int] = []
    counter = iter(range(100))
    lock = threading.Lock()

    def call() -> int:
        with lock:
            n = next(counter)
        if n == 0:
            raise LookupError("first")
        time.sleep(0.05)
        finished.append(n)
        return n

    with pytest.raises(LookupError, match="first"):
        call_concurrently(call, 4)
    assert len(finished) == 3


def test_call_concurrently_times_out_with_a_count() -> None:
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError, match=r"2 of 2 concurrent calls of '<lambda>' .* 0\.2s"):
            call_concurrently(lambda: release.wait(5), 2, timeout=0.2)
    finally:
        release.set()
    with pytest.raises(ValueError, match="at least 1"):
        call_concurrently(lambda: None, 0)


# --- SDK_VARIABLES and the package surface ---------------------------------------------------


def test_sdk_variables_name_every_variable_the_sdk_reads() -> None:
    read: set[str] = set()
    for path in SRC.rglob("*.py"):  # the SDK itself, not the local broker stack
        if path.relative_to(SRC).parts[0] in ("broker", "testing"):
            continue
        read.update(re.findall(r"\"(AGENT_SANDBOX_[A-Z_]+)\"", path.read_text()))
    assert read, "found no AGENT_SANDBOX_* literal: the scan is broken"
    assert read <= set(SDK_VARIABLES)


def test_plugin_helpers_load_without_the_local_broker_stack() -> None:
    """Every plugin-testing name is exported lazily and needs nothing from the [local] extra."""
    names = [
        *("ScriptedEndpoint", "Reply", "RecordedRequest", "unsigned_jwt", "unverified_claims"),
        *("call_concurrently", "check_cached_then_refreshed", "check_entry_point", "SDK_VARIABLES"),
    ]
    heavy = ["uvicorn", "starlette", "jwt", "cryptography", "trustme", "httpx"]
    script = "\n".join(
        [
            "import json, sys",
            f"from k8s_agent_sandbox_awx.testing import {', '.join(names)}",
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout) == []
    assert set(names) <= set(testing.__all__) and set(names) <= set(dir(testing))


# --- check_cached_then_refreshed, with a provider as docs/writing-plugins.md writes one ------

BROKER = "https://sandbox-broker.example"


class AcmeProvider:
    """The docs' example provider: GET ACME_OIDC_URL?audience=... answers {"token": "..."}."""

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential | None:
        url = request.environ.get("ACME_OIDC_URL")
        if url is None:
            return request.not_here("ACME_OIDC_URL is not set (not an Acme CI job)")
        response = httpx.get(
            url,
            params={"audience": request.audience},
            headers={"Authorization": f"Bearer {request.environ['ACME_OIDC_REQUEST_TOKEN']}"},
            timeout=request.timeout,
            follow_redirects=False,
        )
        if response.status_code != 200:
            raise CredentialSourceError(
                f"the Acme CI token endpoint answered HTTP {response.status_code}",
                provider="acme-ci",
                source=url,
            )
        return Credential(response.json()["token"], "acme-ci", source=url)


@pytest.fixture
def acme(endpoint: ScriptedEndpoint) -> Iterator[DefaultCredentials]:
    """The provider in a discovery chain; the endpoint mints a new 4-second token per request."""

    def mint(seen: RecordedRequest) -> Reply:
        [audience] = seen.query["audience"]
        claims = {"aud": audience, "sub": "job-1", "jti": f"n{len(endpoint.requests)}"}
        return endpoint.reply(json.dumps({"token": unsigned_jwt(claims, ttl=4)}))

    endpoint.responder = mint
    env = {
        "AGENT_SANDBOX_LOAD_PLUGINS": "",  # no installed plugin joins the chain
        "ACME_OIDC_URL": endpoint.url("/token"),
        "ACME_OIDC_REQUEST_TOKEN": "request-token",
    }
    clear_credential_cache()
    yield DefaultCredentials(env, _plugins=[("acme-ci", AcmeProvider())])
    clear_credential_cache()


def test_check_cached_then_refreshed_passes_for_a_cached_provider(
    acme: DefaultCredentials, endpoint: ScriptedEndpoint
) -> None:
    check_cached_then_refreshed(lambda: acme.get_credential(BROKER).token, endpoint, callers=8)
    assert len(endpoint.requests) == 2
    first = endpoint.requests[0]
    assert first.query == {"audience": [BROKER]}
    assert first.headers["Authorization"] == "Bearer request-token"
    assert unverified_claims(acme.get_credential(BROKER).token)["jti"] != "n1"
    assert endpoint.errors == []


def test_check_cached_then_refreshed_fails_without_a_cache(
    acme: DefaultCredentials, endpoint: ScriptedEndpoint
) -> None:
    def uncached() -> str:
        credential = AcmeProvider().agent_sandbox_get_credential(
            CredentialRequest(
                BROKER, {"ACME_OIDC_URL": endpoint.url("/t"), "ACME_OIDC_REQUEST_TOKEN": "r"}
            )
        )
        assert credential is not None
        return credential.token

    with pytest.raises(AssertionError, match=r"caused more than 1 fetch|got [0-9]+ tokens"):
        check_cached_then_refreshed(uncached, endpoint, callers=4)


def test_check_cached_then_refreshed_fails_without_a_refresh(endpoint: ScriptedEndpoint) -> None:
    token = unsigned_jwt({"aud": BROKER}, ttl=600)

    def once() -> str:
        if not endpoint.requests:
            httpx.get(endpoint.origin, timeout=5.0)
        return token

    with pytest.raises(AssertionError, match=r"expected one refresh fetch within 0\.3s"):
        check_cached_then_refreshed(once, endpoint, callers=1, timeout=0.3)


def test_check_cached_then_refreshed_fails_for_a_token_served_past_its_exp(
    endpoint: ScriptedEndpoint,
) -> None:
    """A cache that serves its token until a second after its ``exp`` before it fetches again:
    the check names the rule (asked at or after its exp, the old token came back)."""
    tokens = [unsigned_jwt({"aud": BROKER, "jti": f"n{i}"}, ttl=1) for i in range(2)]

    def stale() -> str:
        first_exp = unverified_claims(tokens[0])["exp"]
        if not endpoint.requests or (len(endpoint.requests) == 1 and time.time() > first_exp + 1):
            httpx.get(endpoint.origin, timeout=5.0)
        return tokens[len(endpoint.requests) - 1]

    with pytest.raises(AssertionError, match=r"returned the token after its exp"):
        check_cached_then_refreshed(stale, endpoint, callers=1, timeout=4.0)


def test_check_cached_then_refreshed_needs_an_unused_endpoint(endpoint: ScriptedEndpoint) -> None:
    httpx.get(endpoint.origin, timeout=5.0)
    with pytest.raises(AssertionError, match="asked before the check started"):
        check_cached_then_refreshed(lambda: "x", endpoint)


# --- check_entry_point -----------------------------------------------------------------------


class FakeEntryPoint:
    def __init__(self, name: str, value: str, dist: str | None) -> None:
        self.name, self.value = name, value
        self.dist = None if dist is None else type("Dist", (), {"name": dist})()

    def load(self) -> object:
        return importlib.import_module(self.value.partition(":")[0])


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> list[FakeEntryPoint]:
    found: list[FakeEntryPoint] = []

    def fake_entry_points(*, group: str) -> list[FakeEntryPoint]:
        assert group == "k8s_agent_sandbox_awx.providers"
        return list(found)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    return found


def test_check_entry_point_accepts_a_cheap_registered_plugin(
    installed: list[FakeEntryPoint],
) -> None:
    installed.append(FakeEntryPoint("acme-ci", "json", "acme-agent-sandbox"))
    installed.append(FakeEntryPoint("other", "csv", "other-dist"))
    assert check_entry_point("acme-ci", "json", distribution="acme-agent-sandbox") is json


@pytest.mark.parametrize(
    ("entries", "expect"),
    [
        ([], "expected one entry point 'acme-ci' .* found 0"),
        ([("acme-ci", "json", "a"), ("acme-ci", "json", "b")], "found 2"),
        ([("acme-ci", "csv", "acme-agent-sandbox")], "is 'csv', expected 'json'"),
        ([("acme-ci", "json", "someone-else")], "from distribution 'someone-else'"),
        ([("acme-ci", "json", None)], "from distribution None"),
    ],
)
def test_check_entry_point_refuses_a_wrong_registration(
    installed: list[FakeEntryPoint],
    entries: list[tuple[str, str, str | None]],
    expect: str,
) -> None:
    installed.extend(FakeEntryPoint(*entry) for entry in entries)
    with pytest.raises(AssertionError, match=expect):
        check_entry_point("acme-ci", "json", distribution="acme-agent-sandbox")


def test_check_entry_point_refuses_an_expensive_or_broken_import(
    installed: list[FakeEntryPoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "acme_heavy.py").write_text("import httpx\n")
    (tmp_path / "acme_broken.py").write_text("raise ImportError('needs the acme extra')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    installed.append(FakeEntryPoint("heavy", "acme_heavy", "acme"))
    installed.append(FakeEntryPoint("broken", "acme_broken:plugin", "acme"))
    with pytest.raises(AssertionError, match="importing acme_heavy loads httpx: import them"):
        check_entry_point("heavy", "acme_heavy", distribution="acme")
    assert (
        check_entry_point("heavy", "acme_heavy", distribution="acme", not_imported=()) is not None
    )
    with pytest.raises(ImportError, match="needs the acme extra"):
        check_entry_point("broken", "acme_broken:plugin", distribution="acme")
