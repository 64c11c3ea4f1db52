"""How long the google-cloud provider takes to decide, and to fetch (prints numbers).

    python plugins/google-cloud/bench/bench_google_cloud.py

- import: the entry point's import time (fresh interpreter);
- not here: the default host that does not resolve off Google Cloud, and a refused port;
- fetch: one identity-token fetch from a metadata-server stand-in on 127.0.0.1.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import k8s_agent_sandbox_awx_google_cloud as plugin

from k8s_agent_sandbox_awx import CredentialRequest

AUDIENCE = "https://sandbox-broker.example"
TOKEN = b"eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Length", str(len(TOKEN)))
        self.end_headers()
        self.wfile.write(TOKEN)

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
        f"{label:<42} median {statistics.median(samples):7.2f} ms   "
        f"max {max(samples):7.2f} ms   (n={len(samples)})"
    )


def main() -> None:
    code = "import time; t = time.perf_counter(); import k8s_agent_sandbox_awx_google_cloud; "
    code += "print((time.perf_counter() - t) * 1000)"
    imports = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
        for _ in range(5)
    ]
    _report("import the entry point (fresh process)", imports)
    _report("not here: metadata.google.internal", _time({}, 10))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _report("not here: connection refused", _time({"GCE_METADATA_HOST": f"127.0.0.1:{port}"}, 20))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"GCE_METADATA_HOST": f"127.0.0.1:{server.server_address[1]}"}
        _report("fetch from a loopback metadata server", _time(env, 50))
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
