"""A proxy that does nothing but relay: the floor of any hop between a client and a runtime.

Run: ``python bench/_floor_proxy.py CERT KEY PORT UPSTREAM_HOST UPSTREAM_PORT``; prints
``ready`` once it listens on 127.0.0.1:PORT (HTTPS, the certificate and key given, TLS 1.2 or
newer as ``broker serve``). Each client connection gets one kept-alive connection to the
upstream; each request (a head with an optional ``Content-Length`` body) is relayed as it came
but for its ``Authorization`` line (a caller's token does not reach a runtime, as through the
broker), and each answer (``Content-Length`` bodies only: the runtime's answers to
``/execute``) is relayed in one write. No token check, no lookup, no routing, no access line,
no limits: what is left of the broker's hop above this one is the broker's own work
(bench_kube_hop.py, path F). Standard library only; a benchmark's stand-in, not a server.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import sys

_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_AUTHORIZATION = re.compile(rb"\r\nauthorization:[^\r\n]*", re.IGNORECASE)


def _length(head: bytes) -> int:
    found = _LENGTH.search(head)
    return int(found.group(1)) if found else 0


async def _message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    return head, await reader.readexactly(_length(head))


async def _relay(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: tuple[str, int]
) -> None:
    up_reader, up_writer = await asyncio.open_connection(*upstream)
    try:
        while True:
            try:
                head, body = await _message(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            up_writer.write(_AUTHORIZATION.sub(b"", head) + body)
            answer, answer_body = await _message(up_reader)
            writer.write(answer + answer_body)
    finally:
        up_writer.close()
        writer.close()


async def main(cert: str, key: str, port: int, host: str, upstream_port: int) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    server = await asyncio.start_server(
        lambda r, w: _relay(r, w, (host, upstream_port)), "127.0.0.1", port, ssl=context
    )
    print("ready", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    cert_file, key_file, listen, up_host, up_port = sys.argv[1:6]
    asyncio.run(main(cert_file, key_file, int(listen), up_host, int(up_port)))
