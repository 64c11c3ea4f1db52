"""The I/O-free layers: the v1 dialect's requests, answers and error mapping, the data plane,
the retry policy."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from k8s_agent_sandbox_awx._upstream import (
    FileEntry,
    SandboxNotFoundError,
    SandboxRequestError,
    SandboxTemplateNotFoundError,
)
from k8s_agent_sandbox_awx.client.core import _retry as retry
from k8s_agent_sandbox_awx.client.wire import _commands_wire as cw
from k8s_agent_sandbox_awx.client.wire import _dialect_v1 as v1
from k8s_agent_sandbox_awx.client.wire import _files_wire as files_wire
from k8s_agent_sandbox_awx.client.wire import _multipart as multipart
from k8s_agent_sandbox_awx.client.wire import _protocol as proto
from k8s_agent_sandbox_awx.errors import (
    BrokerAuthenticationError,
    BrokerNotFoundError,
    BrokerPermissionError,
    BrokerProtocolError,
    BrokerQuotaError,
    BrokerRedirectError,
    BrokerUnavailableError,
)

pytestmark = pytest.mark.upstream  # answers mapped to upstream's exceptions

ROUTER = proto.RouterTarget("sbx-1", "team-a", 8888)


def test_create_request() -> None:
    spec = v1.create(idempotency_key="k1", template="python", labels={"team": "ml"})
    assert (spec.method, spec.path, spec.retryable) == ("POST", "/v1/sandboxes", True)
    assert spec.headers["Idempotency-Key"] == "k1"
    assert json.loads(spec.content or b"") == {"template": "python", "labels": {"team": "ml"}}


def test_create_rejects_reserved_metadata() -> None:
    with pytest.raises(ValueError, match="reserved"):
        v1.create(idempotency_key="k", labels={"broker.agent-sandbox-awx.io/x": "y"})


def test_wait_request_is_a_bounded_long_poll() -> None:
    spec = v1.get("sbx-1", wait_ready=500, request_timeout=10)
    assert spec.params == {"wait": "ready", "timeout": "60"}
    assert spec.read_timeout == 70


def test_execute_is_never_retryable_and_carries_timeouts() -> None:
    spec = cw.execute(ROUTER, "echo hi", command_timeout=30)
    assert not spec.retryable
    assert spec.headers["X-Sandbox-ID"] == "sbx-1"
    assert spec.headers["X-Sandbox-Namespace"] == "team-a"
    assert spec.headers["X-Sandbox-Port"] == "8888"
    assert float(spec.headers["X-Sandbox-Timeout"]) >= 30
    assert json.loads(spec.content or b"") == {"command": "echo hi", "timeout_seconds": 30}
    assert (spec.read_timeout or 0) > 30


def test_data_plane_paths_are_encoded() -> None:
    assert files_wire.download(ROUTER, "a b/c.txt").path == "/download/a%20b%2Fc.txt"
    assert files_wire.list_files(ROUTER, ".").path == "/list/."


@pytest.mark.parametrize("bad", ["", "  ", "a/../b", "..", "a\x00b", "a\nb", "/"])
def test_path_validation(bad: str) -> None:
    with pytest.raises(ValueError):
        files_wire.validate_sandbox_path(bad)


def test_path_normalisation() -> None:
    assert files_wire.validate_sandbox_path("/data//in.csv") == "data/in.csv"
    assert files_wire.validate_sandbox_path("", allow_root=True) == "."


def test_multipart_framing() -> None:
    framing = multipart.multipart_framing('dir/"x".bin', boundary="b0")
    assert framing.prefix.startswith(b"--b0\r\n")
    assert b'filename="dir/\\"x\\".bin"' in framing.prefix
    assert framing.suffix == b"\r\n--b0--\r\n"
    assert framing.content_type == "multipart/form-data; boundary=b0"
    assert framing.length(10) == len(framing.prefix) + 10 + len(framing.suffix)


def test_parse_sandbox_and_list() -> None:
    obj = {"name": "s", "phase": "Ready", "namespace": "n", "router": {"port": 9000}}
    info = v1.parse_sandbox(obj)
    assert info.ready and info.router == proto.RouterTarget("s", "n", 9000)
    assert v1.parse_sandbox_list({"items": [obj]})[0].name == "s"
    with pytest.raises(BrokerProtocolError):
        v1.parse_sandbox({"phase": "Ready"})


def test_parse_results() -> None:
    result = cw.parse_execution_result({"stdout": "o", "stderr": "", "exit_code": 3})
    assert (result.stdout, result.exit_code, result.timed_out) == ("o", 3, False)
    entries = files_wire.parse_file_entries(
        [{"name": "a", "size": 1, "type": "file", "mod_time": 0.0}], "."
    )
    assert isinstance(entries[0], FileEntry)
    assert files_wire.parse_exists({"path": "a", "exists": True}, "a") is True
    with pytest.raises(BrokerProtocolError, match="not JSON"):
        proto.parse_json(b"<html>", "list my sandboxes")


def _err(status: int, code: str | None, data_plane: bool = False, **headers: str) -> Exception:
    body = json.dumps({"detail": "why", **({"code": code} if code else {})}).encode()
    spec = proto.RequestSpec("GET", "/v1/sandboxes/x", "get sandbox 'x'", data_plane=data_plane)
    return v1.error_from_response(status, headers, body, spec=spec)


def test_error_mapping_types() -> None:
    not_found = _err(404, "not_found")
    assert isinstance(not_found, BrokerNotFoundError)
    assert isinstance(not_found, SandboxNotFoundError)
    assert isinstance(not_found, SandboxRequestError)
    template = _err(404, "template_not_found")
    assert isinstance(template, SandboxTemplateNotFoundError)
    assert not isinstance(template, SandboxNotFoundError)
    auth = _err(401, "token_expired")
    assert isinstance(auth, BrokerAuthenticationError)
    assert auth.code == "token_expired" and auth.status_code == 401 and auth.detail == "why"
    assert "doctor" in str(auth)
    assert isinstance(_err(403, "not_owner"), BrokerPermissionError)
    quota = _err(429, "quota_exceeded")
    assert isinstance(quota, BrokerQuotaError) and "kill" in str(quota)
    assert isinstance(_err(503, "unavailable", **{"retry-after": "2"}), BrokerUnavailableError)
    runtime = _err(404, None, data_plane=True)
    assert not isinstance(runtime, SandboxNotFoundError)
    assert "does not exist in the sandbox" in str(runtime)
    redirect = _err(302, None, location="https://evil.example/")
    assert isinstance(redirect, BrokerRedirectError)
    assert redirect.location == "https://evil.example/"  # type: ignore[attr-defined]
    assert "never followed" in str(redirect)


def test_retry_after_parsing() -> None:
    now = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
    assert retry.parse_retry_after("3", now) == 3.0
    assert retry.parse_retry_after("Sun, 29 Nov 2026 12:00:05 GMT", now) == 5.0
    assert retry.parse_retry_after("garbage", now) is None
    assert retry.parse_retry_after(None, now) is None


def test_retry_decisions() -> None:
    policy = retry.RetryPolicy(max_attempts=3, backoff_base=1, backoff_max=4, rand=lambda a, b: b)
    get = v1.get("x")
    execute = cw.execute(ROUTER, "true", command_timeout=5)
    assert policy.after_status(get, 1, 503, {}) == 1
    assert policy.after_status(get, 2, 502, {}) == 2
    assert policy.after_status(get, 3, 503, {}) is None  # bounded
    assert policy.after_status(get, 1, 503, {"retry-after": "100"}) == 4  # capped
    assert policy.after_status(get, 1, 429, {}) is None  # quota: no Retry-After
    assert policy.after_status(get, 1, 429, {"retry-after": "1"}) == 1
    assert policy.after_status(get, 1, 500, {}) is None
    assert policy.after_status(execute, 1, 503, {"retry-after": "1"}) is None
    assert policy.after_transport_error(execute, 1, request_sent=False) is None
    assert policy.after_transport_error(get, 1, request_sent=True) == 1
    assert policy.after_transport_error(get, 1, request_sent=False, permanent=True) is None
    assert policy.after_transport_error(get, 1, request_sent=True, timed_out=True) is None
    assert policy.after_transport_error(get, 1, request_sent=False, timed_out=True) == 1


@pytest.mark.parametrize(
    "obj",
    [
        {"name": "s", "phase": "Ready", "router": 7},
        {"name": "s", "phase": "Ready", "router": ["sbx"]},
        {"name": "s", "phase": "Ready", "labels": [1, 2]},
        {"name": "s", "phase": "Ready", "annotations": "x"},
        {"name": "s", "phase": "Ready", "owner": 5},
        {"name": "s", "phase": "Ready", "router": {"port": "http"}},
        {"name": "s", "phase": "Ready", "template": 5},
        {"name": "s", "phase": "Ready", "expires_at": ["soon"]},
        {"name": "s", "phase": "Ready", "namespace": {"a": 1}},
    ],
)
def test_parse_sandbox_wrong_shapes_are_protocol_errors(obj: dict[str, object]) -> None:
    """A malformed Sandbox object is a BrokerProtocolError naming the problem, never an
    AttributeError/TypeError from the parser."""
    with pytest.raises(BrokerProtocolError, match="broker API v1") as info:
        v1.parse_sandbox(obj, "get sandbox 's'")
    assert "get sandbox 's'" in str(info.value)
    with pytest.raises(BrokerProtocolError):
        v1.parse_sandbox_list({"items": [obj]})


def test_error_hints_fit_the_request() -> None:
    # a bad sandbox name on the control plane is not a file path problem
    spec = proto.RequestSpec("DELETE", "/v1/sandboxes/BAD", "delete sandbox 'BAD'")
    body = json.dumps({"detail": "sandbox name 'BAD' is not a DNS-1123 label"}).encode()
    bad_name = v1.error_from_response(400, {}, body[:-1] + b', "code": "invalid_path"}', spec=spec)
    assert "relative to the sandbox root" not in str(bad_name)
    assert "agent-sandbox-awx ls" in str(bad_name)
    data = proto.RequestSpec("GET", "/download/x", "read 'x'", data_plane=True)
    bad_path = v1.error_from_response(400, {}, b'{"code": "invalid_path"}', spec=data)
    assert "relative to the sandbox root" in str(bad_path)
    # a 403 without a known code is a permission problem, not something to retry later
    denied = _err(403, "some_new_code")
    assert isinstance(denied, BrokerPermissionError) and "Retry later" not in str(denied)
    assert "whoami" in str(denied)


@pytest.mark.parametrize("body", [{"attributes": [1]}, {"policy": "x"}, {"attributes": None}])
def test_whoami_wrong_shapes_are_protocol_errors(body: dict[str, object]) -> None:
    call = v1.V1Dialect().whoami()

    class Reply:
        status_code = 200
        headers: dict[str, str] = {}
        content = json.dumps({"subject": "s", "provider": "p", **body}).encode()

    if body == {"attributes": None}:  # null: no attributes
        assert call.parse(Reply())["subject"] == "s"
        return
    with pytest.raises(BrokerProtocolError, match="not a JSON object"):
        call.parse(Reply())


@pytest.mark.parametrize("limit", [float("inf"), float("nan"), 0, -1])
def test_execute_rejects_a_timeout_that_is_not_a_finite_positive_number(limit: float) -> None:
    """Never sent as 'inf'/'nan' (an X-Sandbox-Timeout the broker rejects, a JSON body with
    Infinity): the caller's own argument is named."""
    with pytest.raises(ValueError, match="command timeout must be a finite number of seconds"):
        cw.execute(ROUTER, "echo hi", command_timeout=limit)


