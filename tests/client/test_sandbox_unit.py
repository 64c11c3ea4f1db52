"""Sandbox lifecycle over a scripted broker (MockTransport): waiting, cleanup, commands, files."""

from __future__ import annotations

import io
import json
import shlex
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import (
    BrokerTemplateNotFoundError,
    BrokerWarmPoolNotFoundError,
    CommandTimeoutError,
    FileInfo,
    RequestTimeoutError,
    SandboxFailedError,
    SandboxReadyTimeoutError,
)
from k8s_agent_sandbox_awx._upstream import (
    ExecutionResult,
    SandboxClaimFailedError,
    SandboxError,
    SandboxNotReadyError,
)
from k8s_agent_sandbox_awx.client.core._command_rules import SHELL

pytestmark = pytest.mark.upstream  # upstream-named API (claim_name, terminate, ...)


def test_create_waits_with_the_long_poll(make_client: Any, fake: Any) -> None:
    fake.ready_after_polls = 3
    sandbox = make_client().create_sandbox("python", labels={"team": "ml"})
    polls = [r for r in fake.requests if r.method == "GET"]
    assert len(polls) == 3
    assert all(r.url.params["wait"] == "ready" for r in polls)
    assert all(0 < float(r.url.params["timeout"]) <= 60 for r in polls)
    assert sandbox.name == "sbx-1" and sandbox.info.ready and sandbox.namespace == "team-a"


def test_ready_timeout_deletes_the_claim(make_client: Any, fake: Any) -> None:
    fake.ready_after_polls = 10**9

    @fake.route("GET", "/v1/sandboxes/sbx-1")
    def pending(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=fake.sandboxes["sbx-1"])

    fake.route("DELETE", "/v1/sandboxes/sbx-1")(lambda r: httpx.Response(204))
    with pytest.raises(SandboxReadyTimeoutError) as info:
        make_client().create_sandbox(sandbox_ready_timeout=0)
    assert isinstance(info.value, SandboxNotReadyError)
    assert "ready_timeout" in str(info.value)
    assert fake.requests[-1].method == "DELETE"


def test_failed_phase_deletes_the_claim(make_client: Any, fake: Any) -> None:
    fake.final_phase = "Failed"
    with pytest.raises(SandboxFailedError) as info:
        make_client().create_sandbox()
    assert isinstance(info.value, SandboxClaimFailedError)
    assert info.value.reason == "ImagePull"
    assert fake.deleted == ["sbx-1"]


@pytest.mark.parametrize("reason", ["WarmPoolNotFound", "TemplateNotFound"])
def test_a_missing_pool_seen_while_waiting_is_the_typed_error(
    make_client: Any, fake: Any, reason: str
) -> None:
    """A Kubernetes-backed v1 broker learns that a warm pool (or its template) is missing from
    the controller, after the create: the wait's Failed phase with that reason is the same
    typed error as under /rpc (and the claim is deleted)."""

    @fake.route("GET", "/v1/sandboxes/sbx-1")
    def failed(request: httpx.Request) -> httpx.Response:
        message = f'{reason}: "python" not found'
        fake.sandboxes["sbx-1"].update(phase="Failed", reason=reason, message=message)
        return httpx.Response(200, json=fake.sandboxes["sbx-1"])

    fake.route("DELETE", "/v1/sandboxes/sbx-1")(lambda r: httpx.Response(204))
    expected = BrokerWarmPoolNotFoundError if reason == "WarmPoolNotFound" else (
        BrokerTemplateNotFoundError
    )  # fmt: skip
    with pytest.raises(expected) as info:
        make_client().create_sandbox("python")
    assert "not found" in str(info.value)
    assert fake.requests[-1].method == "DELETE"


def test_interrupted_wait_deletes_the_claim(make_client: Any, fake: Any) -> None:
    def interrupt(request: httpx.Request) -> httpx.Response:
        raise KeyboardInterrupt

    fake.route("GET", "/v1/sandboxes/sbx-1")(interrupt)
    with pytest.raises(KeyboardInterrupt):
        make_client().create_sandbox()
    assert fake.deleted == ["sbx-1"]


def test_failed_cleanup_is_reported_not_hidden(make_client: Any, fake: Any, kit: Any) -> None:
    fake.final_phase = "Failed"
    fake.route("DELETE", "/v1/sandboxes/sbx-1")(lambda r: kit.error(403, "not_owner", "no"))
    with pytest.raises(SandboxFailedError) as info:
        make_client().create_sandbox()
    assert any("agent-sandbox-awx kill sbx-1" in n for n in info.value.__notes__)


