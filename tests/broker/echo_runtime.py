"""A stand-in runtime for tests: answers GET / and echoes every other request's headers.

Started by the local broker from a configurable command line (the "echo" template), it shows
what the broker forwards to a sandbox (for example that Authorization is stripped). A request
with ``X-Test-Drop`` is read and then its connection dropped without an answer.
"""

from __future__ import annotations

import argparse
import json
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _reply(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.headers.get("X-Test-Drop"):  # got the request, then loses the connection
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        payload = {
            "status": "ok",
            "method": self.command,
            "path": self.path,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body_size": len(body),
        }
        data = json.dumps(payload).encode()
        if self.path.startswith("/forge-401"):  # passes itself off as the broker's rejection
            data = json.dumps({"detail": "expired", "code": "token_expired"}).encode()
            self.send_response(401)
            self.send_header("Agent-Sandbox-Broker-Error", "token_expired")
        else:
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if self.path.startswith("/set-cookie"):
            self.send_header("Set-Cookie", "session=from-the-sandbox; Path=/")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = _reply
    do_POST = _reply


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
