"""``[server]``."""

from __future__ import annotations

from pathlib import Path

from ... import _urls
from . import _checks
from ._reader import Table
from ._schema import (
    LOG_LEVELS,
    PROTOCOLS,
    REQUEST_HEAD_SECONDS,
    WEBSOCKET_MAX_MESSAGE_BYTES,
    WEBSOCKET_MAX_PER_CALLER,
    ServerSettings,
)


def server(table: Table) -> ServerSettings:
    host, port = _checks.listen(table)
    public_url = _checks.url(
        table,
        "public_url",
        schemes=("https",),
        example='"https://sandbox-broker.example.com" (the URL clients use)',
        required=True,
    )
    cert = table.path("tls_cert_file", required=True, what="certificate file (PEM)")
    key = table.path("tls_key_file", required=True, what="private key file (PEM, unencrypted)")
    settings = ServerSettings(
        host=host,
        port=port,
        # the one URL rule: clients send tokens for this exact form (the default audience)
        public_url=_urls.normalise_url(public_url) if public_url else "",
        tls_cert_file=cert or Path(),
        tls_key_file=key or Path(),
        tls_reload_seconds=table.number("tls_reload_seconds", 30.0, above=True),
        protocols=table.strings(
            "protocols",
            PROTOCOLS,
            example='["v1", "rpc"]',
            item=lambda v: None if v in PROTOCOLS else "is not a dialect the broker serves",
        ),
        shutdown_grace_seconds=table.number("shutdown_grace_seconds", 30.0),
        keep_alive_seconds=table.number("keep_alive_seconds", 30.0, above=True),
        request_head_seconds=table.number(
            "request_head_seconds", REQUEST_HEAD_SECONDS, above=True, maximum=300.0
        ),
        websocket_max_per_caller=table.number(
            "websocket_max_per_caller",
            WEBSOCKET_MAX_PER_CALLER,
            minimum=1,
            maximum=10_000,
            integer=True,
        ),
        websocket_max_message_bytes=table.number(
            "websocket_max_message_bytes",
            WEBSOCKET_MAX_MESSAGE_BYTES,
            minimum=1024,
            maximum=64 * 1024 * 1024,
            integer=True,
        ),
        log_level=table.string("log_level", "info", example='"info"', choices=LOG_LEVELS),
        access_log=table.boolean("access_log", True),
    )
    table.finish()
    return settings
