"""The broker's real responses conform to openapi.json, and the document to broker-api.md."""

from __future__ import annotations

import json
import re
import ssl
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from k8s_agent_sandbox_awx.testing import LocalBroker
from k8s_agent_sandbox_awx.testing._openapi import check_response, load_openapi, validate

DOCS = Path(__file__).resolve().parents[2] / "docs" / "broker-api.md"


def test_document_is_openapi_31_and_self_consistent() -> None:
    doc = load_openapi()
    assert doc["openapi"].startswith("3.1")
    refs = re.findall(r'"\$ref": "#/components/schemas/(\w+)"', str(doc).replace("'", '"'))
    assert set(refs) <= set(doc["components"]["schemas"])
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/healthz"]["get"]["security"] == []


def test_error_codes_match_the_prose_contract() -> None:
    doc = load_openapi()
    documented = set(doc["components"]["schemas"]["Error"]["properties"]["code"]["enum"])
    table = DOCS.read_text()
    section = table.split("## Errors", 1)[1].split("## Control plane", 1)[0]
    prose = set(re.findall(r"`([a-z_]+)`", section))
    assert documented == prose - {"detail", "code"}


def test_file_error_codes_match_the_runtime_and_the_prose() -> None:
    from k8s_agent_sandbox_awx.broker.runtime._paths import ERROR_CODES

    doc = load_openapi()
    fs_codes = doc["components"]["schemas"]["FsError"]["properties"]["code"]["enum"]
    assert fs_codes == list(ERROR_CODES)
    broker_codes = set(doc["components"]["schemas"]["Error"]["properties"]["code"]["enum"])
    assert not broker_codes & set(fs_codes)  # a client tells them apart by membership
    section = DOCS.read_text().split("### Files (`/fs/*`)", 1)[1].split("\n## ", 1)[0]
    table = section.split("**Refusals**", 1)[1]
    rows = re.findall(r"^\| (\d{3}) \| (.*?) \|", table, re.M)
    prose = {code: int(status) for status, codes in rows for code in re.findall(r"`(\w+)`", codes)}
    assert prose == ERROR_CODES


def test_checker_catches_violations() -> None:
    doc = load_openapi()
    sandbox = {"$ref": "#/components/schemas/Sandbox"}
    assert validate({"name": "x"}, sandbox, doc)
    assert check_response(doc, "GET", "/v1/healthz", 418, {})
    assert check_response(doc, "GET", "/v1/whoami", 401, {"detail": "x", "code": "nope"})


def _contract_hook(
    doc: dict[str, Any], problems: list[str], seen: set[tuple[str, str, int]]
) -> Callable[[httpx.Response], None]:
    """An httpx response hook that records every violation of ``doc``."""

    def hook(response: httpx.Response) -> None:
        response.read()
        request = response.request
        ctype = response.headers.get("content-type", "")
        body: Any = response.json() if ctype.startswith("application/json") else response.content
        if response.status_code == 204:
            body = None
        path = request.url.path
        problems.extend(
            check_response(doc, request.method, path, response.status_code, body, ctype or "")
        )
        seen.add((request.method, path, response.status_code))

    return hook