def test_with_block_kills_also_on_error(make_client: Any, fake: Any) -> None:
    client = make_client()
    with pytest.raises(RuntimeError, match="boom"), client.create_sandbox() as sandbox:
        raise RuntimeError("boom")
    assert fake.deleted == ["sbx-1"]
    assert not sandbox.is_active
    sandbox.kill()  # idempotent, no request
    assert [r.method for r in fake.requests].count("DELETE") == 1


def test_kill_of_a_gone_sandbox_is_fine(make_client: Any, fake: Any) -> None:
    client = make_client()
    sandbox = client.create_sandbox()
    del fake.sandboxes["sbx-1"]
    sandbox.kill()
    assert not sandbox.is_active
    client.delete_sandbox("never-existed")


def test_upstream_style_client_methods(make_client: Any, fake: Any) -> None:
    with make_client() as client:
        a = client.create_sandbox("python")
        client.create_sandbox("python")
        assert client.list_active_sandboxes() == [("team-a", "sbx-1"), ("team-a", "sbx-2")]
        assert client.list_all_sandboxes() == ["sbx-1", "sbx-2"]
        assert client.get_sandbox("sbx-1") is a
        client.delete_sandbox("sbx-1")
        assert client.list_active_sandboxes() == [("team-a", "sbx-2")]
    assert fake.deleted == ["sbx-1", "sbx-2"]


def test_unsupported_upstream_options_are_refused(make_client: Any) -> None:
    with pytest.raises(Exception, match="claim_name"):
        make_client().create_sandbox("python", claim_name="mine")


def test_commands_run(make_client: Any, fake: Any) -> None:
    sandbox = make_client().create_sandbox()
    result = sandbox.commands.run("echo hi", timeout=5)
    assert isinstance(result, ExecutionResult)
    # a runtime without POST /commands (404, no code): /execute with the shell argv quoted
    assert [r.url.path for r in fake.requests[-2:]] == ["/commands", "/execute"]
    assert result.stdout == f"ran {shlex.join([*SHELL, 'echo hi'])}\n"
    assert (result.state, result.command_id) == ("exited", None)
    execute = fake.requests[-1]
    assert execute.headers["X-Sandbox-ID"] == "sbx-1"
    assert execute.headers["X-Sandbox-Namespace"] == "team-a"


def test_command_timeout(make_client: Any, fake: Any) -> None:
    sandbox = make_client().create_sandbox()
    fake.route("POST", "/execute")(
        lambda r: httpx.Response(
            200, json={"stdout": "part", "stderr": "", "exit_code": 124, "timed_out": True}
        )
    )
    with pytest.raises(CommandTimeoutError) as info:
        sandbox.commands.run("sleep 10", timeout=1)
    assert info.value.result is not None and info.value.result.stdout == "part"
    result = sandbox.commands.run("sleep 10", timeout=1, raise_on_timeout=False)
    assert result.timed_out

    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer")

    fake.route("POST", "/execute")(hang)
    with pytest.raises(CommandTimeoutError, match="No answer"):
        sandbox.commands.run("sleep 100", timeout=1)


def test_files(make_client: Any, fake: Any, tmp_path: Path) -> None:
    sandbox = make_client().create_sandbox()
    fake.route("GET", "/list/data")(
        lambda r: httpx.Response(
            200, json=[{"name": "in.csv", "size": 3, "type": "file", "mod_time": 1.0}]
        )
    )
    fake.route("GET", "/exists/data/in.csv")(
        lambda r: httpx.Response(200, json={"path": "data/in.csv", "exists": True})
    )
    fake.route("GET", "/download/data/in.csv")(lambda r: httpx.Response(200, content=b"a,b"))
    fake.route("GET", "/download/missing")(lambda r: httpx.Response(404, json={"detail": "nope"}))
    entries = sandbox.files.list("data")
    assert isinstance(entries[0], FileInfo) and entries[0].name == "in.csv"
    assert entries[0].path == "data/in.csv" and entries[0].modified is not None
    assert sandbox.files.exists("data/in.csv") is True
    assert sandbox.files.read("data/in.csv") == b"a,b"
    sink = io.BytesIO()
    assert sandbox.files.read_to("data/in.csv", sink) == 3 and sink.getvalue() == b"a,b"
    assert sandbox.files.read_to("data/in.csv", tmp_path / "x.csv") == 3
    assert (tmp_path / "x.csv").read_bytes() == b"a,b"
    with pytest.raises(Exception, match="does not exist in the sandbox"):
        sandbox.files.read_to("missing", tmp_path / "m")
    assert not (tmp_path / "m").exists()
    with pytest.raises(Exception, match="does not exist in the sandbox"):
        sandbox.files.read_to("missing", tmp_path / "x.csv")
    assert (tmp_path / "x.csv").read_bytes() == b"a,b"  # an existing file is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.csv"]  # no partial files
    with pytest.raises(SandboxError, match="max_bytes"):
        sandbox.files.read_to("data/in.csv", io.BytesIO(), max_bytes=2)
    with pytest.raises(ValueError, match=r"\.\."):
        sandbox.files.write("../etc/passwd", b"x")
    with pytest.raises(TypeError, match="binary"):
        sandbox.files.write("t.txt", io.StringIO("text"))  # type: ignore[arg-type]


