"""How long the github-actions provider takes (prints numbers).

    python plugins/github-actions/bench/bench_github_actions.py

- import: the entry point's import time (fresh interpreter);
- not here: outside GitHub Actions;
- fetch: one token request to a token-service stand-in on 127.0.0.1 (``ScriptedEndpoint``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import k8s_agent_sandbox_awx_github_actions as plugin

from k8s_agent_sandbox_awx import CredentialRequest
from k8s_agent_sandbox_awx.testing import ScriptedEndpoint, unsigned_jwt

AUDIENCE = "https://sandbox-broker.example"
IMPORT = "import time; t = time.perf_counter(); import k8s_agent_sandbox_awx_github_actions; "


def report(label: str, samples: list[float]) -> None:
    median, worst = statistics.median(samples), max(samples)
    print(f"{label:<42} median {median:7.3f} ms   max {worst:7.3f} ms   (n={len(samples)})")


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
    report("not here: GITHUB_ACTIONS unset", ask({}, 1000))
    reply = json.dumps({"count": 1, "value": unsigned_jwt({"aud": AUDIENCE})})
    headers = {"Content-Type": "application/json"}
    with ScriptedEndpoint(default_headers=headers) as endpoint:
        endpoint.responder = lambda seen: endpoint.reply(reply)
        env = {
            "GITHUB_ACTIONS": "true",
            "ACTIONS_ID_TOKEN_REQUEST_URL": endpoint.url("/idtoken?api-version=2.0"),
            "ACTIONS_ID_TOKEN_REQUEST_TOKEN": "bench-request-token",
        }
        report("fetch from a loopback token service", ask(env, 50))


if __name__ == "__main__":
    main()