def test_broker_traffic_conforms(broker: LocalBroker) -> None:
    doc = load_openapi()
    problems: list[str] = []
    seen: set[tuple[str, str, int]] = set()
    hook = _contract_hook(doc, problems, seen)

    ctx = ssl.create_default_context(cafile=broker.ca_bundle)
    token = broker.issue_kubernetes_token("team-a", "openapi")
    other = broker.issue_kubernetes_token("team-a", "someone-else")
    with httpx.Client(
        base_url=broker.url,
        verify=ctx,
        headers={"Authorization": f"Bearer {token}"},
        event_hooks={"response": [hook]},
        timeout=30,
    ) as http:
        http.get("/v1/healthz")
        http.get("/v1/whoami")
        http.get("/v1/whoami", headers={"Authorization": "Bearer x.y.z"})
        key = str(uuid.uuid4())
        created = http.post(
            "/v1/sandboxes", json={"labels": {"a": "b"}}, headers={"Idempotency-Key": key}
        ).json()
        http.post("/v1/sandboxes", json={"labels": {"a": "b"}}, headers={"Idempotency-Key": key})
        http.post("/v1/sandboxes", json={"labels": {"a": "c"}}, headers={"Idempotency-Key": key})
        http.post("/v1/sandboxes", json={"template": "nope"})
        http.post("/v1/sandboxes", json={"template": "restricted"})
        http.post("/v1/sandboxes", json={"lifetime_seconds": -1})
        http.post("/v1/sandboxes", json={"annotations": {"broker.agent-sandbox-awx.io/x": "y"}})
        name = created["name"]
        http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20})
        http.get("/v1/sandboxes")
        http.get("/v1/sandboxes/sbx-missing")
        http.get("/v1/sandboxes/Bad_Name")
        http.delete("/v1/sandboxes/Bad_Name")
        http.get("/download/a%00b", headers={"X-Sandbox-ID": name, "X-Sandbox-Namespace": "team-a"})
        headers = {"X-Sandbox-ID": name, "X-Sandbox-Namespace": "team-a"}
        http.get("/", headers=headers)
        http.post("/execute", json={"command": "echo hi"}, headers=headers)
        http.post("/upload", files={"file": ("d/f.txt", b"data")}, headers=headers)
        http.get("/download/d%2Ff.txt", headers=headers)
        http.get("/download/missing", headers=headers)
        http.get("/download/..%2F..%2Fetc%2Fpasswd", headers=headers)
        http.get("/list/d", headers=headers)
        http.get("/exists/d%2Ff.txt", headers=headers)
        http.post(
            "/fs/write", data={"path": "/workspace/w.txt"}, files={"file": b"x"}, headers=headers
        )
        http.post("/fs/write", data={"path": "/etc/x"}, files={"file": b"x"}, headers=headers)
        http.get("/fs/read", params={"path": "/workspace/w.txt"}, headers=headers)
        http.get("/fs/read", params={"path": "../x"}, headers=headers)
        http.get("/fs/read", params={"path": "missing"}, headers=headers)
        http.get("/fs/list", params={"path": "/workspace"}, headers=headers)
        http.get("/fs/exists", params={"path": "w.txt"}, headers=headers)
        http.get("/fs/info", params={"path": "/workspace/w.txt"}, headers=headers)
        http.post("/fs/mkdir", json={"path": "/workspace/m"}, headers=headers)
        http.post(
            "/fs/move",
            json={"source": "/workspace/m", "destination": "/workspace/n"},
            headers=headers,
        )
        http.post("/fs/remove", json={"path": "/workspace/n", "recursive": True}, headers=headers)
        http.post("/fs/remove", json={"path": "/app"}, headers=headers)
        http.get("/fs/watch", params={"path": "/workspace", "duration": 0.3}, headers=headers)
        http.put(f"/v1/sandboxes/{name}/lifetime", json={"seconds": 300})
        http.put(f"/v1/sandboxes/{name}/lifetime", json={"seconds": 100000})
        http.put(f"/v1/sandboxes/{name}/lifetime", json={"seconds": "x"})
        http.put("/v1/sandboxes/sbx-missing/lifetime", json={"seconds": 1})
        http.put("/v1/sandboxes/Bad_Name/lifetime", json={"seconds": 1})
        http.get("/", headers={**headers, "X-Sandbox-Port": "0"})
        http.get("/", headers={**headers, "X-Sandbox-Port": "9999"})
        http.get("/", headers={**headers, "Authorization": f"Bearer {other}"})
        http.get("/", headers={"X-Sandbox-ID": "sbx-missing"})
        http.post(
            "/execute",
            json={"command": "sleep 3"},
            headers={**headers, "X-Sandbox-Timeout": "0.2"},
        )
        for _ in range(3):
            http.post("/v1/sandboxes", json={})
        http.post("/v1/sandboxes", json={})  # quota
        broker.inject_unavailable(1, scope="control")
        http.get("/v1/sandboxes")
        http.delete(f"/v1/sandboxes/{name}")
        http.delete("/v1/sandboxes/sbx-missing")
    assert problems == []
    statuses = {status for _, _, status in seen}
    assert statuses >= {200, 201, 202, 400, 401, 403, 404, 409, 429, 502, 503, 504}