@pytest.mark.parametrize("ready", [float("nan"), -1.0])
def test_create_rejects_a_ready_timeout_that_is_nan_or_negative(ready: float) -> None:
    """NaN would wait forever (no comparison with it is true), a negative one would create a
    sandbox only to delete it: both are refused before anything is sent."""
    from k8s_agent_sandbox_awx.client.core import _flow as flow
    from k8s_agent_sandbox_awx.client.http._config import BrokerConnectionConfig

    config = BrokerConnectionConfig(broker_url="https://broker.test")
    with pytest.raises(ValueError, match="sandbox_ready_timeout"):
        flow.plan_create(config, v1.V1Dialect(), flow.SandboxSpec(ready_timeout=ready))


def test_parse_output_truncated() -> None:
    """Absent (a runtime that never truncates) is False; only a JSON true is True."""
    base = {"stdout": "o", "stderr": "", "exit_code": 0}
    assert cw.parse_execution_result(base).output_truncated is False
    assert cw.parse_execution_result({**base, "output_truncated": True}).output_truncated
    assert not cw.parse_execution_result({**base, "output_truncated": "no"}).output_truncated


@pytest.mark.parametrize(("dialect", "field"), [("v1", "name"), ("rpc", "claim_name")])
def test_each_dialect_names_the_sandbox_of_an_unusable_create_answer(
    dialect: str, field: str
) -> None:
    """A create answer that does not parse still names the sandbox it made (to delete it):
    the dialect's field, a non-empty string in a JSON object; anything else names none."""
    from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect

    named = get_dialect(dialect)
    assert named.created_name(json.dumps({field: "sbx-1", "phase": 5}).encode()) == "sbx-1"
    for body in (b"not json", b"[]", json.dumps({field: ""}).encode(), b'{"other": "x"}'):
        assert named.created_name(body) is None, body


