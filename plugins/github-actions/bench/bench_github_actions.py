"""How long the github-actions provider takes (prints numbers).

    python plugins/github-actions/bench/bench_github_actions.py

- import: the entry point's import time (fresh interpreter);
- not here: outside GitHub Actions;
- fetch: one token request to a token-service stand-in on 127.0.0.1.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import k8s_agent_sandbox_awx_github_actions as plugin

from k8s_agent_sandbox_awx import CredentialRequest

AUDIENCE = "https://sandbox-broker.example"
REPLY = json.dumps({"count": 1, "value": "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln"}).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(REPLY)))
        self.end_headers()
        self.wfile.write(REPLY)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _time(environ: dict[str, str], runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        plugin.agent_sandbox_get_credential(CredentialRequest(AUDIENCE, environ, 5.0))
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _report(label: str, samples: list[float]) -> None:
    print(
        f"{label:<42} median {statistics.median(samples):7.3f} ms   "
        f"max {max(samples):7.3f} ms   (n={len(samples)})"
    )


def main() -> None:
    code = "import time; t = time.perf_counter(); import k8s_agent_sandbox_awx_github_actions; "
    code += "print((time.perf_counter() - t) * 1000)"
    imports = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
        for _ in range(5)
    ]
    _report("import the entry point (fresh process)", imports)
    _report("not here: GITHUB_ACTIONS unset", _time({}, 1000))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {
            "GITHUB_ACTIONS": "true",
            "ACTIONS_ID_TOKEN_REQUEST_URL": (
                f"http://127.0.0.1:{server.server_address[1]}/idtoken?api-version=2.0"
            ),
            "ACTIONS_ID_TOKEN_REQUEST_TOKEN": "bench-request-token",
        }
        _report("fetch from a loopback token service", _time(env, 50))
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
