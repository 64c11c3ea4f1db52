"""Helpers for the tests of ``broker serve``: a CA made at test time, certificate pairs written
(and rotated) on disk, a configuration file, and the server as a real subprocess."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import trustme
from cryptography import x509

STREAMING_APP = Path(__file__).with_name("streaming_app.py")
CLI = [sys.executable, "-m", "k8s_agent_sandbox_awx.cli._cli"]


class Pki:
    """A CA made now; leaf certificates for 127.0.0.1 written as ``tls.crt`` / ``tls.key``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca = trustme.CA()
        self.ca_file = directory / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.cert_file = directory / "tls.crt"
        self.key_file = directory / "tls.key"

    def issue(self) -> trustme.LeafCert:
        return self.ca.issue_cert("127.0.0.1", "localhost")

    def write(self, leaf: trustme.LeafCert, *, key: trustme.LeafCert | None = None) -> int:
        """Replace the pair on disk (as a Secret volume does: new files renamed over the old);
        ``key``: another leaf's key (a broken pair). Returns the certificate's serial."""
        for path, data in (
            (self.cert_file, b"".join(blob.bytes() for blob in leaf.cert_chain_pems)),
            (self.key_file, (key or leaf).private_key_pem.bytes()),
        ):
            fresh = path.with_suffix(".new")
            fresh.write_bytes(data)
            os.replace(fresh, path)
        return serial(leaf)

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))


def serial(leaf: trustme.LeafCert) -> int:
    return x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()).serial_number


def peer_serial(sock: ssl.SSLSocket) -> int:
    cert = sock.getpeercert()
    assert cert is not None
    return int(str(cert["serialNumber"]), 16)


def write_config(directory: Path, pki: Pki, **server: object) -> Path:
    """A configuration that serves on 127.0.0.1 (a free port) with ``pki``'s pair; ``server``:
    more ``[server]`` keys (TOML values written with ``repr``-compatible literals)."""
    settings = {
        "listen": "127.0.0.1:0",
        "public_url": "https://sandbox-broker.example.com",
        "tls_cert_file": str(pki.cert_file),
        "tls_key_file": str(pki.key_file),
        "tls_reload_seconds": 0.2,
        "log_level": "info",
        **server,
    }
    lines = ["[server]"]
    for key, value in settings.items():
        text = ("true" if value else "false") if isinstance(value, bool) else value
        lines.append(f'{key} = "{text}"' if isinstance(text, str) else f"{key} = {text}")
    lines += [
        "",
        "[[issuers]]",
        'name = "cluster"',
        'url = "https://kubernetes.default.svc.cluster.local"',
        'provider = "kubernetes"',
        "",
        "[[policies]]",
        'name = "all"',
        'issuer = "cluster"',
        'warm_pools = ["python"]',
        'namespace = "{caller.namespace}"',
        "",
        "[backend]",
        'kind = "local"',
    ]
    path = directory / "broker.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Served:
    """``broker serve`` (or the streaming test app) as a subprocess, its output collected."""

    process: subprocess.Popen[str]
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    url: str = ""
    logs: Path | None = None
    """Where the output goes instead (``stdout.log``, ``stderr.log``), unread until asked."""

    @classmethod
    def start(
        cls, argv: list[str], *, env: dict[str, str] | None = None, logs: Path | None = None
    ) -> Served:
        """``logs``: the output written to files there, not read by threads of this process
        (a benchmark's: an access line per request read here would compete for its GIL)."""
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            with open(logs / "stdout.log", "w") as out, open(logs / "stderr.log", "w") as err:
                process = subprocess.Popen(
                    argv, stdout=out, stderr=err, text=True, env={**os.environ, **(env or {})}
                )
            return cls(process, logs=logs)
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        served = cls(process)
        for stream, into in ((process.stdout, served.stdout), (process.stderr, served.stderr)):
            assert stream is not None
            threading.Thread(target=_collect, args=(stream, into), daemon=True).start()
        return served

    def _lines(self, name: str) -> list[str]:
        if self.logs is None:
            return list(self.stdout if name == "stdout" else self.stderr)
        return (self.logs / f"{name}.log").read_text().splitlines(keepends=True)

    def wait_started(self, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self._lines("stdout"):
                if " serving https://" in line:
                    self.url = line.split(" serving ", 1)[1].split()[0]
                    return self.url
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        self.stop()
        raise AssertionError(f"the server did not start: {self.output()}")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def output(self) -> str:
        return "".join(self._lines("stdout")) + "".join(self._lines("stderr"))

    def terminate(self) -> float:
        """SIGTERM; the time it was sent (``time.monotonic``)."""
        self.process.send_signal(signal.SIGTERM)
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"still running after {timeout}s: {self.output()}") from None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def _collect(stream: IO[str], into: list[str]) -> None:
    for line in stream:
        into.append(line)
