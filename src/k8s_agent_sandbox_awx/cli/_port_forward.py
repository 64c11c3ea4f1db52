"""``agent-sandbox-awx port-forward NAME PORT [--local-port N]``: a sandbox's port on this host.

Prints the local URL (``http://127.0.0.1:N``, alone on standard output, so that a script can
read it) and forwards every connection to it to port ``PORT`` of sandbox ``NAME`` through the
broker (``sandbox.ports.forward``: HTTP and WebSockets, the token added per connection), until
Ctrl-C (exit 0) or SIGTERM. The forward's bounds hold (``client._port_forward``: at most
``MAX_CONNECTIONS`` connections at once, ``HEAD_SECONDS`` for a request head).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return int(text)


def _local_port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535; 0: any free one)")
    return int(text)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "port-forward",
        help="reach a port of a sandbox on 127.0.0.1 (HTTP and WebSockets) until Ctrl-C",
        description="Forward 127.0.0.1:LOCAL_PORT to port PORT of sandbox NAME through the "
        "broker. Prints the local URL; any client (a browser, curl) can use it without a token. "
        "At most 64 connections at once (one more: 503), 30 s to send a request head (then 408).",
    )
    p.add_argument("name", metavar="NAME", help="the sandbox (as `ls` shows it)")
    p.add_argument("port", metavar="PORT", type=_port, help="the port of a server in the sandbox")
    p.add_argument(
        "--local-port",
        type=_local_port,
        default=0,
        metavar="N",
        help="the local port to listen on (default 0: a free one)",
    )


def run(args: argparse.Namespace, client_of: Callable[[argparse.Namespace], Any]) -> int:
    from ..client._client import Sandbox

    client = client_of(args)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        sandbox = Sandbox(client, client.get_info(args.name))
        with sandbox.ports.forward(args.port, args.local_port) as forward:
            print(forward.url, flush=True)
            print(
                f"forwarding {forward.url} to port {args.port} of sandbox {sandbox.name} "
                "(Ctrl-C to stop)",
                file=sys.stderr,
                flush=True,
            )
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
        print("stopped", file=sys.stderr)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        client.close()