def test_managed_command_traffic_conforms(broker: LocalBroker) -> None:
    doc = load_openapi()
    problems: list[str] = []
    seen: set[tuple[str, str, int]] = set()
    token = broker.issue_kubernetes_token("team-a", "openapi-commands")
    with httpx.Client(
        base_url=broker.url,
        verify=ssl.create_default_context(cafile=broker.ca_bundle),
        headers={"Authorization": f"Bearer {token}"},
        event_hooks={"response": [_contract_hook(doc, problems, seen)]},
        timeout=30,
    ) as http:
        env = {"SANDBOX_COMMAND_MAX_RUNNING": "2", "SANDBOX_COMMAND_OUTPUT_LIMIT_BYTES": "1000"}
        env["SANDBOX_COMMAND_LIVE_WINDOW_BYTES"] = "1000"
        name = http.post("/v1/sandboxes", json={"env": env}).json()["name"]
        http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20})
        headers = {"X-Sandbox-ID": name, "X-Sandbox-Namespace": "team-a"}

        def start(**body: Any) -> httpx.Response:
            body.setdefault("request_id", str(uuid.uuid4()))
            return http.post("/commands", json=body, headers=headers)

        big = start(
            command=[
                "/bin/bash",
                "-c",
                "echo start; sleep 0.2; head -c 1000000 /dev/zero; echo end",
            ]
        )
        big_id = big.json()["command_id"]
        streamed = http.post(  # the streamed start: the command id, then its events
            "/commands",
            json={"command": ["echo", "hi"], "request_id": str(uuid.uuid4())},
            headers={**headers, "Accept": "application/x-ndjson, application/json;q=0.5"},
        )
        first, *rest = [json.loads(line) for line in streamed.text.splitlines()]
        problems += validate(first, {"$ref": "#/components/schemas/CommandStarted"}, doc)
        for event in rest:
            problems += validate(event, {"$ref": "#/components/schemas/CommandEvent"}, doc)
        assert [e["type"] for e in rest] == ["stdout", "exit"], streamed.text
        whole = http.post(  # no output shown live: the same lines, held until the exit
            "/commands",
            json={"command": ["echo", "hi"], "request_id": str(uuid.uuid4())},
            headers={
                **headers,
                "Accept": "application/x-ndjson, application/json;q=0.5",
                "Prefer": "no-live-output",
            },
        )
        ok = doc["paths"]["/commands"]["post"]["responses"]["200"]
        applied = whole.headers["preference-applied"]
        problems += validate(applied, ok["headers"]["Preference-Applied"]["schema"], doc)
        assert whole.headers["content-length"] == str(len(whole.content))
        first, *rest = [json.loads(line) for line in whole.text.splitlines()]
        problems += validate(first, {"$ref": "#/components/schemas/CommandStarted"}, doc)
        assert [e["type"] for e in rest] == ["stdout", "exit"], whole.text
        running = start(command=["cat"], stdin=True, envs={"A": "b"}, cwd="/").json()["command_id"]
        start(command=["sleep", "30"])  # the second running command: the limit is 2
        start(command=["true"])  # 429
        start(command=[])  # 400
        for _ in range(600):  # unfollowed, it waits up to 5 s for a follower beyond the cap
            if http.get(f"/commands/{big_id}", headers=headers).json()["state"] != "running":
                break
            time.sleep(0.05)
        big_status = http.get(f"/commands/{big_id}", headers=headers).json()
        assert big_status["state"] == "exited", big_status
        events = http.get(
            f"/commands/{big_id}/events", params={"after": 0, "duration": 0}, headers=headers
        )
        for line in events.text.splitlines():
            problems += validate(
                json.loads(line), {"$ref": "#/components/schemas/CommandEvent"}, doc
            )
        last = json.loads(events.text.splitlines()[-1])["seq"] if events.text else 0
        http.get(f"/commands/{big_id}/events", params={"after": last}, headers=headers)  # 410
        http.get(f"/commands/{big_id}/events", params={"duration": 99}, headers=headers)  # 400
        http.get("/commands", headers=headers)
        http.post(f"/commands/{running}/stdin", json={"data": "x"}, headers=headers)
        http.post(f"/commands/{big_id}/stdin", json={"data": "x"}, headers=headers)  # 409
        http.post(f"/commands/{running}/kill", headers=headers)
        http.get("/commands/missing", headers=headers)  # 404
        http.get("/commands", headers={**headers, "X-Sandbox-Port": "0"})  # broker 400
        http.delete(f"/v1/sandboxes/{name}")
    assert problems == []
    codes = {(m, p.split("/")[-1] if p.count("/") > 2 else p, s) for m, p, s in seen}
    assert {
        ("POST", "/commands", 200),
        ("POST", "/commands", 429),
        ("POST", "/commands", 400),
        ("GET", "events", 200),
        ("GET", "events", 410),
        ("GET", "events", 400),
        ("POST", "stdin", 200),
        ("POST", "stdin", 409),
        ("POST", "kill", 200),
        ("GET", "/commands", 200),
        ("GET", "/commands", 400),
    } <= codes


