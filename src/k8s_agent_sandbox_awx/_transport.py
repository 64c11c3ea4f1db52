"""The sync I/O layer: one ``httpx.Client`` per client object, bearer auth, retries, timeouts.

Everything protocol-specific (what to send, how to read answers, what to retry) comes from
``_protocol`` and ``_exchange``; this module only performs the requests and the sleeps.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import httpx

from . import _flow as flow
from . import _protocol as proto
from ._auth import CredentialSource
from ._config import BrokerConnectionConfig
from ._exchange import (
    CHUNK_SIZE,
    BearerAuth,
    CappedBody,
    DownloadMeter,
    Exchange,
    UploadBody,
    client_settings,
    retry_policy,
)

__all__ = ["BearerAuth", "BrokerTransport", "UploadStream"]

logger = logging.getLogger("k8s_agent_sandbox_awx.transport")


class UploadStream(httpx.SyncByteStream):
    """A streamed upload body read from bytes or a binary file, chunk by chunk."""

    def __init__(self, body: UploadBody) -> None:
        self._body = body
        self.replayable = body.replayable

    def __iter__(self) -> Iterator[bytes]:
        body = self._body
        body.begin()
        yield body.framing.prefix
        if isinstance(body.content, bytes):
            yield from body.byte_chunks()
        while want := body.want():
            chunk = body.accept(body.content.read(want))
            if chunk:
                yield chunk
        yield body.framing.suffix


class BrokerTransport:
    """Sends ``RequestSpec``s to the broker with auth, retries and named timeouts."""

    def __init__(
        self,
        config: BrokerConnectionConfig,
        auth: CredentialSource,
        *,
        http_transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        retry: proto.RetryPolicy | None = None,
    ) -> None:
        self.config = config
        self.auth = auth
        self._sleep = sleep
        self.retry = retry or retry_policy(config)
        self._client = httpx.Client(
            transport=http_transport, **client_settings(config, auth, httpx.Response.read)
        )

    @property
    def broker_url(self) -> str:
        return self.config.broker_url

    def close(self) -> None:
        self._client.close()

    def perform(self, call: flow.Call) -> httpx.Response:
        """Perform one call of an operation (``_flow``): the read response."""
        return self.send(call.spec)

    def run(self, op: flow.Op[flow.T]) -> flow.T:
        """Run an operation of ``_flow`` to its result."""
        return flow.drive(op, self.perform)

    def send(
        self,
        spec: proto.RequestSpec,
        *,
        stream: bool = False,
        body: Any = None,
        authenticate: bool = True,
    ) -> httpx.Response:
        """Send ``spec``; return a 2xx response (or a 404 when ``spec.not_found_ok``).

        With ``stream=True`` the caller must close the response. ``body`` is the request
        stream. Errors are raised as typed ``BrokerError``s.
        """
        exchange = Exchange(
            self._client, self.config, self.retry, spec, body=body, authenticate=authenticate
        )
        while True:
            request = exchange.next_request()
            try:
                response = self._client.send(request, stream=True, auth=exchange.auth)
            except httpx.TransportError as exc:
                self._sleep(exchange.delay_after_error(exc))
                continue
            logger.debug("%s %s -> %s", spec.method, spec.path, response.status_code)
            delay = exchange.delay_after_response(response)
            if delay is None:
                break
            response.close()
            self._sleep(delay)
        if not exchange.succeeded(response):
            raise exchange.failure(response, self._error_body(response))
        if not stream:
            try:
                response.read()
            except httpx.TransportError as exc:
                raise exchange.read_error(exc) from exc
            finally:
                response.close()
        return response

    @staticmethod
    def _error_body(response: httpx.Response) -> bytes:
        capped = CappedBody()
        try:
            for chunk in response.iter_bytes():
                if capped.add(chunk):
                    break
        except httpx.HTTPError:
            pass  # the status alone is reported
        finally:
            response.close()
        return capped.data

    def stream(self, spec: proto.RequestSpec, meter: DownloadMeter) -> Generator[bytes, None, None]:
        """The answer to ``spec`` in chunks (the request is sent on first iteration)."""
        response = self.send(spec, stream=True)
        try:
            for chunk in response.iter_bytes(CHUNK_SIZE):
                yield meter.count(chunk)
        except httpx.TransportError as exc:
            raise meter.error(exc) from exc
        finally:
            response.close()

    def download(self, spec: proto.RequestSpec, meter: DownloadMeter, out: Any) -> int:
        """Stream the answer to ``spec`` into ``out.write``; the bytes written."""
        with contextlib.closing(self.stream(spec, meter)) as chunks:
            for chunk in chunks:
                out.write(chunk)
        return meter.total
