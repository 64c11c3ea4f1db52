"""How long the google-cloud provider takes to decide, and to fetch (prints numbers).

    python plugins/google-cloud/bench/bench_google_cloud.py

- import: the entry point's import time (fresh interpreter);
- not here: the default host that does not resolve off Google Cloud, and a refused port;
- fetch: one identity-token fetch from a metadata-server stand-in on 127.0.0.1
  (``ScriptedEndpoint``).
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time

import k8s_agent_sandbox_awx_google_cloud as plugin

from k8s_agent_sandbox_awx import CredentialRequest
from k8s_agent_sandbox_awx.testing import ScriptedEndpoint, unsigned_jwt

AUDIENCE = "https://sandbox-broker.example"
IMPORT = "import time; t = time.perf_counter(); import k8s_agent_sandbox_awx_google_cloud; "


def report(label: str, samples: list[float]) -> None:
    median, worst = statistics.median(samples), max(samples)
    print(f"{label:<42} median {median:7.2f} ms   max {worst:7.2f} ms   (n={len(samples)})")


def ask(environ: dict[str, str], runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        plugin.agent_sandbox_get_credential(CredentialRequest(AUDIENCE, environ, 5.0))
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def main() -> None:
    code = [sys.executable, "-c", IMPORT + "print((time.perf_counter() - t) * 1000)"]
    imports = [float(subprocess.run(code, capture_output=True, text=True).stdout) for _ in range(5)]
    report("import the entry point (fresh process)", imports)
    report("not here: metadata.google.internal", ask({}, 10))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{s.getsockname()[1]}"
    report("not here: connection refused", ask({"GCE_METADATA_HOST": refused}, 20))
    token = unsigned_jwt({"aud": AUDIENCE}, ttl=3600)
    with ScriptedEndpoint(default_headers={"Metadata-Flavor": "Google"}) as endpoint:
        endpoint.responder = lambda seen: endpoint.reply(token)
        env = {"GCE_METADATA_HOST": endpoint.host}
        report("fetch from a loopback metadata server", ask(env, 50))


if __name__ == "__main__":
    main()