def test_interrupted_create_request_is_undone(make_client: Any, fake: Any, kit: Any) -> None:
    calls: list[str] = []

    @fake.route("POST", "/v1/sandboxes")
    def create(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers["Idempotency-Key"])
        fake.sandboxes["sbx-1"] = kit.sandbox_obj("sbx-1")
        if len(calls) == 1:
            raise httpx.ReadTimeout("the answer never came")  # created, but unseen
        return httpx.Response(200, json=fake.sandboxes["sbx-1"])

    with pytest.raises(RequestTimeoutError):
        make_client().create_sandbox()
    assert len(calls) == 2 and calls[0] == calls[1]
    assert fake.deleted == ["sbx-1"]


def test_malformed_create_answer_with_a_name_deletes_the_claim(make_client: Any, fake: Any) -> None:
    """The broker created a sandbox but its answer is not a valid Sandbox object: the error is
    a BrokerProtocolError and the sandbox it names is deleted, not leaked."""
    from k8s_agent_sandbox_awx import BrokerProtocolError

    @fake.route("POST", "/v1/sandboxes")
    def created(request: httpx.Request) -> httpx.Response:
        fake.sandboxes["sbx-1"] = {"name": "sbx-1", "phase": "Pending"}
        return httpx.Response(201, json={"name": "sbx-1", "phase": "Pending", "router": 7})

    with pytest.raises(BrokerProtocolError, match="router"):
        make_client().create_sandbox()
    assert fake.deleted == ["sbx-1"]


def test_one_name_per_concept_upstream_spellings_only_from_the_client(
    make_client: Any, fake: Any
) -> None:
    """``Sandbox`` has the SDK's names only; upstream's (``claim_name``, ``terminate``,
    ``command_timeout=``) exist on the handles ``BrokerSandboxClient`` returns, and a misspelt
    or upstream name elsewhere is refused with the SDK's name suggested."""
    from k8s_agent_sandbox_awx import Sandbox

    client = make_client()
    upstream = client.create_sandbox()
    assert upstream.claim_name == upstream.name
    plain = Sandbox(client, upstream.info)
    assert not hasattr(plain, "claim_name") and not hasattr(plain, "terminate")
    with pytest.raises(TypeError, match="did you mean 'timeout'"):
        plain.commands.run("true", command_timeout=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="did you mean 'timeout'"):
        Sandbox.create(timout=5)  # type: ignore[call-arg]
    assert upstream.commands.run("true", timeout=1, command_timeout=5).exit_code == 0
    sent = json.loads(fake.requests[-1].content)
    assert sent["timeout_seconds"] == 5  # upstream's command_timeout wins
    upstream.terminate()
    assert not upstream.is_active


def test_the_missing_snapshots_attribute_is_an_attribute_error_too(make_client: Any) -> None:
    """``sandbox.snapshots`` (the original's GKE feature) is refused with the typed
    UnsupportedOperationError, which is also an AttributeError: ``hasattr`` answers ``False``,
    ``getattr(..., None)`` its default, and introspection (``inspect.getmembers``,
    ``mock.create_autospec``, used to mock a sandbox in tests) does not fail on it."""
    import inspect
    from unittest import mock

    from k8s_agent_sandbox_awx import UnsupportedOperationError

    sandbox = make_client().create_sandbox()
    with pytest.raises(UnsupportedOperationError, match="GKE"):
        sandbox.snapshots  # noqa: B018
    assert not hasattr(sandbox, "snapshots")
    assert getattr(sandbox, "snapshots", None) is None
    assert "commands" in dict(inspect.getmembers(sandbox))
    assert mock.create_autospec(sandbox).commands is not None


