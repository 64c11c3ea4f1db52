"""The :class:`~._broker.LocalBroker`'s arguments checked (a clear error naming the argument,
the rule and the fix), and its listening socket with its TLS files: a CA made at start, or the
files a caller keeps (``agent-sandbox-awx dev``'s state directory)."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping, Sequence

import trustme

from ..broker._app import PROTOCOLS
from ..broker.backends.local._backend import DEFAULT_KEEP_DELETED, DEFAULT_KEEP_DELETED_SECONDS
from ..broker.backends.local._bubblewrap import ISOLATIONS
from ..broker.control._rpc import DEFAULT_WARM_POOL


def check_protocols(protocols: Sequence[str]) -> None:
    if isinstance(protocols, str) or not protocols or not set(protocols) <= set(PROTOCOLS):
        raise ValueError(
            f"protocols={protocols!r}: give a non-empty sequence of {list(PROTOCOLS)}, "
            'e.g. protocols=("rpc",)'
        )


def check_isolation(isolation: object, backend: object) -> None:
    if isolation is None:
        return
    if isolation not in ISOLATIONS:
        raise ValueError(
            f"isolation={isolation!r}: give 'auto' (bubblewrap when it works here, else none), "
            "'bwrap' or 'none'"
        )
    if backend is not None:
        raise ValueError(
            "isolation= is the default backend's: with backend=..., give the backend its own "
            "(LocalProcessLauncher(isolation=...))"
        )


def check_retention(keep_deleted: object, keep_deleted_seconds: object) -> None:
    if isinstance(keep_deleted, bool) or not isinstance(keep_deleted, int) or keep_deleted < 0:
        raise ValueError(
            f"keep_deleted={keep_deleted!r}: give the number of deleted sandboxes whose records "
            f"are kept, an integer >= 0 (default {DEFAULT_KEEP_DELETED})"
        )
    if (
        isinstance(keep_deleted_seconds, bool)
        or not isinstance(keep_deleted_seconds, int | float)
        or not keep_deleted_seconds >= 0
    ):
        raise ValueError(
            f"keep_deleted_seconds={keep_deleted_seconds!r}: give the seconds a deleted "
            f"sandbox's record is kept, a number >= 0 (default {DEFAULT_KEEP_DELETED_SECONDS:g}; "
            "math.inf: no age limit)"
        )


def all_warm_pools(
    templates: Mapping[str, object], extra: Mapping[str, str] | None
) -> dict[str, str]:
    """The ``/rpc`` warm pools, name -> template: each template's own, the original package's
    default for ``python``, then ``extra`` (``warm_pools=``)."""
    pools = {name: name for name in templates}
    if "python" in templates:
        pools[DEFAULT_WARM_POOL] = "python"
    pools.update(extra or {})
    return pools


def check_arguments(
    keep_deleted: object,
    keep_deleted_seconds: object,
    isolation: object,
    backend: object,
    protocols: Sequence[str],
    port: object,
    tls: object,
) -> None:
    """Every argument of ``LocalBroker(...)`` a rule applies to, checked (``ValueError``)."""
    check_retention(keep_deleted, keep_deleted_seconds)
    check_isolation(isolation, backend)
    check_protocols(protocols)
    check_port(port)
    check_tls(tls)


def check_port(port: object) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(
            f"port={port!r}: give the TCP port to listen on, 1 to 65535, or 0 for a free one "
            "chosen at start (the default)"
        )


def check_tls(tls: object) -> None:
    if tls is None:
        return
    if (
        not isinstance(tls, tuple)
        or len(tls) != 2
        or not all(isinstance(path, str) and path for path in tls)
    ):
        raise ValueError(
            f"tls={tls!r}: give (ca_bundle, server_pem), the paths of the CA certificate "
            "clients trust and of the server's private key with its certificate chain (one PEM "
            "file), or None for a CA made at start (the default)"
        )


class PortInUseError(OSError):
    """The port asked for (``port=``) is taken: another program listens on it."""


def listen(host: str, port: int) -> socket.socket:
    """The listening socket on ``host:port`` (0: a free port); a port that is taken raises
    :class:`PortInUseError` (an ``OSError`` with ``errno.EADDRINUSE``) naming it."""
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not a listening one's
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(
                errno.EADDRINUSE,
                f"port={port}: {host}:{port} is in use (another program listens on it); "
                "choose another port, or 0 for a free one",
            ) from None
        raise
    return sock


def make_certificates(directory: str, host: str) -> tuple[str, str]:
    """A CA made now and a certificate of ``host`` and ``localhost`` it signed: the paths of
    the CA's certificate (``ca.pem``) and of the server's key and chain (``server.pem``,
    0600) in ``directory``."""
    ca = trustme.CA()
    server_cert = ca.issue_cert(host, "localhost")
    ca_bundle = os.path.join(directory, "ca.pem")
    ca.cert_pem.write_to_path(ca_bundle)
    server_pem = os.path.join(directory, "server.pem")
    fd = os.open(server_pem, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(server_cert.private_key_and_cert_chain_pem.bytes())
    return ca_bundle, server_pem
