"""The server's TLS context, re-loaded when the certificate or key file changes.

cert-manager (or a Secret volume) replaces the two files in place; the server keeps ONE
``ssl.SSLContext`` and loads the new pair into it, so that new handshakes get the new
certificate while open connections keep theirs. A new pair is first loaded into a scratch
context from the same bytes (``load_cert_chain`` into the live context with a key that does not
match would leave it with the new certificate and no key): a broken pair — unreadable, not PEM,
an encrypted key, a key that does not belong to the certificate — leaves the live context as it
was, is logged once (with the files' paths, never their content), and is tried again at the next
check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ReloadingCertificate", "TLSFilesError", "server_context"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.server")

_Stamp = tuple[tuple[int, int, int, int], ...]


class TLSFilesError(ValueError):
    """The certificate and key files cannot be used (the message names both, and why)."""


def server_context() -> ssl.SSLContext:
    """A new server context: TLS 1.2 or later, HTTP/1.1 over ALPN."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    return context


def _no_password() -> bytes:
    # never OpenSSL's prompt on the terminal: an encrypted key is refused
    raise TLSFilesError("the private key is encrypted; the broker reads unencrypted keys only")


def _stamp(files: tuple[Path, ...]) -> _Stamp:
    """What tells a replaced file: device, inode, size and modification time (of the file a
    symlink points to: a Secret volume swaps a symlink)."""
    stats = [os.stat(path) for path in files]
    return tuple((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)


@contextlib.contextmanager
def _as_files(cert: bytes, key: bytes) -> Iterator[tuple[str, str]]:
    """The bytes read as paths ``load_cert_chain`` can open: in memory where the system has
    ``memfd_create`` (the key is never written again), else in a private temporary directory."""
    if hasattr(os, "memfd_create"):
        fds = [os.memfd_create(name, os.MFD_CLOEXEC) for name in ("tls-cert", "tls-key")]
        try:
            for fd, data in zip(fds, (cert, key), strict=True):
                os.write(fd, data)
            yield f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}"
        finally:
            for fd in fds:
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="agent-sandbox-broker-tls-") as directory:
        paths = [os.path.join(directory, name) for name in ("tls.crt", "tls.key")]
        for path, data in zip(paths, (cert, key), strict=True):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
                out.write(data)
        yield paths[0], paths[1]


def _why(cert: bytes, key: bytes, exc: Exception) -> str:
    """Why a pair did not load, in words (OpenSSL's own are often just ``PEM lib``)."""
    if isinstance(exc, TLSFilesError):
        return str(exc)
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        return "the certificate file holds no PEM certificate"
    if b"PRIVATE KEY" not in key:
        return "the key file holds no PEM private key"
    if isinstance(exc, ssl.SSLError) and exc.reason == "KEY_VALUES_MISMATCH":
        return "the private key does not belong to the certificate"
    return f"OpenSSL refused them ({exc})"


class ReloadingCertificate:
    """The server's ``context`` with the pair at ``cert_file`` / ``key_file`` loaded.

    The constructor loads the pair (:class:`TLSFilesError` if it cannot be used); :meth:`check`
    re-loads it when either file changed; :meth:`watch` checks every ``interval`` seconds.
    ``reloads`` and ``failures`` count what happened (for metrics)."""

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.context = server_context()
        self.reloads = 0
        self.failures = 0
        self._loaded: _Stamp | None = None
        self._failed: tuple[_Stamp | None, str] | None = None
        self.load()

    def _files(self) -> str:
        return f"certificate {self.cert_file} and key {self.key_file}"

    def load(self) -> None:
        """Load the pair now (into a scratch context first); :class:`TLSFilesError` if not."""
        files = (self.cert_file, self.key_file)
        try:
            stamp = _stamp(files)  # before reading: a change while reading is seen next time
            cert, key = (path.read_bytes() for path in files)
        except OSError as exc:
            why = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
            raise TLSFilesError(f"the TLS {self._files()} cannot be read ({why})") from None
        try:
            with _as_files(cert, key) as (cert_path, key_path):
                server_context().load_cert_chain(cert_path, key_path, password=_no_password)
                self.context.load_cert_chain(cert_path, key_path, password=_no_password)
        except (ssl.SSLError, OSError, TLSFilesError) as exc:
            why = _why(cert, key, exc)
            raise TLSFilesError(f"the TLS {self._files()} cannot be used: {why}") from None
        self._loaded = stamp

    def check(self) -> bool:
        """Re-load the pair if either file changed; whether it was re-loaded. A failure is
        logged once per change (the old certificate stays), and tried again next time."""
        try:
            stamp: _Stamp | None = _stamp((self.cert_file, self.key_file))
        except OSError:
            stamp = None  # gone for now (a Secret volume mid-update): load() says why
        if stamp is not None and stamp == self._loaded:
            return False
        try:
            self.load()
        except TLSFilesError as exc:
            self.failures += 1
            if self._failed != (stamp, str(exc)):
                self._failed = (stamp, str(exc))
                log.error("%s; still serving the previous certificate, trying again", exc)
            return False
        self.reloads += 1
        self._failed = None
        log.info("TLS %s re-loaded: new connections get the new certificate", self._files())
        return True

    async def watch(self, interval: float) -> None:
        """Check every ``interval`` seconds, until cancelled. The checks run on the event loop
        (the context is not to be changed from another thread while it serves handshakes):
        two stat calls, and two small local files read when they changed."""
        while True:
            await asyncio.sleep(interval)
            self.check()
