"""The user's server of the ports and port-forward tests (``port_app.py``): on a free port of
this host (``running_port_app``: a local sandbox's ports are the host's, so the broker's
forwarding reaches it there), or started in a sandbox as its user would start it
(``start_in_sandbox``, ``served_in_sandbox``: the SDK's and the CLI's tests)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


class PortTaken(Exception):
    """``port_app.py`` could not listen on its port: another process took it first."""


def start_in_sandbox(sandbox: Any, port: int, *, wait_seconds: float = 15) -> Any:
    """``port_app.py`` started in ``sandbox`` (a background command: its handle is returned)
    on ``port``, once it answers through the broker (``PortNotListeningError`` past
    ``wait_seconds``). The answer must be port_app's own: a port chosen free may be taken by
    another process (another test's runtime) before port_app binds it, which then exits and
    the other process answers (``PortTaken``)."""
    from k8s_agent_sandbox_awx.errors import PortNotListeningError

    handle = sandbox.commands.run([sys.executable, APP, str(port)], timeout=300, background=True)
    deadline = time.monotonic() + wait_seconds
    with sandbox.ports.client(port) as client:
        while True:
            try:
                answer = client.get("/headers")
            except PortNotListeningError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            if answer.status_code == 200 and _is_port_app(answer):
                return handle
            handle.kill()
            raise PortTaken(f"port {port} answered {answer.status_code}: not port_app.py")


def _is_port_app(answer: Any) -> bool:
    """Whether a ``GET /headers`` answer is port_app.py's (its JSON echo of the request)."""
    try:
        return isinstance(body := answer.json(), dict) and "headers" in body
    except ValueError:
        return False


@contextlib.contextmanager
def served_in_sandbox(sandbox: Any) -> Iterator[int]:
    """``port_app.py`` serving in ``sandbox`` on a free port (yielded) until the block ends (a
    port taken before port_app bound it: another free port, up to five times)."""
    for attempt in range(5):
        port = free_port()
        try:
            handle = start_in_sandbox(sandbox, port)
            break
        except PortTaken:
            if attempt == 4:
                raise
    try:
        yield port
    finally:
        handle.kill()