def test_pty_traffic_conforms(broker: LocalBroker) -> None:
    """The pty option, its events (data_base64), binary stdin and the resize route: the
    requests as the document describes them, the answers as it promises."""
    doc = load_openapi()
    problems: list[str] = []
    seen: set[tuple[str, str, int]] = set()
    token = broker.issue_kubernetes_token("team-a", "openapi-pty")
    with httpx.Client(
        base_url=broker.url,
        verify=ssl.create_default_context(cafile=broker.ca_bundle),
        headers={"Authorization": f"Bearer {token}"},
        event_hooks={"response": [_contract_hook(doc, problems, seen)]},
        timeout=30,
    ) as http:
        name = http.post("/v1/sandboxes", json={}).json()["name"]
        http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20})
        headers = {"X-Sandbox-ID": name, "X-Sandbox-Namespace": "team-a"}

        def post(path: str, schema: str, body: dict[str, Any], ok: bool = True) -> httpx.Response:
            request_problems = validate(body, {"$ref": f"#/components/schemas/{schema}"}, doc)
            assert bool(request_problems) != ok, (body, request_problems)
            return http.post(path, json=body, headers=headers)

        script = "printf '\\377ok\\n'; read line; stty size; echo $line"
        start = {"command": ["/bin/bash", "-c", script], "pty": {"cols": 90, "rows": 20}}
        command_id = post("/commands", "StartCommandRequest", start).json()["command_id"]
        base = f"/commands/{command_id}"
        assert post(f"{base}/resize", "CommandResizeRequest", {"cols": 91, "rows": 21}).is_success
        post(f"{base}/resize", "CommandResizeRequest", {"cols": 0, "rows": 21}, ok=False)  # 400
        assert post(f"{base}/stdin", "CommandStdinRequest", {"data_base64": "aGkK"}).is_success
        post(f"{base}/stdin", "CommandStdinRequest", {"data": "x", "eof": True})  # 400
        events = http.get(f"{base}/events", params={"after": 0}, headers=headers)
        for line in events.text.splitlines():
            problems += validate(
                json.loads(line), {"$ref": "#/components/schemas/CommandEvent"}, doc
            )
        assert any("data_base64" in json.loads(line) for line in events.text.splitlines())
        status = http.get(base, headers=headers).json()
        assert (status["pty"], status["timeout"]) == ({"cols": 91, "rows": 21}, None)
        http.get("/commands", headers=headers)
        post(f"{base}/resize", "CommandResizeRequest", {"cols": 80, "rows": 24})  # 409: ended
        plain = post("/commands", "StartCommandRequest", {"command": ["true"]}).json()
        post(
            f"/commands/{plain['command_id']}/resize",
            "CommandResizeRequest",
            {"cols": 9, "rows": 9},
        )
        post("/commands", "StartCommandRequest", {"command": ["true"], "pty": {"x": 1}}, ok=False)
        # no time limit: "timeout": "none", its status says null; 0 and other strings are not it
        unlimited = post(
            "/commands", "StartCommandRequest", {"command": ["true"], "timeout": "none"}
        )
        assert unlimited.is_success, unlimited.text
        for bad in (0, "None"):
            refused = post(
                "/commands", "StartCommandRequest", {"command": ["true"], "timeout": bad}, ok=False
            )
            assert refused.status_code == 400
        post("/commands/missing/resize", "CommandResizeRequest", {"cols": 9, "rows": 9})  # 404
        http.delete(f"/v1/sandboxes/{name}")
    assert problems == []
    codes = {(m, p.split("/")[-1], s) for m, p, s in seen if p.startswith("/commands/")}
    assert {
        ("POST", "resize", 200),
        ("POST", "resize", 400),
        ("POST", "resize", 404),
        ("POST", "resize", 409),
        ("POST", "stdin", 200),
        ("POST", "stdin", 400),
    } <= codes


