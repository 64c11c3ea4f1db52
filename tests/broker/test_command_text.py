"""What a managed command is given must be something it can be given, and the refusal says so.

- Text that UTF-8 cannot carry (a lone surrogate; JSON escapes one as ``"\\ud800"``) in a
  command's ``cwd`` or in a stdin write is ``400 invalid_text`` from the runtime (it was a
  broken answer, the broker's ``502`` "create a new sandbox"), and a stdin write keeps its
  command running and its stdin open. (argv and envs: tests/broker/test_command_abuse.py.)
- A ``cwd`` under a sandbox root follows the file API's rules, and an error names the sandbox
  path, never the host's.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from k8s_agent_sandbox_awx.testing import LocalBroker


def _post(alice: Any, sandbox: dict[str, Any], path: str, body: dict[str, Any]) -> Any:
    headers = {**alice.data_headers(sandbox), "Content-Type": "application/json"}
    return alice.http.post(path, content=json.dumps(body), headers=headers)  # "\ud800" escaped


def test_a_lone_surrogate_in_stdin_is_refused_and_the_command_runs_on(alice: Any) -> None:
    sandbox = alice.ready()
    started = _post(
        alice, sandbox, "/commands", {"command": ["cat"], "stdin": True, "request_id": "r-1"}
    )
    assert started.status_code == 200, started.text
    command_id = started.json()["command_id"]
    refused = _post(alice, sandbox, f"/commands/{command_id}/stdin", {"data": "a\ud800"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["code"] == "invalid_text", refused.text
    assert "'data'" in refused.json()["detail"] and "surrogate" in refused.json()["detail"]
    written = _post(alice, sandbox, f"/commands/{command_id}/stdin", {"data": "ok", "eof": True})
    assert written.status_code == 200, written.text
    headers = alice.data_headers(sandbox)
    status = alice.http.get(f"/commands/{command_id}", headers=headers).json()
    for _ in range(100):
        if status["state"] != "running":
            break
        status = alice.http.get(f"/commands/{command_id}", headers=headers).json()
    assert (status["state"], status["stdout"]) == ("exited", "ok"), status


def test_a_lone_surrogate_in_cwd_is_refused(alice: Any) -> None:
    sandbox = alice.ready()
    for cwd in ("/tmp/\ud800", "/workspace/\ud800"):
        body = {"command": ["true"], "cwd": cwd, "request_id": str(uuid.uuid4())}
        refused = _post(alice, sandbox, "/commands", body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["code"] in ("invalid_text", "path_invalid"), refused.text
    listed = alice.http.get("/commands", headers=alice.data_headers(sandbox)).json()
    assert listed["commands"] == []


def test_a_missing_cwd_under_a_root_names_the_sandbox_path_only(
    broker: LocalBroker, alice: Any
) -> None:
    sandbox = alice.ready()
    body = {"command": ["true"], "cwd": "/workspace/no/such/dir", "request_id": "r-2"}
    refused = _post(alice, sandbox, "/commands", body)
    assert refused.status_code == 400, refused.text
    detail = refused.json()["detail"]
    assert "/workspace/no/such/dir" in detail, detail
    handle = broker._require_store().sandboxes[sandbox["name"]].handle
    assert handle is not None
    host_root = str(Path(handle.base_dir).parent)  # the sandbox's folder on this host
    assert host_root not in detail, detail