@pytest.mark.parametrize(
    ("answer", "limit", "chunk"),
    [
        (
            httpx.Response(
                413,
                json={"detail": "the body is over 1048576 bytes", "code": "too_large"},
                headers={"Agent-Sandbox-Broker-Error": "too_large"},
            ),
            1048576,
            65536,
        ),
        (
            httpx.Response(
                400,
                json={"detail": "the body must be a JSON object: body larger than 524288 bytes"},
            ),
            524288,
            32768,
        ),
        (httpx.Response(413, text="Request Entity Too Large"), None, 32),
    ],
)
def test_a_stdin_the_runtime_refuses_as_too_large_says_the_limit_and_how_to_send_more(
    make_client: Any, fake: Any, answer: httpx.Response, limit: int | None, chunk: int
) -> None:
    """Issue 19 item 11: a runtime (or broker) that refuses a stdin body as too large (413, or
    400 naming the size) is a StdinTooLargeError with the limit and the chunk size, not a
    "malformed request, likely a client bug" (400) or an unexplained 413."""
    from k8s_agent_sandbox_awx.errors import StdinTooLargeError

    sandbox = make_client().create_sandbox()
    fake.route("POST", "/commands")(lambda r: httpx.Response(200, json={"command_id": "c1"}))
    fake.route("POST", "/commands/c1/stdin")(lambda r: answer)
    handle = sandbox.commands.run(["cat"], background=True, stdin=True)
    with pytest.raises(StdinTooLargeError) as info:
        handle.send_stdin("y" * 1000)
    error = info.value
    assert (error.limit, error.status_code, error.request_sent) == (limit, answer.status_code, True)
    assert f"chunks of at most {chunk} characters" in str(error), str(error)
    assert (f"{limit} bytes" in str(error)) if limit else "did not say" in str(error)
    assert [r.url.path for r in fake.requests].count("/commands/c1/stdin") == 1  # not retried


NOT_LEGACY_404 = {
    "a runtime's own 404": httpx.Response(404, json={"detail": "no such port in the sandbox"}),
    "an ingress page": httpx.Response(
        404, text="<html><body><h1>404 Not Found</h1>nginx</body></html>"
    ),
    "a router's text": httpx.Response(404, text="404 page not found"),
}


@pytest.mark.parametrize("answer", list(NOT_LEGACY_404))
def test_a_404_to_post_commands_that_is_not_the_legacy_runtimes_is_not_remembered(
    make_client: Any, fake: Any, answer: str
) -> None:
    """Issue 19 item 5b(c): any 404 without a broker code to ``POST /commands`` was taken for
    the legacy runtime for the sandbox's life (a plain run went to ``/execute``, a background
    one was refused from then on). Only the legacy runtime's answer (FastAPI's
    ``{"detail": "Not Found"}``) means that; another 404 is an error for that call, and the
    next call tries ``POST /commands`` again."""
    from k8s_agent_sandbox_awx.errors import BrokerError

    sandbox = make_client().create_sandbox()
    answers = [NOT_LEGACY_404[answer], NOT_LEGACY_404[answer]]

    @fake.route("POST", "/commands")
    def start(request: httpx.Request) -> httpx.Response:
        return answers.pop() if answers else httpx.Response(200, json={"command_id": "c1"})

    before = len(fake.requests)
    for run in (
        lambda: sandbox.commands.run("echo hi"),
        lambda: sandbox.commands.run(["true"], background=True),
    ):
        with pytest.raises(BrokerError) as info:
            run()
        assert info.value.status_code == 404 and info.value.code is None
        assert any("legacy runtime" in note for note in info.value.__notes__)
    assert sandbox.commands.run(["true"], background=True).command_id == "c1"
    assert [r.url.path for r in fake.requests[before:]] == ["/commands"] * 3  # no /execute


def test_the_legacy_runtimes_404_is_remembered(make_client: Any, fake: Any) -> None:
    sandbox = make_client().create_sandbox()
    fake.route("POST", "/commands")(lambda r: httpx.Response(404, json={"detail": "Not Found"}))
    before = len(fake.requests)
    assert sandbox.commands.run("echo hi").exit_code == 0
    assert sandbox.commands.run("echo again").exit_code == 0
    assert [r.url.path for r in fake.requests[before:]] == ["/commands", "/execute", "/execute"]
