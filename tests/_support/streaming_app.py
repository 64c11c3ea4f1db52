"""A test app served by the broker's server runtime, run as a script:
``python streaming_app.py CONFIG``.

- ``GET /stream?chunks=N&interval=S``: N chunks (``chunk i\\n``), one every S seconds, then
  ``done\\n``: a streaming response in flight when SIGTERM comes.
- any other path: ``200 hello``.
- ``/readyz``: ready when the file named by ``$READY_FLAG`` exists (else not, naming it).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from k8s_agent_sandbox_awx.broker.config import load_config
from k8s_agent_sandbox_awx.broker.server import ServedApp, serve


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (event := (await receive())["type"]) != "lifespan.shutdown":
            if event == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] != "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hello"})
        return
    query = parse_qs(scope["query_string"].decode())
    chunks, interval = int(query["chunks"][0]), float(query["interval"][0])
    headers = [(b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for index in range(chunks):
        body = f"chunk {index}\n".encode()
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await asyncio.sleep(interval)
    await send({"type": "http.response.body", "body": b"done\n"})


def ready() -> Mapping[str, str]:
    flag = Path(os.environ["READY_FLAG"])
    return {} if flag.exists() else {"flag": f"{flag} does not exist yet"}


def main() -> None:
    config = load_config(sys.argv[1])
    serve(
        ServedApp(app, ready),
        config.server,
        on_started=lambda url: print(f"streaming app: serving {url}", flush=True),
    )
    print("streaming app: stopped", flush=True)


if __name__ == "__main__":
    main()
