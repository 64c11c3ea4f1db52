"""Many stand-in pods in one lightweight process, for bench_kube_scale.py.

Run: ``python bench/_pod_farm.py PREFIX COUNT PORT``: listens on ``PREFIX.1`` ..
``PREFIX.COUNT`` (e.g. ``127.77.3``: 127.77.3.1 ...; more than 254 continue on the next /24:
``127.77.4.1`` ...), port ``PORT``, and prints ``ready`` once every address listens. Each is a
minimal HTTP/1.1 server with keep-alive: ``GET /`` answers ``{"status": "ok"}``, ``POST
/execute`` (the runtime's legacy command endpoint, which upstream's client calls) answers
``{"stdout": "", "stderr": "", "exit_code": 0}``, anything else ``404``; a body is read by its
``Content-Length``. It stands for 500 runtime processes that do not fit a small machine, so
that the figures measured through the broker are the broker's own (this process answers in
tens of microseconds).
"""

from __future__ import annotations

import asyncio
import json
import sys

_EXECUTE = json.dumps({"stdout": "", "stderr": "", "exit_code": 0}).encode()
_ROOT = json.dumps({"status": "ok"}).encode()


def _answer(status: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request, *lines = head.split(b"\r\n")
            length = 0
            for line in lines:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            method, target = request.split(b" ")[:2]
            if method == b"POST" and target == b"/execute":
                writer.write(_answer(b"200 OK", _EXECUTE))
            elif target == b"/":
                writer.write(_answer(b"200 OK", _ROOT))
            else:
                writer.write(_answer(b"404 Not Found", b'{"detail": "not found"}'))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


def address(prefix: str, i: int) -> str:
    """The ``i``-th address (1-based) of ``prefix`` (``A.B.C``), 254 per /24."""
    a, b, c = (int(x) for x in prefix.split("."))
    c += (i - 1) // 254
    return f"{a}.{b}.{c}.{(i - 1) % 254 + 1}"


async def main(prefix: str, count: int, port: int) -> None:
    servers = [
        await asyncio.start_server(_serve, address(prefix, i), port, backlog=64)
        for i in range(1, count + 1)
    ]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
