"""A stand-in sandbox runtime for tests: answers ``GET /`` (readiness) and every other request
with ``401`` and a runtime-style body (``{"detail": ...}`` without a broker ``code``), as an
application inside a sandbox that wants its own credentials would. Started by a local broker
from its template command line (``--port {port}``)."""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    code: str | None = None

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _reply(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.command == "GET" and self.path == "/":
            status, payload = 200, {"status": "ok"}
        else:
            status, payload = 401, {"detail": "the runtime wants its own credentials"}
            if self.code:
                payload["code"] = self.code
        data = json.dumps(payload).encode()
        self.send_response(status)
        if status == 401:
            self.send_header("WWW-Authenticate", 'Basic realm="runtime"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _reply


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--code")
    args = parser.parse_args()
    Handler.code = args.code
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
