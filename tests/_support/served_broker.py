"""``broker serve`` over the local backend as a real subprocess, trusting a scripted issuer on
loopback HTTPS, for the tests of the broker's resource limits: its connections, its
WebSockets, its memory (the RSS of the broker's own process, never the test's).

``with served_broker(tmp_path, keep_alive_seconds=2) as broker:`` — ``broker.url``,
``broker.token(sub)`` (a token the broker accepts), ``broker.environ(sub)`` (the SDK's
zero-argument environment for that caller), ``broker.tls()`` (a client TLS context),
``broker.rss_kib()``, ``broker.served`` (its output).
"""

from __future__ import annotations

import contextlib
import json
import resource
import ssl
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tests._support.broker_server import CLI, Pki, Served
from tests._support.kube import free_ports
from tests._support.oidc_issuer import BackgroundIssuer


@dataclass
class ServedBroker:
    served: Served
    pki: Pki
    issuer: BackgroundIssuer
    url: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def token(self, sub: str = "project_path:g/p:ref_type:branch:ref:main") -> str:
        return self.issuer.token(sub, aud=self.url)

    def environ(self, sub: str = "project_path:g/p:ref_type:branch:ref:main") -> dict[str, str]:
        return {
            "AGENT_SANDBOX_BROKER_URL": self.url,
            "AGENT_SANDBOX_CA_BUNDLE": str(self.pki.ca_file),
            "AGENT_SANDBOX_TOKEN": self.token(sub),
            "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1",
        }

    def tls(self) -> ssl.SSLContext:
        return self.pki.context()

    def rss_kib(self) -> int:
        """The broker process's resident set size now (``VmRSS``), in KiB."""
        return _status_kib(self.served.process.pid, "VmRSS")

    def messages(self) -> list[dict[str, object]]:
        """The broker's JSON messages on standard error so far (``"log": "broker"``)."""
        lines = []
        for line in list(self.served.stderr):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("log") == "broker":
                    lines.append(record)
        return lines


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for process {pid}")


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def write_local_config(
    directory: Path,
    pki: Pki,
    issuer: BackgroundIssuer,
    port: int,
    server: Mapping[str, object],
    max_sandboxes: int = 5,
) -> Path:
    """``broker serve`` over the local backend, trusting ``issuer``, one policy for every
    subject, on ``port``; ``server``: more ``[server]`` keys."""
    lines = [
        "[server]",
        f'listen = "127.0.0.1:{port}"',
        f'public_url = "https://127.0.0.1:{port}"',
        f"tls_cert_file = {_toml(str(pki.cert_file))}",
        f"tls_key_file = {_toml(str(pki.key_file))}",
        "shutdown_grace_seconds = 5",
        *(f"{key} = {_toml(value)}" for key, value in server.items()),
        "",
        "[[issuers]]",
        'name = "ci"',
        f"url = {_toml(issuer.url)}",
        'provider = "gitlab"',
        f"ca_file = {_toml(str(issuer.ca_file))}",
        "",
        "[[policies]]",
        'name = "everyone"',
        'issuer = "ci"',
        'warm_pools = ["python"]',
        'namespace = "ci-sandboxes"',
        f"max_sandboxes = {max_sandboxes}",
        "",
        "[backend]",
        'kind = "local"',
        "",
        "[backend.local]",
        'templates = { python = "" }',
    ]
    path = directory / "limits-broker.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def raise_file_limit(wanted: int) -> int:
    """Raise this process's soft limit on open files to ``wanted`` (its children inherit it)
    if the hard limit allows; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@contextlib.contextmanager
def served_broker(
    tmp_path: Path, max_sandboxes: int = 5, **server: object
) -> Iterator[ServedBroker]:
    """``broker serve`` over the local backend (see the module), stopped at the end."""
    pki = Pki(tmp_path)
    pki.write(pki.issue())
    with BackgroundIssuer(tmp_path) as issuer:
        [port] = free_ports(1)
        config = write_local_config(tmp_path, pki, issuer, port, server, max_sandboxes)
        served = Served.start([*CLI, "broker", "serve", "--config", str(config)])
        try:
            served.wait_started()
            broker = ServedBroker(served, pki, issuer, f"https://127.0.0.1:{port}")
            _wait_ready(broker)
            yield broker
        finally:
            served.stop()


def _wait_ready(broker: ServedBroker, timeout: float = 30.0) -> None:
    import http.client

    deadline = time.monotonic() + timeout
    while True:
        conn = http.client.HTTPSConnection("127.0.0.1", broker.port, context=broker.tls())
        try:
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        assert time.monotonic() < deadline, broker.served.output()
        time.sleep(0.1)
