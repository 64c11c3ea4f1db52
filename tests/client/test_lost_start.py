"""A command start whose answer was lost after it reached the runtime (its connection broke:
the broker's ``502 sandbox_unreachable``, which the client took for a refusal) is looked up by
its ``request_id`` and killed, whoever reports the loss: the command it started never runs on
unseen (foreground and background starts)."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import KubernetesAuth, Sandbox
from k8s_agent_sandbox_awx.errors import BrokerError
from k8s_agent_sandbox_awx.testing import LocalBroker, Policy
from tests._support.programs import process_alive as _alive

pytestmark = pytest.mark.e2e


def _options(broker: Any, **extra: str) -> dict[str, Any]:
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    auth = KubernetesAuth(env.pop("AGENT_SANDBOX_TOKEN_FILE"))
    return {"auth": auth, "environ": {**env, **extra}}


# -- item 5b(b): a start sent whose answer was lost is looked up, whoever reports the loss --------

LOSSY_RUNTIME = """
    import json, os, signal, socket, subprocess, sys, urllib.parse, uuid
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    COMMANDS = {}

    def summary(c):
        code = c["proc"].poll()
        return {"command_id": c["id"], "request_id": c["request_id"], "command": c["argv"],
                "state": "running" if code is None else "cancelled", "exit_code": code,
                "pid": c["proc"].pid, "timeout": 60, "stdin": False, "last_seq": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _json(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            split = urllib.parse.urlsplit(self.path)
            if split.path == "/":
                return self._json(200, {"status": "ok"})
            if split.path == "/commands":
                wanted = urllib.parse.parse_qs(split.query).get("request_id", [None])[-1]
                found = [c for c in COMMANDS.values() if wanted in (None, c["request_id"])]
                return self._json(200, {"commands": [summary(c) for c in found]})
            self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.loads(raw or b"{}")
            if self.path == "/commands":  # start it, then lose the answer
                proc = subprocess.Popen(body["command"], start_new_session=True)
                ident = str(uuid.uuid4())
                COMMANDS[ident] = {"id": ident, "request_id": body.get("request_id"),
                                   "argv": body["command"], "proc": proc}
                with open(os.path.join(os.environ["SANDBOX_BASE_DIR"], "pids"), "a") as fh:
                    fh.write(f"{proc.pid}\\n")
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            parts = self.path.split("/")
            if len(parts) == 4 and parts[1] == "commands" and parts[3] == "kill":
                command = COMMANDS[parts[2]]
                os.killpg(command["proc"].pid, signal.SIGKILL)
                command["proc"].wait()
                return self._json(200, summary(command))
            self._json(404, {"detail": "Not Found"})

    port = int(sys.argv[sys.argv.index("--port") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture(scope="module")
def lossy_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    """A broker with the template ``lossy``: a runtime that starts a command and then drops
    the connection without answering (a runtime or router that fails after the start)."""
    pytest.importorskip("uvicorn", reason="needs the [local] extra")
    script = tmp_path_factory.mktemp("lossy") / "lossy_runtime.py"
    script.write_text(textwrap.dedent(LOSSY_RUNTIME))
    policy = Policy(
        templates=("lossy",),
        namespace=lambda caller: str(caller.attributes["namespace"]),
    )
    templates: dict[str, str | list[str] | None] = {
        "lossy": [sys.executable, str(script), "--port", "{port}"]
    }
    with LocalBroker(templates=templates, kubernetes_policy=policy, warn=False) as broker:
        yield broker


@pytest.mark.parametrize("background", [False, True])
def test_a_start_lost_after_it_was_sent_is_found_and_killed(
    lossy_broker: LocalBroker, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    for name in [n for n in os.environ if n.startswith("AGENT_SANDBOX_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    with Sandbox.create(template="lossy", timeout=60, **_options(lossy_broker)) as sb:
        record = lossy_broker._require_store().sandboxes[sb.name]
        assert record.handle is not None
        with pytest.raises(BrokerError) as lost:
            sb.commands.run("sleep 60", background=background, timeout=60)
        assert lost.value.status_code == 502, lost.value  # the broker's sandbox_unreachable
        [pid] = [int(p) for p in Path(record.handle.base_dir, "pids").read_text().split()]
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        still_running = _alive(pid)
        if still_running:
            os.kill(pid, 9)
        notes = " ".join(getattr(lost.value, "__notes__", []))
        assert not still_running, f"the command it started runs on, unseen (notes: {notes!r})"