def test_code_traffic_conforms(broker: LocalBroker) -> None:
    """``run_code``'s ``/code`` API: the requests as the document describes them, the answers
    (and each streamed event) as it promises."""
    doc = load_openapi()
    problems: list[str] = []
    seen: set[tuple[str, str, int]] = set()
    token = broker.issue_kubernetes_token("team-a", "openapi-code")
    with httpx.Client(
        base_url=broker.url,
        verify=ssl.create_default_context(cafile=broker.ca_bundle),
        headers={"Authorization": f"Bearer {token}"},
        event_hooks={"response": [_contract_hook(doc, problems, seen)]},
        timeout=30,
    ) as http:
        env = {"SANDBOX_CODE_MAX_CONTEXTS": "2"}
        name = http.post("/v1/sandboxes", json={"env": env}).json()["name"]
        http.get(f"/v1/sandboxes/{name}", params={"wait": "ready", "timeout": 20})
        headers = {"X-Sandbox-ID": name, "X-Sandbox-Namespace": "team-a"}

        def post(path: str, schema: str, body: dict[str, Any], ok: bool = True) -> httpx.Response:
            request_problems = validate(body, {"$ref": f"#/components/schemas/{schema}"}, doc)
            assert bool(request_problems) != ok, (body, request_problems)
            accept = {"Accept": "application/x-ndjson"} if path == "/code/execute" else {}
            return http.post(path, json=body, headers={**headers, **accept})

        def lines(resp: httpx.Response) -> list[Any]:
            return [json.loads(line) for line in resp.text.splitlines()]

        code = "import sys\nprint('out'); print('err', file=sys.stderr)\n"
        code += "class R:\n  def _repr_png_(self): return b'png'\ndisplay(R())\n1/0"
        run = post("/code/execute", "RunCodeRequest", {"code": code, "request_id": "r-1"})
        first, *events = lines(run)
        problems += validate(first, {"$ref": "#/components/schemas/ExecutionStarted"}, doc)
        for event in events:
            problems += validate(event, {"$ref": "#/components/schemas/ExecutionEvent"}, doc)
        kinds = [e["type"] for e in events if e["type"] != "heartbeat"]
        assert sorted(kinds) == ["end", "error", "result", "stderr", "stdout"], kinds
        execution = first["execution_id"]
        http.get(f"/code/executions/{execution}/events", params={"after": 1}, headers=headers)
        http.get(f"/code/executions/{execution}/events", params={"after": 99}, headers=headers)
        http.get(f"/code/executions/{execution}", headers=headers)
        http.get("/code/executions", params={"request_id": "r-1"}, headers=headers)
        http.get("/code/executions/missing", headers=headers)  # 404
        http.post(f"/code/executions/{execution}/interrupt", headers=headers)
        context = post("/code/contexts", "CreateCodeContextRequest", {"cwd": "/workspace"}).json()
        post("/code/contexts", "CreateCodeContextRequest", {})  # 429: 2 with the default
        post("/code/contexts", "CreateCodeContextRequest", {"language": "r"}, ok=False)  # 400
        busy = {"code": "import time; time.sleep(30)", "context_id": context["id"]}
        started = http.post("/code/execute", json=busy, headers=headers).json()  # plain JSON
        post("/code/execute", "RunCodeRequest", {**busy, "code": "1"})  # 409 context_busy
        post("/code/execute", "RunCodeRequest", {"code": "1", "timeout": "none"})
        post("/code/execute", "RunCodeRequest", {"code": "1", "timeout": 0}, ok=False)  # 400
        post("/code/execute", "RunCodeRequest", {"code": "1", "context_id": "nope"})  # 404
        http.get("/code/contexts", headers=headers)
        http.get(f"/code/contexts/{context['id']}", headers=headers)
        http.post(f"/code/contexts/{context['id']}/restart", headers=headers)
        stopped = http.get(f"/code/executions/{started['execution_id']}", headers=headers)
        assert stopped.json()["state"] == "interrupted", stopped.text
        http.post(f"/code/contexts/{context['id']}/remove", headers=headers)
        http.post("/code/contexts/default/remove", headers=headers)  # restarted: a CodeContext
        http.post(f"/code/contexts/{context['id']}/remove", headers=headers)  # 404
        http.delete(f"/v1/sandboxes/{name}")
    assert problems == []
    codes = {(m, p.split("/")[-1], s) for m, p, s in seen if p.startswith("/code/")}
    assert {
        ("POST", "execute", 200),
        ("POST", "execute", 400),
        ("POST", "execute", 404),
        ("POST", "execute", 409),
        ("POST", "contexts", 200),
        ("POST", "contexts", 429),
        ("GET", "events", 200),
        ("GET", "events", 400),
        ("GET", "missing", 404),
        ("POST", "interrupt", 200),
        ("POST", "restart", 200),
        ("POST", "remove", 200),
        ("POST", "remove", 404),
    } <= codes
