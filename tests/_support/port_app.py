"""A user's server in a sandbox (stdlib only), for the ports tests: ``python port_app.py PORT``.

- ``GET /headers`` (any path under it): the request's method, raw target and headers as JSON;
- ``GET /stream``: three chunks, 0.2 s apart (chunked);
- ``POST /echo``: the body back;
- ``GET /redirect``: 302 to /headers;
- ``GET /ws`` (any query) with a WebSocket handshake: echoes every text and binary frame; a
  close frame is answered with the same code, ``close:CODE`` closes with that code.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import socket
import struct
import sys
import time

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write("port_app: " + (format % args) + "\n")

    def _json(self, status: int, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        upgrade = self.headers.get("Upgrade", "").lower() == "websocket"
        if self.path.split("?")[0] == "/ws" and upgrade:
            return self._websocket()
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                data = f"chunk-{i}:{time.monotonic():.3f}\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                time.sleep(0.2)
            self.wfile.write(b"0\r\n\r\n")
            return None
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/headers")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        headers = [[k, v] for k, v in self.headers.items()]
        answer = {"method": "GET", "path": self.path, "headers": headers}
        return self._json(200, {**answer, "peer": list(self.client_address)})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _websocket(self) -> None:
        key = self.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while True:
            opcode, payload = read_frame(self.rfile)
            if opcode == 8:
                write_frame(self.wfile, 8, payload[:2])
                return
            if opcode == 1 and payload.startswith(b"close:"):
                write_frame(self.wfile, 8, struct.pack("!H", int(payload[6:])))
                read_frame(self.rfile)  # the client's close
                return
            if opcode in (1, 2):
                write_frame(self.wfile, opcode, payload)
            elif opcode == 9:
                write_frame(self.wfile, 10, payload)


def read_frame(rfile: object) -> tuple[int, bytes]:
    head = rfile.read(2)  # type: ignore[attr-defined]
    if len(head) < 2:
        return 8, b""
    opcode, length = head[0] & 0x0F, head[1] & 0x7F
    if length == 126:
        length = struct.unpack("!H", rfile.read(2))[0]  # type: ignore[attr-defined]
    elif length == 127:
        length = struct.unpack("!Q", rfile.read(8))[0]  # type: ignore[attr-defined]
    mask = rfile.read(4) if head[1] & 0x80 else b""  # type: ignore[attr-defined]
    data = rfile.read(length)  # type: ignore[attr-defined]
    if mask:
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    return opcode, data


def write_frame(wfile: object, opcode: int, payload: bytes) -> None:
    n = len(payload)
    if n < 126:
        head = bytes([0x80 | opcode, n])
    elif n < 65536:
        head = bytes([0x80 | opcode, 126]) + struct.pack("!H", n)
    else:
        head = bytes([0x80 | opcode, 127]) + struct.pack("!Q", n)
    wfile.write(head + payload)  # type: ignore[attr-defined]
    wfile.flush()  # type: ignore[attr-defined]


class Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET
    daemon_threads = True


if __name__ == "__main__":
    Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