def test_scopes_are_checked_by_one_rule_before_the_dialect_and_by_it() -> None:
    """``scopes=`` is checked once, by one rule, before anything is sent (a str or an empty
    name refused, naming it); what passes is kept as the names given, also from an iterator
    (the check used to consume it and the create then asked for no scopes)."""
    from k8s_agent_sandbox_awx.client.core._flow import spec_from_create
    from k8s_agent_sandbox_awx.client.wire._dialect import CreateRequest
    from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect

    assert spec_from_create(None, None, {"scopes": iter(["commands"])}).scopes == ("commands",)
    for bad in ("commands", ["commands", ""], [1]):
        with pytest.raises(TypeError, match=r"scopes= must be a list of scope names"):
            spec_from_create(None, None, {"scopes": bad})  # type: ignore[typeddict-item]
        with pytest.raises(TypeError, match=r"scopes= must be a list of scope names"):
            get_dialect("rpc").create(CreateRequest("k", scopes=bad))  # type: ignore[arg-type]
    spec = get_dialect("rpc").create(CreateRequest("k", scopes=("commands",)))
    assert json.loads(spec.content or b"")["scopes"] == ["commands"]


def test_one_multipart_framing_and_one_length_rule_for_both_upload_endpoints() -> None:
    """``/fs/write`` (the ``path`` field, then the file) and the legacy ``/upload`` (the file
    named by its destination) are framed by one builder, and their headers (the type, the
    length of a sized body, chunked for one of unknown size) come from one place."""
    fs = multipart.multipart_framing("file", boundary="b0", fields={"path": "d/a.txt"})
    assert fs.prefix == (
        b'--b0\r\nContent-Disposition: form-data; name="path"\r\n\r\nd/a.txt\r\n'
        b'--b0\r\nContent-Disposition: form-data; name="file"; filename="file"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n"
    )
    legacy = multipart.multipart_framing("d/a.txt", boundary="b1")
    assert (
        legacy.prefix.count(b"Content-Disposition") == 1 and b'filename="d/a.txt"' in legacy.prefix
    )
    for framing in (fs, legacy):
        assert framing.headers(3) == {
            "Content-Type": framing.content_type,
            "Content-Length": str(len(framing.prefix) + 3 + len(framing.suffix)),
        }
        assert framing.headers(None) == {
            "Content-Type": framing.content_type,
            "Transfer-Encoding": "chunked",
        }


def test_an_idempotency_key_is_a_random_uuid4_as_text() -> None:
    import uuid

    keys = {proto.new_idempotency_key() for _ in range(20000)}
    assert len(keys) == 20000
    variants = set()
    for key in keys:
        parsed = uuid.UUID(key)
        assert (parsed.version, parsed.variant, str(parsed)) == (4, uuid.RFC_4122, key)
        variants.add(key[19])
    assert variants == set("89ab")  # the variant's random bit is random


def test_compact_json_is_json_dumps_with_compact_separators() -> None:
    bodies = [
        {"command": ["true"], "timeout": 60.0, "request_id": "r", "stdin": False},
        {"text": 'é \u2028 \x00 "quoted"', "nested": {"a": [1, 2.5, None, True]}, "n": 10**20},
        [],
        "plain",
        {"inf": float("inf")},
    ]
    for body in bodies:
        assert proto.compact_json(body) == json.dumps(body, separators=(",", ":")).encode()
    with pytest.raises(TypeError):
        proto.compact_json({"bytes": b"x"})
    circular: list[object] = []
    circular.append(circular)
    with pytest.raises(ValueError, match="Circular"):
        proto.compact_json(circular)
