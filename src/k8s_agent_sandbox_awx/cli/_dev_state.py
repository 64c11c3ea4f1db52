"""``agent-sandbox-awx dev``'s state directory (issue 30): what lets its exports survive a
restart. One ``dev`` at a time holds it (a lock, ``dev.lock``, naming its pid); it keeps the
CA certificate and the server's key and certificate (re-used while valid for the host names,
made again otherwise), the token file (removed when ``dev`` stops: its issuer's keys die with
it) and the record (:mod:`.._local_dev`: URL, port, CA bundle, token file) that tells a later
``run`` or ``doctor`` that this ``dev`` stopped, and the next ``dev`` which port it had.

Default ``${XDG_STATE_HOME:-~/.local/state}/k8s-agent-sandbox-awx/dev``; ``--state-dir``.
The directory is 0700, the key files 0600; no key is ever printed.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import json
import os
import sys
import tempfile
from typing import Any

from .._local_dev import RECORD, default_state_dir, read_record
from ._common import write_private

__all__ = ["DevState", "certificates", "default_state_dir", "port_error"]

TOKEN_NAME = "agent-sandbox-token"  # noqa: S105 - a file name
_LOCK = "dev.lock"
_MARGIN = datetime.timedelta(days=1)  # a certificate that ends sooner is made again


class DevState:
    """The state directory of this ``dev``, locked from :meth:`hold` to :meth:`release`."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self._lock_fd: int | None = None

    def hold(self) -> DevState:
        """Make the directory (0700) and lock it; another ``dev`` holding it: ``SystemExit``
        naming its pid and URL, and the fix."""
        import fcntl

        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        if os.stat(self.directory).st_uid != os.getuid():  # its key and token would be theirs
            raise SystemExit(
                f"agent-sandbox-awx dev: the state directory {self.directory} belongs to another "
                "user. Give a directory of your own (--state-dir DIR)."
            )
        os.chmod(self.directory, 0o700)
        os.makedirs(os.path.dirname(self.token_file), mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(self.directory, _LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.read(fd, 32).decode("ascii", "replace").strip()
            os.close(fd)
            raise SystemExit(self._taken(other)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        return self

    def _taken(self, pid: str) -> str:
        record = read_record(self.directory) or {}
        url = record.get("url") if str(record.get("pid")) == pid else None
        at = f", at {url}" if url else ""
        stop = "Ctrl-C in its terminal"
        stop = f"`kill -INT {pid}` or {stop}" if pid.isdigit() else stop
        return (
            f"agent-sandbox-awx dev: another `agent-sandbox-awx dev` (pid {pid or '?'}{at}) "
            f"holds the state directory {self.directory}. Its exported lines are valid: use "
            f"them; or stop it first ({stop}); or give this one a "
            "directory of its own (--state-dir DIR, with another --port)."
        )

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the lock goes with the descriptor
            self._lock_fd = None

    @property
    def token_file(self) -> str:
        """The default token file, alone in a directory of its own (``token/``: the token is
        written as the kubelet does, with ``..data`` and a timestamped directory beside it)."""
        return os.path.join(self.directory, "token", TOKEN_NAME)

    def remove_token(self) -> None:
        """Remove the default token file and its directory (quietly: never a reason to fail)."""
        import shutil

        shutil.rmtree(os.path.dirname(self.token_file), ignore_errors=True)

    def port(self, asked: int | None, host: str) -> int:
        """``--port``, else the port of the last start here when it is free (the exports
        stay valid), else 0 (a free one; said on stderr when the last one is taken)."""
        if asked is not None:
            return asked
        last = (read_record(self.directory) or {}).get("port")
        if not isinstance(last, int) or isinstance(last, bool) or not 0 < last < 65536:
            return 0
        from ..testing._broker_setup import listen

        try:
            listen(host, last).close()
        except OSError:
            print(
                f"# the port of the last start here, {last}, is taken: this one listens on "
                "another (export the new lines; --port chooses one)",
                file=sys.stderr,
                flush=True,
            )
            return 0
        return last

    def write_record(self, **fields: Any) -> None:
        """The record (``dev.json``, 0600, replaced whole) of this start."""
        write_private(
            os.path.join(self.directory, RECORD),
            json.dumps({"pid": os.getpid(), **fields}, indent=2).encode(),
        )


def certificates(directory: str, host: str) -> tuple[str, str]:
    """``(ca.pem, server.pem)`` in ``directory``: those of the last start when they still
    fit (the server certificate names ``host`` and ``localhost``, the CA signed it, its key
    matches, neither ends within a day), else a new CA and server certificate."""
    ca_pem = os.path.join(directory, "ca.pem")
    server_pem = os.path.join(directory, "server.pem")
    if not _still_fit(ca_pem, server_pem, host):
        from ..testing._broker_setup import make_certificates

        with tempfile.TemporaryDirectory(dir=directory, prefix=".tls-") as staging:
            made_ca, made_server = make_certificates(staging, host)
            os.replace(made_server, server_pem)  # 0600 as made; the pair is checked next time
            os.replace(made_ca, ca_pem)
    return ca_pem, server_pem


def _still_fit(ca_pem: str, server_pem: str, host: str) -> bool:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    try:
        with open(ca_pem, "rb") as fh:
            ca = x509.load_pem_x509_certificate(fh.read())
        with open(server_pem, "rb") as fh:
            data = fh.read()
        leaf = x509.load_pem_x509_certificates(data)[0]
        key = serialization.load_pem_private_key(data, password=None)
        leaf.verify_directly_issued_by(ca)
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    now = datetime.datetime.now(datetime.UTC)
    return (
        key.public_key().public_bytes(*spki) == leaf.public_key().public_bytes(*spki)
        and ipaddress.ip_address(host) in names.get_values_for_type(x509.IPAddress)
        and "localhost" in names.get_values_for_type(x509.DNSName)
        and all(
            c.not_valid_before_utc <= now and c.not_valid_after_utc > now + _MARGIN
            for c in (ca, leaf)
        )
    )


def port_error(exc: OSError, port: int, asked: bool) -> str | None:
    """What ``dev`` says when its port cannot be had (``None``: not a port problem)."""
    flag = f"--port {port}" if asked else f"port {port} (of the last start here)"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"agent-sandbox-awx dev: {flag}: 127.0.0.1:{port} is in use (another program "
            "listens on it). Stop that program, or choose another --port (and export the new "
            "lines: the URL names the port)."
        )
    if exc.errno == errno.EACCES:
        return (
            f"agent-sandbox-awx dev: {flag}: this user may not listen on a port below 1024. "
            "Choose --port 1024 or above."
        )
    return None
