"""The user's server of the ports tests (``port_app.py``) on a free port of this host: a local
sandbox's ports are the host's, so the broker's forwarding reaches it there."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

APP = str(Path(__file__).parent / "port_app.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def running_port_app() -> Iterator[int]:
    """``port_app.py`` serving on a free port (yielded) until the block ends."""
    port = free_port()
    process = subprocess.Popen([sys.executable, APP, str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "port_app.py did not start listening"
                time.sleep(0.05)
        yield port
    finally:
        process.kill()
        process.wait()
